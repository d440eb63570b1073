"""``PipelineEngine`` subclass: schedules from the registry, extra instructions, timing,
per-micro-batch losses, correct global gradient clipping, sequence-parallel grads.

Everything else (p2p, optimizer, ZeRO, bf16, checkpoints) is DeepSpeed's own.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_mp.noise_scale import NoiseScaleProbe
from ds_mp.pipeline.schedules import SCHEDULES


def _by_name(name: str) -> Callable:
    """Dispatch to ``self.<name>`` so subclass overrides of DeepSpeed's handlers apply
    (DeepSpeed's own map holds the base-class functions)."""
    def call(self: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(**kwargs)
    call.__name__ = name
    return call


class DsMpPipelineEngine(PipelineEngine):
    """DeepSpeed's pipeline engine with a pluggable schedule (``ds_mp.pipeline.schedule``)."""

    _INSTRUCTION_MAP = {instr: _by_name(fn.__name__) for instr, fn in PipelineEngine._INSTRUCTION_MAP.items()}

    def __init__(self, *args: Any, ds_mp_config: Any = None, topology: Any = None, **kwargs: Any) -> None:
        self.ds_mp_config, self.topology = ds_mp_config, topology
        self.schedule_name = ds_mp_config.pipeline.schedule if ds_mp_config else "1f1b"
        self.trace: list[tuple[str, int, float, float]] = []  # (instruction, buffer, start, end)
        self.trace_enabled = False
        self.last_grad_norm: float | None = None
        self.noise_scale = NoiseScaleProbe.from_config(ds_mp_config, topology)  # None unless DP > 1 and on
        self.nonfinite_steps = 0  # optimizer steps skipped because a gradient was NaN/Inf
        self.last_step_nonfinite = False
        self._buffer_loss: dict[int, torch.Tensor] = {}
        self._loaded_micro: dict[int, int] = {}
        self._recv_micro: dict[int, int] = {}
        self._n_loaded = self._n_recv = 0
        super().__init__(*args, **kwargs)
        if getattr(getattr(self.module, "ds_mp_ctx", None), "sp", False):
            # DeepSpeed's partitioned p2p sends 1/TP of an activation that it assumes is equal
            # on all TP ranks and all-gathers it; sequence-parallel shards differ: send whole.
            self.is_pipe_partitioned = self.is_grad_partitioned = False

    # --- extension points -------------------------------------------------------------
    @classmethod
    def register_instruction(cls, instruction: type, method: Callable) -> None:
        """Map a new ``PipeInstruction`` type to an engine method ``method(self, **kwargs)``."""
        cls._INSTRUCTION_MAP[instruction] = method

    def _train_schedule(self) -> Any:
        cls = SCHEDULES[self.schedule_name]
        if hasattr(cls, "from_engine"):
            return cls.from_engine(self)
        return cls(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._buffer_loss.clear()
        self._loaded_micro.clear()
        self._recv_micro.clear()
        self._n_loaded = self._n_recv = 0
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                method = self._INSTRUCTION_MAP.get(type(cmd))
                if method is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}; "
                                       "register it with DsMpPipelineEngine.register_instruction")
                start = time.perf_counter()
                method(self, **cmd.kwargs)
                if self.trace_enabled:
                    self.trace.append((type(cmd).__name__, cmd.kwargs.get("buffer_id", -1), start,
                                       time.perf_counter()))

    # --- activation shapes: re-announced only when they change ------------------------
    def _announce_shape(self, data_iter: Any) -> Any:
        """Keep DeepSpeed's cached activation shapes valid when the sequence length changes.

        With ``dynamic_shape`` off (everything but TeraPipe), DeepSpeed sends tensor
        metadata once.  Once per batch, stage 0 peeks at its first micro-batch and
        broadcasts the input shape along the pipeline; on a change every stage calls
        ``reset_activation_shape()`` so the next sends re-announce (DeepSpeed#4777).
        """
        if self.num_stages == 1 or self.module.dynamic_shape:
            return data_iter
        shape = torch.zeros(2, dtype=torch.long)
        it = data_iter if data_iter is not None else self.data_iterator
        if self.is_first_stage():
            first = next(it)
            ids = first[0][0] if isinstance(first[0], (tuple, list)) else first[0]
            shape[:] = torch.tensor(ids.shape[:2])
            it = itertools.chain([first], it)
        dist.broadcast(shape, src=self.topology.pp_ranks()[0], group=self.topology.pp_group)
        new = tuple(shape.tolist())
        if getattr(self, "_announced_shape", None) not in (None, new):
            self.reset_activation_shape()
        self._announced_shape = new
        return it

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        return super().train_batch(self._announce_shape(data_iter))

    def eval_batch(self, data_iter: Any, *args: Any, **kwargs: Any) -> Any:
        return super().eval_batch(self._announce_shape(data_iter), *args, **kwargs)

    # --- labels travel with their micro-batch -----------------------------------------
    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        super()._exec_load_micro_batch(buffer_id)
        self._loaded_micro[buffer_id] = self._n_loaded
        self._n_loaded += 1

    def _exec_recv_activations(self, buffer_id: int) -> None:
        super()._exec_recv_activations(buffer_id)
        self._recv_micro[buffer_id] = self._n_recv
        self._n_recv += 1

    def _exec_forward_pass(self, buffer_id: int) -> None:
        if self.is_last_stage() and not self.is_first_stage() and self._compute_loss:
            got, want = self._recv_micro.get(buffer_id), self._loaded_micro.get(buffer_id)
            if got != want:
                raise RuntimeError(f"schedule {self.schedule_name!r}: buffer {buffer_id} holds activations "
                                   f"of micro-batch {got} but labels of micro-batch {want}")
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self._buffer_loss[buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id: int) -> None:
        if self.is_last_stage():
            self.loss = self._buffer_loss.pop(buffer_id)  # this micro-batch's own loss
        super()._exec_backward_pass(buffer_id)

    # --- gradients --------------------------------------------------------------------
    def _exec_reduce_grads(self) -> None:
        ctx = getattr(self.module, "ds_mp_ctx", None)
        if ctx is not None and ctx.sp:
            # Sequence parallel: replicated params saw only this rank's tokens; sum over TP.
            for p in self.module.parameters():
                if p.grad is not None and getattr(p, "tp_kind", "") == "replicated":
                    dist.all_reduce(p.grad, group=ctx.group)
        probe = self.noise_scale
        measure = probe is not None and probe.due(self.global_steps + 1)
        if measure:  # |G_small|² of this replica before the DP all-reduce, |G_big|² after
            probe.before(self.global_grad_norm() ** 2, self.device)
        super()._exec_reduce_grads()
        if measure:
            probe.after(self.global_grad_norm() ** 2,
                        self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps())

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        """Skip the update (weights stay finite) when any gradient is NaN/Inf anywhere.

        fp16 runs keep DeepSpeed's own loss-scaler overflow handling instead.
        """
        if not self.fp16_enabled():
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            # one fused norm per dtype/device instead of a check per tensor (NaN/Inf propagate)
            total = torch.stack(torch._foreach_norm(grads)).sum() if grads else torch.zeros(())
            bad = torch.zeros(1) + (0.0 if torch.isfinite(total).item() else 1.0)
            if torch.distributed.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self.last_step_nonfinite = bool(bad.item())
            if self.last_step_nonfinite:
                self.nonfinite_steps += 1
                self.zero_grad()
                return
        super()._exec_optimizer_step(lr_kwargs)

    def global_grad_norm(self) -> float:
        """‖g‖₂ over the whole model: each TP shard once, each replicated or tied tensor
        once, all stages (DP replicas hold identical reduced gradients)."""
        return global_grad_norm(self.module, self.topology)

    def clip_fp32_gradients(self) -> None:
        norm = self.global_grad_norm()
        self.last_grad_norm = norm
        max_norm = self.gradient_clipping()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    def instruction_times(self) -> dict[str, float]:
        """Seconds spent per instruction type since the trace was last cleared."""
        out: dict[str, float] = {}
        for name, _, start, end in self.trace:
            out[name] = out.get(name, 0.0) + end - start
        return out


def global_grad_norm(module: torch.nn.Module, topology: Any) -> float:
    """Sum of squares over the parameters this rank "owns", all-reduced over TP × PP."""
    tied_first = True
    if hasattr(module, "tied_comms") and topology.pp > 1:
        tied_first = topology.pp_rank == 0  # the tied wte lives on stage 0 and the last stage
    total = torch.zeros((), dtype=torch.float64)
    tied_ids = set()
    for key in getattr(module, "tied_modules", {}):
        tied_ids |= {id(p) for p in module.tied_modules[key].parameters()}
    for p in module.parameters():
        if p.grad is None:
            continue
        if id(p) in tied_ids and not tied_first:
            continue
        if getattr(p, "tp_kind", "replicated") == "replicated" and topology.tp_rank != 0:
            continue
        total += p.grad.detach().double().pow(2).sum().cpu()
    if topology.tp * topology.pp > 1:
        total = total.to(next(module.parameters()).device)
        dist.all_reduce(total, group=topology.model_group)
    return math.sqrt(float(total))
