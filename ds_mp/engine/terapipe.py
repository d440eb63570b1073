"""Engine side of TeraPipe: the per-engine state and the handlers of its instructions.

Imported by the engine when the ``terapipe`` schedule is selected (see
its spec, ``ds_mp.schedules.terapipe.spec``); :func:`attach` makes the engine's runtime, a
:class:`TeraPipeState`, whose methods handle the three instructions of
``ds_mp.schedules.terapipe.schedule``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ds_mp import deepspeed_compat as compat
from ds_mp.models.pipeline import attending_to
from ds_mp.engine.terapipe_kv import KVContext
from ds_mp.engine.terapipe_profile import engine_plan
from ds_mp.schedules.terapipe.schedule import BackwardSlice, ForwardSlice, LoadSlice, Plan
from ds_mp.engine_view import RuntimeEngine


@dataclass
class TeraPipeState:
    """TeraPipe's runtime: what an engine keeps between instructions (and train_batch calls), and
    the handlers of its instructions (``instructions``)."""

    engine: RuntimeEngine
    make_plan: Callable[[], Plan]  # collective on the first batch (auto slicing profiles the stage)
    plan: Plan | None = None
    context: KVContext = field(default_factory=KVContext)
    micro: int = -1  # micro-batch currently loaded (batch kept for its remaining slices)
    ids: torch.Tensor | None = None
    labels: tuple | None = None  # the loaded micro-batch's label tuple (its LossSpec's: targets, denominator, extras)
    layout: Any = None  # the loaded micro-batch's ds_mp.models.batch.Layout (None: plain causal)
    running: Any = NotImplemented  # the layout of the slice being run (its batch slice's rows), set by _attending

    def layout_of(self, buffer_id: int) -> Any:  # noqa: ARG002 - the engine's hook: the running slice's
        return self.running  # NotImplemented outside a slice (eval_batch's whole sequences): the engine's own

    def new_batch(self) -> Plan:
        """The slicing plan (made once), with the loaded micro-batch forgotten."""
        if self.plan is None:
            self.plan = self.make_plan()
        self.micro = -1  # LoadSlice fetches micro-batch 0 afresh
        return self.plan

    # --- instruction handlers ---------------------------------------------------------------
    def load_slice(self, buffer_id: int, micro: int, rows: tuple[int, int], tokens: tuple[int, int]) -> None:
        e = self.engine
        if self.micro != micro:  # first unit of a new micro-batch: fetch it, keep it for its slices
            inputs, labels = compat.next_batch(e)  # engine/batches.py: the loss spec's labels, targets shifted
            ids = inputs[0] if isinstance(inputs, tuple) else inputs
            want = (sum(r for r, _ in self.plan), sum(self.plan[0][1]))
            if tuple(ids.shape) != want:
                raise RuntimeError(f"terapipe: micro-batch of shape {tuple(ids.shape)} but the slicing plan "
                                   f"{self.plan} expects {want}; match data.seq_len and the micro-batch size")
            self.micro, self.ids = micro, ids.to(e.device)
            self.labels = tuple(x.to(e.device) for x in labels)
            self.layout = e.step_info.layouts[micro]
        (r0, r1), (a, b) = rows, tokens
        if e.is_first_stage():
            pos = (torch.arange(a, b, device=e.device).unsqueeze(0) if self.layout is None  # absolute positions (1, l)
                   else self.layout.positions[r0:r1, a:b])
            compat.pipe_buffers(e)["inputs"][buffer_id] = (self.ids[r0:r1, a:b].clone(), pos)
        if e.is_last_stage():
            # the slice's targets, the whole micro-batch's denominator: slice losses sum to its loss
            labels = e.module.loss_spec.token_slice(self.labels, slice(r0, r1), slice(a, b))
            compat.pipe_buffers(e)["labels"][buffer_id] = labels
        e.note_loaded(buffer_id)

    def forward_slice(self, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
        compat.forget_partitioned_shapes(self.engine)
        with self._attending(micro, batch_slice, slice):
            self.engine.run_forward(buffer_id)

    def backward_slice(self, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
        compat.forget_partitioned_shapes(self.engine)
        with self._attending(micro, batch_slice, slice):  # activation checkpointing recomputes the forward here
            self.engine.run_backward(buffer_id)
        if slice == 0:  # the sequence's first slice: no later backward needs its cache
            self.context.release((micro, batch_slice))

    instructions = {LoadSlice: "load_slice", ForwardSlice: "forward_slice", BackwardSlice: "backward_slice"}

    def _attending(self, micro: int, batch_slice: int, slice: int) -> Any:
        """This stage's blocks attending to the cache of sequence (micro, batch_slice) as slice ``slice``."""
        context = self.context
        context.key, context.slice = (micro, batch_slice), slice
        layout = self.engine.step_info.layouts[micro]
        r0 = sum(rows for rows, _ in self.plan[:batch_slice])
        self.running = None if layout is None else layout.rows(r0, r0 + self.plan[batch_slice][0])
        context.requires_grad = torch.is_grad_enabled()
        return self._sliced(attending_to(self.engine.module.blocks(), context))

    @contextlib.contextmanager
    def _sliced(self, attending: Any) -> Iterator[None]:
        with attending:
            try:
                yield
            finally:
                self.running = NotImplemented


def attach(engine: RuntimeEngine) -> TeraPipeState:
    """The runtime of a TeraPipe engine (made by its spec, ``config.registry.ScheduleSpec.runtime``)."""
    return TeraPipeState(engine=engine, make_plan=lambda: engine_plan(engine))


__all__ = ["TeraPipeState", "attach"]
