"""Engine side of TeraPipe: the per-engine state and the handlers of its instructions.

Imported by the engine when the ``terapipe`` schedule is selected (see
``ds_mp.config.registry.ENGINE_SUPPORT``); :func:`attach` gives the engine a
:class:`TeraPipeState`, and the three instructions of ``ds_mp.schedules.terapipe.schedule``
are mapped to the handlers below.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ds_mp import deepspeed_compat as compat
from ds_mp.engine.pipeline_engine import DsMpPipelineEngine
from ds_mp.models.gpt2 import attending_to
from ds_mp.schedules.terapipe.kv_cache import KVContext
from ds_mp.schedules.terapipe.profile import engine_plan
from ds_mp.schedules.terapipe.schedule import BackwardSlice, ForwardSlice, LoadSlice, Plan


@dataclass
class TeraPipeState:
    """What a TeraPipe engine keeps between instructions (and train_batch calls)."""

    make_plan: Callable[[], Plan]  # collective on the first batch (auto slicing profiles the stage)
    plan: Plan | None = None
    context: KVContext = field(default_factory=KVContext)
    micro: int = -1  # micro-batch currently loaded (batch kept for its remaining slices)
    ids: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    count: torch.Tensor | None = None  # the loss denominator of the loaded micro-batch (engine/batches.py)
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


def attach(engine: Any) -> TeraPipeState:
    engine.terapipe = TeraPipeState(make_plan=lambda: engine_plan(engine))
    return engine.terapipe


def _exec_load_slice(self: Any, buffer_id: int, micro: int, rows: tuple[int, int],
                     tokens: tuple[int, int]) -> None:
    st = self.terapipe
    if st.micro != micro:  # first unit of a new micro-batch: fetch it, keep it for its slices
        inputs, (targets, denom) = compat.next_batch(self)  # engine/batches.py: targets already shifted
        ids = inputs[0] if isinstance(inputs, tuple) else inputs
        want = (sum(r for r, _ in st.plan), sum(st.plan[0][1]))
        if tuple(ids.shape) != want:
            raise RuntimeError(f"terapipe: micro-batch of shape {tuple(ids.shape)} but the slicing plan "
                               f"{st.plan} expects {want}; match data.seq_len and the micro-batch size")
        st.micro, st.ids = micro, ids.to(self.device)
        st.targets, st.count = targets.to(self.device), denom.to(self.device)  # (B, L), the loss denominator
        st.layout = self.step_info.layouts[micro]
    (r0, r1), (a, b) = rows, tokens
    if self.is_first_stage():
        pos = (torch.arange(a, b, device=self.device).unsqueeze(0) if st.layout is None  # absolute positions (1, l)
               else st.layout.positions[r0:r1, a:b])
        compat.pipe_buffers(self)["inputs"][buffer_id] = (st.ids[r0:r1, a:b].clone(), pos)
    if self.is_last_stage():
        compat.pipe_buffers(self)["labels"][buffer_id] = (st.targets[r0:r1, a:b], st.count)
    self.note_loaded(buffer_id)


def _attending(self: Any, micro: int, batch_slice: int, slice: int) -> Any:
    """This stage's blocks attending to the cache of sequence (micro, batch_slice) as slice ``slice``."""
    st = self.terapipe
    context = st.context
    context.key, context.slice = (micro, batch_slice), slice
    layout = self.step_info.layouts[micro]
    r0 = sum(rows for rows, _ in st.plan[:batch_slice])
    st.running = None if layout is None else layout.rows(r0, r0 + st.plan[batch_slice][0])
    context.requires_grad = torch.is_grad_enabled()
    return _sliced(st, attending_to(self.module.blocks(), context))


@contextlib.contextmanager
def _sliced(st: TeraPipeState, attending: Any) -> Iterator[None]:
    with attending:
        try:
            yield
        finally:
            st.running = NotImplemented


def _exec_forward_slice(self: Any, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
    compat.forget_partitioned_shapes(self)
    with _attending(self, micro, batch_slice, slice):
        self.run_forward(buffer_id)


def _exec_backward_slice(self: Any, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
    compat.forget_partitioned_shapes(self)
    with _attending(self, micro, batch_slice, slice):  # activation checkpointing recomputes the forward here
        self.run_backward(buffer_id)
    if slice == 0:  # the sequence's first slice: no later backward needs its cache
        self.terapipe.context.release((micro, batch_slice))


DsMpPipelineEngine.register_instruction(LoadSlice, _exec_load_slice)
DsMpPipelineEngine.register_instruction(ForwardSlice, _exec_forward_slice)
DsMpPipelineEngine.register_instruction(BackwardSlice, _exec_backward_slice)

__all__ = ["TeraPipeState", "attach"]
