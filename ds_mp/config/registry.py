"""Schedule names -> where their classes live (a table; imports nothing).

``"ds_mp": {"pipeline": {"schedule": NAME}}`` picks a schedule by name.  Config validation
reads :data:`SCHEDULES` to check the name without importing DeepSpeed's pipeline engine or
any schedule; the engine resolves the entry with :func:`resolve` when it builds one.

An entry is ``"module:attribute"`` of a ``deepspeed.runtime.pipe.schedule.PipeSchedule``
subclass, or the class itself (user schedules registered with :func:`register_schedule`).
A schedule class may define ``from_engine(engine)`` to read its options; otherwise it is
built as ``cls(micro_batches=, stages=, stage_id=)`` (:class:`TimetableHooks`).  A schedule with
instructions or state of its own has a runtime (:class:`ScheduleRuntime`), made per engine by
its factory in :data:`ENGINE_SUPPORT` (a built-in names its module, whose ``attach`` is the
factory; ``register_schedule(name, cls, runtime=)`` gives a user's schedule the same).

This module is on the ground floor, in ``ds_mp.config`` (which validates the name against it):
it is a table of names and imports no schedule.  ``ds_mp.schedules.registry`` re-exports it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar, Iterator, Protocol, Union

SCHEDULES: dict[str, Union[str, type]] = {
    "1f1b": "ds_mp.schedules.gpipe:OneFOneB",
    "gpipe": "ds_mp.schedules.gpipe:GPipe",
    "terapipe": "ds_mp.schedules.terapipe.schedule:TeraPipeSchedule",
    "ouroboros": "ds_mp.schedules.ouroboros.timetable:OuroborosSchedule",
    "zb-h1": "ds_mp.schedules.zero_bubble:ZeroBubbleH1",
    "interleaved": "ds_mp.schedules.interleaved:Interleaved1F1B",
    "zb-v": "ds_mp.schedules.zb_v:ZeroBubbleV",
}

class TimetableHooks(Protocol):
    """What the engine asks of a schedule class (a ``PipeSchedule`` subclass), each optional:
    absent, the default in brackets applies."""

    dynamic_shape: ClassVar[bool]  # activation shapes change between sends: announce each one [False]
    posted_sends: bool  # set by the engine on a timetable schedule: compile sends for posting [absent: not compiled]

    @classmethod
    def from_engine(cls, engine: Any) -> "TimetableHooks":
        """Build the step's schedule from the engine [``cls(micro_batches=, stages=, stage_id=)``]."""

    @staticmethod
    def pipeline_layout(cfg: Any, hf_config: Any) -> tuple[list[str], list[int]]:
        """The pipeline's layer order and stage bounds (Ouroboros' ring) [the family's, partitioned]."""

    def acknowledged(self) -> list[int]:
        """Per receive, how many of this stage's sends to the sender it acknowledges [all so far]."""


class ScheduleRuntime(Protocol):
    """A schedule's runtime: made once per engine by its factory (``ENGINE_SUPPORT``), it owns the
    schedule's state; its methods named in ``instructions`` handle the schedule's own instruction
    types (called with the instruction's kwargs).  Every hook below is optional: absent, the engine
    does what the bracket says."""

    instructions: ClassVar[dict[type, str]]  # instruction type -> name of the method handling it [none]
    takes_layouts: ClassVar[bool]  # it attends with packed/padded layouts [True]

    def state_dict(self) -> dict:
        """Work in flight across steps, saved per rank in checkpoints [no state: not saved]."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s work in flight."""

    def tp_free(self) -> bool:
        """The state is the same on every TP rank (resumes at another TP degree) [False]."""

    def aggregate_loss(self) -> Any:
        """``train_batch``'s loss on every stage [DeepSpeed's: the loss stage's mean, broadcast]."""

    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: int | None = None, **kwargs: Any) -> Any:
        """The whole of ``eval_batch`` [DeepSpeed's inference schedule]."""

    def layout_of(self, buffer_id: int) -> Any:
        """The layout the model attends with for ``buffer_id`` (NotImplemented: the engine's) [the engine's]."""

    def data_stages(self) -> set[int]:
        """The pipeline stages that read micro-batches [first and last]."""

    def stage_ends(self) -> tuple[bool, bool] | None:
        """(first, last): whether the (virtual) stage running now is the pipe's first/last [DeepSpeed's]."""


RuntimeFactory = Callable[[Any], ScheduleRuntime]

# schedule name -> its runtime: a factory engine -> runtime, or (built-ins) the module whose attach() is one
ENGINE_SUPPORT: dict[str, Union[str, RuntimeFactory]] = {
    "terapipe": "ds_mp.engine.terapipe",
    "ouroboros": "ds_mp.engine.ouroboros",
    "zb-h1": "ds_mp.engine.zero_bubble",
    "interleaved": "ds_mp.engine.interleaved",
    "zb-v": "ds_mp.engine.zb_v",
}


def register_schedule(name: str, cls: type, runtime: RuntimeFactory | None = None) -> type:
    """Register ``cls`` (a ``PipeSchedule`` subclass, :class:`TimetableHooks`) as ``name``, with
    ``runtime(engine)`` making its :class:`ScheduleRuntime` (handlers of its own instructions, its
    state, its hooks) as the built-ins have; returns ``cls``."""
    from deepspeed.runtime.pipe.schedule import PipeSchedule

    if not (isinstance(cls, type) and issubclass(cls, PipeSchedule)):
        raise TypeError(f"schedule {name!r} must be a PipeSchedule subclass, got {cls!r}")
    if runtime is not None and not callable(runtime):
        raise TypeError(f"schedule {name!r}: runtime must be a callable engine -> runtime, got {runtime!r}")
    SCHEDULES[name] = cls
    if runtime is not None:
        ENGINE_SUPPORT[name] = runtime
    return cls


def resolve(name: str) -> type:
    """The schedule class registered as ``name`` (importing it on first use)."""
    entry = SCHEDULES[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry


__all__ = ["SCHEDULES", "ENGINE_SUPPORT", "ScheduleRuntime", "TimetableHooks", "RuntimeFactory", "register_schedule",
           "resolve"]
