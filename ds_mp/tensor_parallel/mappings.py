"""Autograd-aware collectives for tensor (and sequence) parallelism.

Megatron-LM's conjugate pair, with the group always passed in:

    f = copy_to_tp      forward: identity        backward: all-reduce
    g = reduce_from_tp  forward: all-reduce      backward: identity

A column-parallel linear starts with f, a row-parallel linear ends with g, so an MLP
``Y = GeLU(X A) B`` with ``A = [A_1 … A_p]`` (columns) and ``B = [B_1; …; B_p]`` (rows)
needs exactly one all-reduce forward and one backward.

Sequence parallelism (Korthikanti et al.) replaces f/g around the LayerNorm/dropout regions
by an all-gather along the sequence (forward; reduce-scatter backward) and a
reduce-scatter (forward; all-gather backward): ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (torch 2.13's names for ``all_gather_into_tensor`` /
``reduce_scatter_tensor``) on chunks stacked along a new leading dim (the layout both NCCL
and gloo accept; gloo has both, and reduces bf16/fp16, from torch 2.13 on, the package's
lower bound).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

Group = Any


def _world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (made contiguous first); returns the sum."""
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order): one ``all_gather_single``
    into ``(n, *x.shape)``."""
    n = _world(group)
    if n == 1:
        return x
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous().unsqueeze(0), group=group)
    return torch.cat(out.unbind(0), dim=dim)


def _start_reduce_scatter(x: torch.Tensor, dim: int, group: Group, async_op: bool) -> tuple[Any, torch.Tensor]:
    """Launch the sum of ``x`` over ``group`` keeping this rank's chunk along ``dim``: the chunks
    are stacked contiguously along a new dim 0 (rank r's at ``[r]``) for one
    ``reduce_scatter_single`` (1/p of an all-reduce's traffic).  Returns (work, ``(1, …)`` output)."""
    n = _world(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {n} ranks")
    stacked = torch.stack(x.chunk(n, dim=dim)).contiguous()
    out = torch.empty((1, *stacked.shape[1:]), dtype=x.dtype, device=x.device)
    return dist.reduce_scatter_single(out, stacked, group=group, async_op=async_op), out


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``."""
    if _world(group) == 1:
        return x
    return _start_reduce_scatter(x, dim, group, async_op=False)[1][0]


Pending = Callable[[], torch.Tensor]
"""A collective in flight: calling it waits for the collective and returns its result."""


def all_reduce_async(x: torch.Tensor, group: Group) -> Pending:
    """Start the sum of ``x`` over ``group`` (in place on ``x``) and return at once; the
    returned callable waits and gives the sum.  Work queued between the two (a weight
    gradient) runs while the collective travels."""
    if _world(group) == 1:
        return lambda: x
    x = x.contiguous()
    work = dist.all_reduce(x, group=group, async_op=True)
    return lambda: (work.wait(), x)[1]


def reduce_scatter_async(x: torch.Tensor, dim: int, group: Group) -> Pending:
    """:func:`_reduce_scatter` started asynchronously (see :func:`all_reduce_async`)."""
    if _world(group) == 1:
        return lambda: x
    work, out = _start_reduce_scatter(x, dim, group, async_op=True)
    return lambda: (work.wait(), out[0])[1]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g, summing in place when it may: the input of g is a fresh partial sum (a row-parallel
    matmul's output, a masked lookup) that nothing else reads, so the all-reduce overwrites it
    (``mark_dirty``: autograd then refuses, loudly, a graph that saved it) instead of a copy."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        if x.is_contiguous() and not x._is_view():
            ctx.mark_dirty(x)
            return _all_reduce(x, group)
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _GatherSeqReduceScatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather(grad, ctx.dim, ctx.group), None, None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x W + b`` (``x Wᵀ + b`` if ``transposed``) on the flattened tokens: ``addmm`` like HF's Conv1D."""
    x2, w = x.reshape(-1, x.shape[-1]), (weight.t() if transposed else weight)
    y = torch.mm(x2, w) if bias is None else torch.addmm(bias, x2, w)
    return y.view(*x.shape[:-1], y.shape[-1])


def needed_grads(ctx: Any) -> tuple[bool, ...]:
    """The input gradients a fused backward computes: ``ctx.needs_input_grad``, narrowed by
    ``ctx.split_grads`` (one flag per graph edge, i.e. per tensor argument, whose argument index
    ``ctx.edge_args`` gives) where a split backward set it on the node: ZB-H1's B wants only the
    gradient flowing towards the stage input, its W only the weights' (``ds_mp.engine.zero_bubble``).
    Autograd skips the unneeded outputs of its own nodes; a custom Function computes whatever its
    backward returns, so without this the fused dX/dW backward would run whole in both passes."""
    needs, split = list(ctx.needs_input_grad), getattr(ctx, "split_grads", None)
    for arg, wanted in zip(ctx.edge_args, split or ()):
        needs[arg] = needs[arg] and wanted
    return tuple(needs)


class _ParallelInputLinear(torch.autograd.Function):
    """``y = x Wᵀ`` (``W`` stored ``(out, in)``) or ``y = x W + b`` (``W`` stored ``(in, out)``,
    GPT-2's Conv1D layout) on an input replicated over ``group`` — f fused with the matmul.

    Forward: with sequence parallelism ``x`` arrives split along dim 1 and is all-gathered.
    Backward (Megatron-LM's asynchronous TP all-reduce): ``dX = dY Wᵀ`` is computed first and
    its all-reduce (reduce-scatter along the sequence with SP) is *started*; the weight and
    bias gradients ``dW = Xᵀ dY``, ``db = Σ dY`` are computed while it travels, then it is
    awaited.  Same sums as ``copy_to_tp`` + matmul, so the same gradients up to the order
    of fp additions inside the matmul kernels.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, transposed, overlap):  # type: ignore[override]
        if sequence_parallel:
            x = _gather(x, 1, group)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.group, ctx.sp, ctx.transposed, ctx.overlap, ctx.x_shape = group, sequence_parallel, transposed, overlap, x.shape
        ctx.edge_args = (0, 1) if bias is None else (0, 1, 2)  # the tensor arguments: the node's graph edges
        return _linear(x, weight, bias, transposed)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        needs = needed_grads(ctx)
        pending = None
        if needs[0]:
            dx = (g2 @ weight if ctx.transposed else g2 @ weight.t()).view(ctx.x_shape)
            pending = (reduce_scatter_async(dx, 1, ctx.group) if ctx.sp else all_reduce_async(dx, ctx.group))
            if not ctx.overlap:  # the plain order: wait for the collective before computing dW
                done = pending()
                pending = lambda: done  # noqa: E731
        dw = None
        if needs[1]:
            dw = g2.t() @ x2 if ctx.transposed else x2.t() @ g2
        db = g2.sum(0) if needs[2] else None
        return (pending() if pending else None), dw, db, None, None, None, None


def parallel_input_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, *,
                          sequence_parallel: bool = False, transposed: bool = False, overlap: bool = True) -> torch.Tensor:
    """``copy_to_tp(x) @ W + b`` (or the SP all-gather in place of f), with the backward
    all-reduce of ``dX`` overlapped with ``dW`` (:class:`_ParallelInputLinear`).  ``transposed``:
    ``W`` is stored ``(out, in)`` (an embedding used as the LM head) and ``y = x Wᵀ``.
    ``overlap=False`` waits for the collective before computing ``dW`` (the plain order; for
    comparison and debugging)."""
    if _world(group) == 1:
        return _linear(x, weight, bias, transposed)
    return _ParallelInputLinear.apply(x, weight, bias, group, sequence_parallel, transposed, overlap)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: forward identity, backward all-reduce over ``group``."""
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: forward all-reduce over ``group``, backward identity."""
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """SP entry into a TP region: forward all-gather along ``dim``; backward reduce-scatter."""
    return x if _world(group) == 1 else _GatherSeqReduceScatterGrad.apply(x, dim, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """SP exit from a TP region: forward reduce-scatter along ``dim``; backward all-gather."""
    return x if _world(group) == 1 else _ReduceScatterSeq.apply(x, dim, group)
