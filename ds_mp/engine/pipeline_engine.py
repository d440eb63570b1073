"""The engine that runs any registered schedule: extra instructions, timing, per-micro-batch
losses, correct global gradient clipping, sequence-parallel grads.

It subclasses ``deepspeed_compat.PipelineEngineAdapter``, which translates DeepSpeed's private
pipeline hooks (``_exec_*``, ``_train_schedule``, …) into the public methods below
(``run_forward``, ``send_activations``, …; DeepSpeed's own as ``deepspeed_<method>``): no private
DeepSpeed name appears here.  Everything else (p2p receive, optimizer, ZeRO, bf16) is DeepSpeed's own.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ds_mp import deepspeed_compat as compat
from ds_mp.deepspeed_compat import stage_gate
from ds_mp.deepspeed_compat.engine_adapter import PipelineEngineAdapter
from ds_mp.deepspeed_compat.grid import grad_group_loss, grad_group_mean
from ds_mp.engine import cpu_heap, layerwise, rows, zero2
from ds_mp.engine.checkpoint_api import LayoutFreeCheckpoints
from ds_mp.engine.grad_steps import GradientSteps
from ds_mp.engine.batches import MicroBook, Step, batch_source, micro_layout, prepare_step, warn_no_targets
from ds_mp.engine.joint_backward import carry_step, checked_reduction, joint_backward
from ds_mp.engine.p2p import PostedSends
from ds_mp.config.registry import ScheduleRuntime, schedule_spec
from ds_mp.config.schema import PipelineConfig


class DsMpPipelineEngine(GradientSteps, LayoutFreeCheckpoints, PipelineEngineAdapter):
    """DeepSpeed's pipeline engine with a pluggable schedule (``ds_mp.pipeline.schedule``)."""
    #: Post activation/gradient sends (isend) and wait for them at the end of the schedule,
    #: instead of DeepSpeed's blocking send (a rendezvous with the receiver on gloo).  Every
    #: schedule's messages keep their order per peer, so the receives see the same stream.
    post_sends: bool = True

    def __init__(self, *args: Any, ds_mp_config: Any = None, topology: Any = None, hf_config: Any = None,
                 optimizer_hparams: dict | None = None, layer_costs: Any = None, **kwargs: Any) -> None:
        self.ds_mp_config, self.topology = ds_mp_config, topology
        self.hf_config = hf_config  # the model's HF config (exports, checkpoints)
        self.optimizer_hparams = dict(optimizer_hparams or {})  # the JSON optimizer's params, kept by checkpoints
        self.layer_costs = layer_costs  # what "partition": "cost" balanced (None otherwise)
        self.schedule_name = (ds_mp_config.pipeline if ds_mp_config else PipelineConfig()).schedule
        self.schedule_spec = schedule_spec(self.schedule_name)
        self.trace: list[tuple[str, int, float, float]] = []  # (instruction, buffer, start, end)
        self.trace_enabled = False
        self.last_grad_norm: float | None = None
        self.noise_scale: Any = None  # use_noise_probe(): the training loop's when training.noise_scale_interval > 0
        self._noise_b_small: int | None = None  # ZeRO: a measurement waiting for the step's gradient norm
        self.nonfinite_steps = 0  # optimizer steps skipped because a gradient was NaN/Inf
        self.last_step_nonfinite = False
        self._buffer_loss: dict[int, torch.Tensor] = {}
        self.micros = MicroBook()  # which micro-batch each pipe buffer holds (engine/batches.py)
        self.posted = PostedSends()  # sends in flight, waited for once received
        self.step_info = Step()  # this step's target count, shape and per-micro-batch layouts (engine/batches.py)
        self.ds_mp_source: Any = None  # the data iterator steps read (train_batch's argument, kept)
        self.ds_mp_fed: Any = None  # the normalized micro-batches handed to DeepSpeed this step
        self.aux_reduction = "mean"  # a MoE aux loss over a step's micro-batches (use_aux_reduction)
        super().__init__(*args, **kwargs)
        stage_gate.disarm(self)
        compat.check_engine(self)
        compat.check_overrides()
        if torch.device(self.device).type == "cpu":  # no page faults re-acquiring freed memory every micro-batch
            cpu_heap.keep_freed_memory()
        if zero2.partitions_gradients(self):
            compat.check_zero2(self)
        layerwise.attach(self)  # ds_mp's Lamb: one trust ratio per model parameter, at any TP/DP/ZeRO
        if getattr(getattr(self.module, "ds_mp_ctx", None), "sp", False) or getattr(self.module, "carry", None):
            compat.send_whole_activations(self)  # shards differ (SP), or (h, carry) has two tensors with a gradient
        # The schedule's runtime (config.registry.ScheduleRuntime), made by its spec: it owns the schedule's
        # state, its methods handle the schedule's instructions (``instructions``), and its optional hooks
        # (state_dict/load_state_dict, aggregate_loss, eval_batch, …) are asked by the engine.
        self.schedule_support: ScheduleRuntime | None = self.schedule_spec.make_runtime(self)

    def use_aux_reduction(self, how: str) -> None:
        """A MoE aux loss over a step's micro-batches and replicas: "mean" (TRL's) or "sum" (HF Trainer's)."""
        self.aux_reduction = checked_reduction(how)

    def use_noise_probe(self, probe: Any) -> None:
        """Measure the gradient noise scale with ``probe`` (``training.metrics.NoiseScaleProbe``) on
        the steps it asks for; None: never."""
        self.noise_scale = probe

    def record_trace(self, on: bool = True) -> None:
        """Append every instruction's ``(name, buffer_id, start, end)`` to :attr:`trace` (GPU synced)."""
        self.trace_enabled = on

    # --- extension points (register_instruction: the adapter's) -----------------------------
    def train_schedule(self) -> Any:
        """The schedule ``train_batch`` runs (the configured one)."""
        cls = self.schedule_spec.timetable_class()
        if hasattr(cls, "from_engine"):
            return cls.from_engine(self)
        return cls(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def run_schedule(self, pipe_schedule: Any) -> None:
        """Run one schedule's instruction steps (DeepSpeed's ``_exec_schedule`` with timing,
        posted sends and per-buffer micro-batch bookkeeping)."""
        if hasattr(pipe_schedule, "posted_sends"):  # timetable schedules: sends compiled right after their value
            pipe_schedule.posted_sends = self.sends_overtake_receives()
        compat.reserve_pipe_buffers(self, pipe_schedule.num_pipe_buffers())
        compat.reset_forward_outputs(self)
        self._buffer_loss.clear()
        self.micros.start()
        self.posted.start(pipe_schedule)
        runtime = self.schedule_support  # its instructions are handled by its own (bound) methods
        handlers = {instr: getattr(runtime, name) for instr, name in getattr(runtime, "instructions", {}).items()}
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                method = handlers.get(type(cmd))
                if method is None:
                    handler = self.handler_for(cmd)  # DeepSpeed's, or one registered on the class
                    if handler is None:
                        raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}; "
                                           "give the schedule's runtime a handler for it (its `instructions`)")
                    method = functools.partial(handler, self)
                if self.trace_enabled:  # GPU kernels are asynchronous: sync so each time is its own
                    get_accelerator().synchronize()
                start = time.perf_counter()
                method(**cmd.kwargs)
                if self.trace_enabled:
                    get_accelerator().synchronize()
                    name = type(cmd).__name__
                    if "chunk" in cmd.kwargs:  # interleaved: "ChunkForward@3.1" = micro-batch 3, chunk 1
                        name += f"@{cmd.kwargs['micro']}.{cmd.kwargs['chunk']}"
                    self.trace.append((name, cmd.kwargs.get("buffer_id", -1), start, time.perf_counter()))
        self.wait_posted_sends()

    # --- p2p sends: posted, waited for once received (engine/p2p.py) ---------------------------
    def wait_posted_sends(self) -> None:
        """Wait until every posted send has left (its tensor may then change or be freed)."""
        self.posted.wait_all()

    def sends_overtake_receives(self) -> bool:
        """True when sends are posted and a send never waits behind a receive on the same link:
        gloo, whose sends and receives progress independently.  NCCL runs one rank pair's sends
        and receives in the order they were enqueued (one communicator and stream per pair), so
        a send moved ahead of a receive its peer completes first would deadlock: there timetable
        schedules keep their consumer-time order, the same on both ends of every link."""
        return self.post_sends and dist.get_backend(self.topology.pp_group) == "gloo"

    def send_activations(self, buffer_id: int) -> None:
        if not self.post_sends:
            return self.deepspeed_send_activations(buffer_id)
        peer = compat.neighbours(self)[1]
        self.posted.post(compat.activation_messages(self, buffer_id), peer, compat.stage_rank(self, peer))

    def send_grads(self, buffer_id: int) -> None:
        if not self.post_sends:
            return self.deepspeed_send_grads(buffer_id)
        peer = compat.neighbours(self)[0]
        self.posted.post(compat.grad_messages(self, buffer_id), peer, compat.stage_rank(self, peer))

    def recv_grads(self, buffer_id: int) -> None:
        self.deepspeed_recv_grads(buffer_id)
        self.posted.received_from(compat.neighbours(self)[1])

    # --- a step's micro-batches: read first, counted, shapes re-announced when they change ---------
    def data_stages(self) -> set[int]:
        """Pipeline stages that read micro-batches (DeepSpeed's: the first and the last; the
        runtime's ``data_stages`` hook where it has one)."""
        hook = getattr(self.__dict__.get("schedule_support"), "data_stages", None)
        return hook() if hook is not None else {0, self.num_stages - 1}

    def is_first_stage(self) -> bool:
        """DeepSpeed's, or the runtime's answer for the virtual stage running now (``stage_ends``)."""
        ends = self._stage_ends()
        return super().is_first_stage() if ends is None else ends[0]

    def is_last_stage(self) -> bool:
        ends = self._stage_ends()
        return super().is_last_stage() if ends is None else ends[1]

    def _stage_ends(self) -> tuple[bool, bool] | None:
        hook = getattr(self.__dict__.get("schedule_support"), "stage_ends", None)
        return hook() if hook is not None else None

    def expect_micro(self, buffer_id: int, micro: int) -> None:
        """The schedule says ``buffer_id`` holds micro-batch ``micro``'s activations (checked
        against its labels by the forward)."""
        self.micros.receive(buffer_id, micro)

    def expect_labels(self, buffer_id: int, micro: int) -> None:
        """The schedule moved micro-batch ``micro``'s labels into ``buffer_id`` (ZB-V: loaded with
        its inputs on rank 0, used by the same rank's last chunk); the forward checks them against
        :meth:`expect_micro`'s activations."""
        self.micros.load(buffer_id, micro)

    def _prepare(self, data_iter: Any, n: int, training: bool) -> Any:
        """:func:`ds_mp.engine.batches.prepare_step`, then keep DeepSpeed's cached activation
        shapes valid: with ``dynamic_shape`` off (everything but TeraPipe) DeepSpeed sends tensor
        metadata once; when the batch shape changes every stage calls ``reset_activation_shape()``
        so the next sends re-announce (DeepSpeed#4777)."""
        source = data_iter
        if training and self.stage_id in self.data_stages():  # the iterator this and later steps read
            source = self.ds_mp_source = batch_source(data_iter, self.ds_mp_source, self.data_iterator, self.ds_mp_fed)
        fed, self.step_info = prepare_step(self, source, n)
        rows.start(self, training)
        carry_step(self.module, n * self.topology.grad_size, self.aux_reduction, training)
        if fed is not None:
            self.ds_mp_fed = fed
        if self.num_stages > 1 and not self.module.dynamic_shape:
            if getattr(self, "_announced_shape", None) not in (None, self.step_info.shape):
                self.reset_activation_shape()
            self._announced_shape = self.step_info.shape
        return fed

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """DeepSpeed's ``train_batch`` on any accepted batch form (``ds_mp.models.batch``), returning
        the global batch's per-target-token mean loss; a batch without targets skips the step."""
        fed = self._prepare(data_iter, self.micro_batches, training=True)
        if self.step_info.count == 0:
            return compat.set_train_loss(self, warn_no_targets(self))
        with compat.batch_fn_done(self):
            return super().train_batch(fed)

    def eval_batch(self, data_iter: Any, *args: Any, num_micro_batches: int | None = None, **kwargs: Any) -> Any:
        hook = getattr(self.schedule_support, "eval_batch", None)
        if hook is not None:
            return hook(data_iter, *args, num_micro_batches=num_micro_batches, **kwargs)
        fed = self._prepare(data_iter, num_micro_batches or self.micro_batches, training=False)
        with compat.batch_fn_done(self):
            return super().eval_batch(fed, *args, num_micro_batches=num_micro_batches, **kwargs)

    def step_rows(self) -> dict[str, torch.Tensor]:
        """The last step's per-row loss values, every DP replica's, on every rank (collective)."""
        return rows.step_rows(self)

    def step_carries(self) -> torch.Tensor | None:
        """The last eval step's per-micro-batch carries (a MoE's router sums), every DP replica's, on every
        rank (collective); None without a carry."""
        return rows.step_carries(self)

    def micro_layout(self, buffer_id: int, forward: bool = False) -> Any:
        """Context: the model attends with the layout of the micro-batch in ``buffer_id``
        (:func:`ds_mp.engine.batches.micro_layout`)."""
        return micro_layout(self, buffer_id, forward)

    def reduce_outputs(self, outputs: Any, reduce: str | None = "avg", reduce_dp: bool = True,
                       micro_batches: int | None = None) -> Any:
        """``eval_batch``'s reduction (DeepSpeed's); at cp > 1 over dp × cp (``grid.grad_group_mean``)."""
        cp = self.topology.cp > 1 and reduce_dp and reduce is not None
        out = self.deepspeed_reduce_outputs(outputs, reduce, reduce_dp and not cp, micro_batches)
        return grad_group_mean(self, out) if cp else out

    def aggregate_loss(self) -> torch.Tensor:
        hook = getattr(self.schedule_support, "aggregate_loss", None)  # at cp > 1 DeepSpeed's divides by dp only
        own = grad_group_loss if self.topology.cp > 1 else PipelineEngineAdapter.deepspeed_aggregate_loss
        return hook() if hook is not None else own(self)

    # --- schedule state that lives across steps (checkpointed per rank) -----------------
    def schedule_state_dict(self) -> dict | None:
        """The schedule's in-flight state on this rank, or None if it keeps none."""
        return self.schedule_support.state_dict() if self.keeps_schedule_state() else None

    def keeps_schedule_state(self) -> bool:
        """True if the schedule keeps work in flight across steps (its checkpoints carry it)."""
        return hasattr(self.schedule_support, "state_dict")

    def schedule_state_tp_free(self) -> bool:
        """True if the schedule's in-flight state is the same on every TP rank (it then resumes
        at another TP degree)."""
        return bool(getattr(self.schedule_support, "tp_free", lambda: False)())

    def load_schedule_state_dict(self, state: dict) -> None:
        self.schedule_support.load_state_dict(state)

    # --- labels travel with their micro-batch -----------------------------------------
    def note_loaded(self, buffer_id: int) -> None:
        """Record that ``buffer_id`` now holds the labels of the next micro-batch in order."""
        self.micros.load(buffer_id)

    def load_micro_batch(self, buffer_id: int) -> None:
        self.deepspeed_load_micro_batch(buffer_id)
        self.note_loaded(buffer_id)

    def recv_activations(self, buffer_id: int) -> None:
        self.deepspeed_recv_activations(buffer_id)
        self.micros.receive(buffer_id)
        self.posted.received_from(compat.neighbours(self)[0])

    def run_forward(self, buffer_id: int) -> None:
        """Forward pipe buffer ``buffer_id`` through this stage (DeepSpeed's ForwardPass)."""
        if self.is_last_stage() and not self.is_first_stage() and compat.computing_loss(self):
            got, want = self.micros.received.get(buffer_id), self.micros.loaded.get(buffer_id)
            if got != want:
                raise RuntimeError(f"schedule {self.schedule_name!r}: buffer {buffer_id} holds activations "
                                   f"of micro-batch {got} but labels of micro-batch {want}")
        with self.micro_layout(buffer_id, forward=True):
            self.deepspeed_run_forward(buffer_id)
        if self.is_last_stage():
            self._buffer_loss[buffer_id] = self.loss

    def run_backward(self, buffer_id: int) -> None:
        """Backward pipe buffer ``buffer_id`` (DeepSpeed's BackwardPass)."""
        with self.micro_layout(buffer_id):  # activation checkpointing recomputes the forward here
            self._backward(buffer_id)
        if zero2.partitions_gradients(self):  # ZeRO-2: this backward's gradients reduced over DP now
            zero2.close_backward(self)

    def _backward(self, buffer_id: int) -> None:
        if not self.is_last_stage():  # earlier stages backpropagate the (scaled) gradient they received
            with joint_backward(self.module):  # (h, carry): one backward (engine/joint_backward.py)
                self.deepspeed_run_backward(buffer_id)
            return
        loss = self._buffer_loss.pop(buffer_id)  # this micro-batch's own loss
        scale = compat.unapplied_loss_scale(self)  # fp16 without ZeRO: DeepSpeed's backward skips it
        self.loss = loss if scale is None else loss * scale
        try:
            self.deepspeed_run_backward(buffer_id)
        finally:
            self.loss = loss

    def instruction_times(self) -> dict[str, float]:
        """Seconds spent per instruction type since the trace was last cleared."""
        out: dict[str, float] = {}
        for name, _, start, end in self.trace:
            name = name.partition("@")[0]  # one total per instruction type, not per (micro-batch, chunk)
            out[name] = out.get(name, 0.0) + end - start
        return out


