"""Engine side of ZB-V: the V placement's chunks, each with ZB-H1's split backward.

Imported by the engine when the ``zb-v`` schedule is selected (its spec's runtime: :func:`attach`).  The module is
built in the V placement (``ZeroBubbleV.pipeline_layout``: rank r holds chunk r, then chunk
2P − 1 − r, as consecutive runs of its layers).  Two pieces are reused as they are:

* the chunk switch of interleaved 1F1B (:class:`~ds_mp.engine.interleaved.InterleavedState`):
  inside a chunk instruction the module runs that chunk's layers only and ``is_first_stage()`` /
  ``is_last_stage()`` answer for its virtual stage (the first: rank 0's chunk 0; the last: rank
  0's chunk 1, which computes the loss);
* ZB-H1's B and W (:class:`~ds_mp.engine.zero_bubble.ZeroBubbleState`), run inside the chunk: B
  computes the chunk input's gradient and records what W needs; on the first virtual stage B
  keeps the received gradient and W is the whole backward.

What the V adds (this module):

* **Both ends on rank 0.**  The micro-batch is loaded at chunk 0's forward (inputs and labels at
  once); its labels wait, keyed by micro-batch, for chunk 1's forward, which computes the loss.
  The tied GPT-2 embedding (``wte`` at chunk 0, the LM head at chunk 2P − 1) is one module on rank
  0: both backwards accumulate into its one ``.grad``, and its tied group is rank 0 alone, so the
  tied all-reduce adds nothing (no gradient missed or doubled).
* **The turn** on rank P − 1: chunk P − 1's output is chunk P's input on the same rank (no message):
  chunk P's forward takes it detached as a leaf, and chunk P's B hands the leaf's gradient to
  chunk P − 1's B as a received gradient — both in DeepSpeed's wire form (with TP, the activation
  and its gradient partitioned over the TP ranks, rebuilt by DeepSpeed's own handlers).
* **The loss**: each micro-batch's loss is summed on rank 0 and ``aggregate_loss`` averages it over
  micro-batches and DP replicas and broadcasts it along the pipe (DeepSpeed's reads the physical
  last stage).  ``eval_batch`` runs the forward-only V with the same bookkeeping.

p2p: a rank's neighbours change with the chunk (chunk 0 flows down the ranks, chunk 1 up), so
every transfer is preceded by :class:`~ds_mp.schedules.zb_v.VPeer` naming its other end.  Every
boundary carries the hidden state ``(B, T, H)``: at P = 2 each rank has one peer and DeepSpeed's
once-announced shapes hold; at P > 2 a middle rank receives from both sides, and every message
announces its shape (DeepSpeed's ``dynamic_shape`` behaviour).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.engine.interleaved import InterleavedState
from ds_mp.engine.zero_bubble import ZeroBubbleState
from ds_mp.models.pipeline import v_pipeline_layout
from ds_mp.schedules.zb_v import VBackwardInput, VBackwardWeight, VForward, VPeer, ZeroBubbleV
from ds_mp.engine_view import RuntimeEngine


class ZeroBubbleVState(InterleavedState):
    """One rank's two V chunks, the split backward in each, and what crosses inside the rank
    (labels from chunk 0 to chunk 2P − 1 on rank 0, activations and gradients at the turn)."""

    def __init__(self, engine: RuntimeEngine) -> None:
        P, r = engine.num_stages, engine.stage_id
        _, _, chunk_parts = v_pipeline_layout(engine.hf_config, P, engine.ds_mp_config.pipeline.partition,
                                              engine.layer_costs)
        super().__init__(engine, virtual=[r, 2 * P - 1 - r], bounds=chunk_parts)
        self.P = P
        self.split = ZeroBubbleState(engine)
        self.micro_of: dict[int, int] = {}  # pipe buffer -> the micro-batch its unit belongs to
        self.labels: dict[int, Any] = {}  # micro-batch -> its labels, loaded at chunk 0 (rank 0)
        self.turn: dict[int, Any] = {}  # micro-batch -> chunk P − 1's output, then chunk P's input gradient
        self.loss_sum: torch.Tensor | None = None  # this step's micro-batch losses, summed (rank 0)
        if P > 2:  # a middle rank receives activations from both sides: each message announces its shape
            compat.announce_every_shape(engine)

    instructions = {VForward: "forward", VBackwardInput: "backward_input", VBackwardWeight: "backward_weight",
                    VPeer: "peer"}

    def peer(self, prev: int | None = None, next: int | None = None) -> None:  # noqa: A002 - the instruction's kwarg
        """Point the pipe's p2p at the next transfer's other end (:class:`VPeer`)."""
        was = compat.neighbours(self.engine)
        compat.set_neighbours(self.engine, was[0] if prev is None else prev, was[1] if next is None else next)

    def data_stages(self) -> set[int]:
        """Only rank 0 reads micro-batches (both ends of the V)."""
        return {0}

    def layout_of(self, buffer_id: int) -> Any:
        """The layout of the micro-batch whose unit holds ``buffer_id`` (documents, padding)."""
        layouts = self.engine.step_info.layouts
        micro = self.micro_of.get(buffer_id, 0)
        return layouts[micro] if micro < len(layouts) else None

    def forward(self, buffer_id: int, chunk: int, micro: int) -> None:
        e, bufs, vs = self.engine, compat.pipe_buffers(self.engine), self.virtual[chunk]
        self.micro_of[buffer_id] = micro
        if vs == 0:  # the micro-batch enters: inputs and labels at once (rank 0 is both ends)
            self.ends = (True, True)
            try:
                e.load_micro_batch(buffer_id)
            finally:
                self.ends = None
            self.labels[micro] = bufs["labels"][buffer_id]
        elif vs == self.last:  # the loss: the labels loaded with the micro-batch
            bufs["labels"][buffer_id] = self.labels.pop(micro)
            e.expect_labels(buffer_id, micro)
        elif vs == self.P:  # the turn: chunk P − 1's output, here, is the input
            bufs["inputs"][buffer_id] = _as_leaf(self.turn.pop(micro))
        with self.chunk(chunk):
            e.expect_micro(buffer_id, micro)
            e.run_forward(buffer_id)
        if vs == self.P - 1:
            self.turn[micro] = bufs["outputs"][buffer_id]
        if vs == self.last:
            loss = e.loss.detach().float()
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def backward_input(self, buffer_id: int, chunk: int, micro: int) -> None:
        e, vs = self.engine, self.virtual[chunk]
        if vs == self.P - 1:  # the gradient chunk P's B left at the turn
            compat.set_received_grad(e, self.turn.pop(micro))
        with self.chunk(chunk):
            self.split.backward_input(buffer_id)
        if vs == self.P:  # hand chunk P − 1 what SendGrad would send (TP: partitioned), as RecvGrad would
            whole = isinstance(compat.pipe_buffers(e)["inputs"][buffer_id], torch.Tensor)
            messages = compat.grad_messages(e, buffer_id)  # drops the inputs, as SendGrad does
            self.turn[micro] = messages[0] if whole and len(messages) == 1 else messages

    def backward_weight(self, buffer_id: int, chunk: int, micro: int) -> None:  # noqa: ARG002 - traced
        with self.chunk(chunk):
            self.split.backward_weight(buffer_id)

    def aggregate_loss(self, micro_batches: int | None = None) -> torch.Tensor:
        """The step's mean loss (rank 0's losses of its ``micro_batches``, default the step's, over
        their number, averaged over DP replicas), on every rank of the pipe."""
        e, topo = self.engine, self.engine.topology
        first = e.stage_id == 0
        out = (self.loss_sum / (micro_batches or e.micro_batches)) if first and self.loss_sum is not None else \
            torch.zeros((), device=e.device)
        self.loss_sum = None
        if first and topo.grad_size > 1:  # the copies the gradients are averaged over (engine/batches.py's share)
            dist.all_reduce(out, group=topo.grad_group)
            out /= topo.grad_size
        dist.broadcast(out, src=topo.peer(pp=0), group=topo.pp_group)
        return out

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: int | None = None,
                   **kwargs: Any) -> torch.Tensor:  # noqa: ARG002 - DeepSpeed's signature
        """Mean loss of ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches
        through the forward-only V with the current weights."""
        e = self.engine
        n = num_micro_batches or e.micro_batches
        fed = e._prepare(data_iter, n, training=False)
        training_iterator = e.data_iterator
        e.set_dataiterator(fed)
        e.module.eval()
        compat.set_computing_loss(e, True)
        try:
            with compat.batch_fn_done(e):
                e.run_schedule(ZeroBubbleV(n, self.P, self.s, forward_only=True))
        finally:
            e.module.train()
            e.set_dataiterator(training_iterator)
        self.turn.clear()
        return self.aggregate_loss(n)


def _as_leaf(outputs: Any) -> Any:
    """The turn's hand-over: the output as the next chunk's input, detached from its graph (as a
    received activation is): floating tensors require grad, the rest pass."""
    if isinstance(outputs, tuple):
        return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outputs)
    return outputs.detach().requires_grad_(outputs.is_floating_point())


def attach(engine: RuntimeEngine) -> ZeroBubbleVState:
    """The runtime of a ZB-V engine (made by its spec, ``ds_mp.schedules.zb_v.ZB_V``)."""
    return ZeroBubbleVState(engine)


__all__ = ["ZeroBubbleVState", "attach"]
