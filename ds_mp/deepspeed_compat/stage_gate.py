"""ZeRO-2 under ``PipelineEngine``: the one shim ds_mp keeps against a DeepSpeed check.

``PipelineEngine.__init__`` calls ``DeepSpeedEngine.__init__`` (which builds the stage-2
optimizer from the config) and then asserts ``zero_optimization_stage() < 2``; ds_mp drives
stage 2's gradient reduction from the pipeline's own instructions (``ds_mp/engine/zero2.py``),
so that assert is the only thing between the pipeline engine and ZeRO-2.  DeepSpeed offers no
construction path around it (``deepspeed.initialize`` and ``PipelineEngine`` both build the
optimizer from the stage the assert reads), hence this shim — why it is honest enough:

* no stack frames, no patched function: :class:`PipelineStageGate` sits between
  ``PipelineEngine`` and ``DeepSpeedEngine`` in the engine's method resolution order (cooperative
  inheritance), so ``PipelineEngine.__init__``'s ``super().__init__()`` runs through it; when
  ``DeepSpeedEngine.__init__`` returns — the optimizer built with the real stage — it arms a
  one-shot: the next ``zero_optimization_stage()`` read, the assert on the next line, sees
  ``min(stage, 1)``; every other read, before and after, sees the real stage;
* every way a DeepSpeed change could break it fails loudly: a new read of the stage between the
  two lines takes the one-shot and the assert then fails; an assert removed leaves the one-shot
  armed, and :func:`disarm` drops it when the engine's constructor returns.

Tested in ``tests/test_zero2.py`` (the stage seen by the assert, by the optimizer's construction
and after construction).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed.runtime.engine import DeepSpeedEngine

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine


class PipelineStageGate(DeepSpeedEngine):
    """Put after ``PipelineEngine`` in an engine subclass's bases: ``class E(PipelineEngine,
    PipelineStageGate)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # DeepSpeedEngine.__init__: the optimizer built at the real stage
        self.__dict__["_ds_mp_stage_for_pipeline_assert"] = True  # PipelineEngine.__init__'s next line reads it

    def zero_optimization_stage(self) -> int:
        stage = super().zero_optimization_stage()
        if self.__dict__.pop("_ds_mp_stage_for_pipeline_assert", False):
            return min(stage, 1)
        return stage


def disarm(engine: PipelineEngine) -> None:
    """After the engine's constructor: no later read of the stage may see the one-shot."""
    engine.__dict__.pop("_ds_mp_stage_for_pipeline_assert", None)


__all__ = ["PipelineStageGate", "disarm"]
