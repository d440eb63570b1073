"""What ``checkpoint/``, ``training/`` and ``tools/`` may read of an engine: the typed view
:class:`EngineView` (ground floor, imports nothing of the engine); what a schedule's timetable
reads to build a step: :class:`StageView`; and what the engine floor's runtimes and helpers read
of the engine they serve: :class:`RuntimeEngine` (both also on the ground floor, so the spec
registry and the timetables below the engine can name them).

``ds_mp.initialize`` returns a ``DsMpPipelineEngine`` (``ds_mp/engine/pipeline_engine.py``), which
has all of it: DeepSpeed's public engine API plus what ds_mp gives it at construction (the
topology, the validated config, the model's HF config, the JSON optimizer's parameters) and the
methods by which a run sets what it measures (``use_noise_probe``, ``record_trace``).  A floor
above the engine takes an ``EngineView`` and never sets an attribute on it
(``tests/test_architecture.py``)."""
from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

import torch

from ds_mp.config.schema import DsMpConfig
from ds_mp.topology import Topology

Trace = list[tuple[str, int, float, float]]  # (instruction, buffer_id, start, end) per executed instruction


class EngineView(Protocol):
    """The engine as the floors above it see it."""

    module: torch.nn.Module  # this rank's pipeline stage: parameters, ds_mp_ctx (layout), layer names
    topology: Topology  # the TP × PP × DP grid and this rank's place in it
    ds_mp_config: Optional[DsMpConfig]  # the validated "ds_mp" block
    hf_config: Any  # the model's HF config (exports, checkpoints)
    optimizer_hparams: dict  # the JSON optimizer's params, kept by checkpoints
    optimizer: Any  # DeepSpeed's optimizer wrapper (or the torch optimizer)
    lr_scheduler: Any  # the LR scheduler, or None
    schedule_name: str  # the registered name of the schedule it runs
    device: torch.device
    global_steps: int  # DeepSpeed's counters (a resume restores them through deepspeed_compat)
    global_samples: int
    skipped_steps: int
    nonfinite_steps: int  # optimizer steps skipped because a gradient was NaN/Inf
    last_step_nonfinite: bool
    trace: Trace  # recorded instructions since the caller last cleared it (record_trace)
    step_info: Any  # the last step's target count (``.count``), shape and micro-batch layouts (engine/batches.Step)

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over a global batch; the per-target-token mean loss."""

    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: Optional[int] = None,
                   **kwargs: Any) -> Any:
        """The loss of a batch, no update."""

    def train_batch_size(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's batch change: more micro-batches per step."""

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> Optional[float]: ...

    def instruction_times(self) -> dict[str, float]:
        """Seconds spent per instruction type since the trace was last cleared."""

    def record_trace(self, on: bool = True) -> None:
        """Append every instruction to :attr:`trace`."""

    def use_noise_probe(self, probe: Any) -> None:
        """Measure the gradient noise scale with ``probe``; None: never."""

    def keeps_schedule_state(self) -> bool:
        """The schedule keeps work in flight across steps (checkpoints carry it)."""

    def schedule_state_dict(self) -> Optional[dict]:
        """The schedule's in-flight state on this rank, or None."""

    def load_schedule_state_dict(self, state: dict) -> None: ...

    def schedule_state_tp_free(self) -> bool:
        """The in-flight state is the same on every TP rank (resumes at another TP degree)."""

    def step_rows(self) -> dict[str, torch.Tensor]:
        """The last train/eval step's per-row loss values (``LossSpec.rows``), every DP replica's, on
        every rank (collective)."""

    def step_carries(self) -> Optional[torch.Tensor]:
        """The last eval step's per-micro-batch carries (a MoE's router sums, ``ds_mp.models.carry``),
        ``(dp · M, size)``, every DP replica's, on every rank (collective); None without a carry."""


class StageView(Protocol):
    """What a timetable's ``from_engine`` reads: the step's size and this rank's place."""

    micro_batches: int  # micro-batches of this step (gradient accumulation steps)
    num_stages: int  # pipeline stages (Ouroboros: its ring ranks)
    stage_id: int  # this rank's stage
    ds_mp_config: Optional[DsMpConfig]  # the schedule's own options (pipeline.*, terapipe.*)
    module: torch.nn.Module  # this rank's pipeline stage (its layers and ds_mp_ctx)


class RuntimeEngine(EngineView, StageView, Protocol):
    """The engine as the engine floor's runtimes and helpers read it (``DsMpPipelineEngine``):
    the views above, the step's micro-batch layouts, and the instruction steps a runtime composes
    (its own handlers run the engine's forward, backward, reductions and step).  DeepSpeed's
    internals are not here: they are read only through ``deepspeed_compat``'s accessors."""

    schedule_support: Any  # the schedule's runtime (config.registry.ScheduleRuntime), or None
    batch_fn: Any  # DeepSpeed's per-micro-batch conversion (PipelineEngine.batch_fn)
    grid: Any  # DeepSpeed's PipelineParallelGrid (stage -> global rank)
    micros: Any  # which micro-batch each pipe buffer holds (engine/batches.MicroBook)

    def is_first_stage(self) -> bool: ...

    def is_last_stage(self) -> bool: ...

    def data_stages(self) -> set[int]:
        """The stages that read micro-batches (the schedule's runtime may widen the ends)."""

    def expect_micro(self, buffer_id: int, micro: int) -> None:
        """Pipe buffer ``buffer_id`` holds micro-batch ``micro`` (its layout, its targets)."""

    def micro_layout(self, buffer_id: int, forward: bool = False) -> Any:
        """Context: the layout of the micro-batch in ``buffer_id`` is the one blocks read."""

    def run_forward(self, buffer_id: int) -> None: ...

    def run_backward(self, buffer_id: int) -> None: ...

    def reduce_gradients(self) -> None: ...

    def optimizer_step(self, lr_kwargs: Any = None) -> None: ...

    def zero_optimization_partition_gradients(self) -> bool: ...


__all__ = ["EngineView", "RuntimeEngine", "StageView", "Trace"]
