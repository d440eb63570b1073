"""Autograd-aware collectives for tensor (and sequence) parallelism.

Megatron-LM's conjugate pair, with the group always passed in:

    f = copy_to_tp      forward: identity        backward: all-reduce
    g = reduce_from_tp  forward: all-reduce      backward: identity

A column-parallel linear starts with f, a row-parallel linear ends with g, so an MLP
``Y = GeLU(X A) B`` with ``A = [A_1 … A_p]`` (columns) and ``B = [B_1; …; B_p]`` (rows)
needs exactly one all-reduce forward and one backward.

Sequence parallelism (Korthikanti et al.) replaces f/g around the LayerNorm/dropout regions
by an all-gather along the sequence (forward; reduce-scatter backward) and a
reduce-scatter (forward; all-gather backward).  On NCCL (any backend but gloo) these are
``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor``; gloo has neither, so
there the reduce-scatter is an all-reduce followed by taking the local chunk and the
all-gather a list ``all_gather`` (identical results, more traffic; gloo is for CPU tests).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

Group = Any


def _world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    # gloo cannot reduce bf16/fp16 in every torch version: reduce in fp32.
    if x.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(group) == "gloo":
        y = x.float()
        dist.all_reduce(y, group=group)
        return y.to(x.dtype)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    x = x.contiguous()
    if _native_collectives(group):  # NCCL: one all_gather_into_tensor into (n, *x.shape)
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return torch.cat(out.unbind(0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(n)]
    if x.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(group) == "gloo":
        fparts = [p.float() for p in parts]
        dist.all_gather(fparts, x.float(), group=group)
        parts = [p.to(x.dtype) for p in fparts]
    else:
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _native_collectives(group: Group) -> bool:
    """True where the backend has ``reduce_scatter_tensor``/``all_gather_into_tensor``
    (NCCL and friends); gloo has neither, so it takes the all-reduce emulation."""
    return dist.get_backend(group) != "gloo"


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``.

    NCCL (any non-gloo backend): one ``reduce_scatter_tensor`` (1/p of an all-reduce's
    traffic) on the chunks laid out contiguously along dim 0.  gloo: an all-reduce followed
    by taking the local chunk (same result, p× the traffic), gloo having no reduce-scatter.
    """
    n = _world(group)
    if n == 1:
        return x
    if not _native_collectives(group):
        return _split(_all_reduce(x.clone(), group), dim, group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {n} ranks")
    stacked = torch.stack(x.chunk(n, dim=dim)).contiguous()  # (n, ..., T/n, ...): rank r's chunk at [r]
    out = torch.empty_like(stacked[0])
    dist.reduce_scatter_tensor(out, stacked, group=group)
    return out


Pending = Callable[[], torch.Tensor]
"""A collective in flight: calling it waits for the collective and returns its result."""


def all_reduce_async(x: torch.Tensor, group: Group) -> Pending:
    """Start the sum of ``x`` over ``group`` (in place on ``x`` or an fp32 copy) and return
    at once; the returned callable waits and gives the sum.  Work queued between the two
    (a weight gradient) runs while the collective travels."""
    if _world(group) == 1:
        return lambda: x
    if x.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(group) == "gloo":
        y = x.float()
        work = dist.all_reduce(y, group=group, async_op=True)
        return lambda: (work.wait(), y.to(x.dtype))[1]
    x = x.contiguous()
    work = dist.all_reduce(x, group=group, async_op=True)
    return lambda: (work.wait(), x)[1]


def reduce_scatter_async(x: torch.Tensor, dim: int, group: Group) -> Pending:
    """:func:`_reduce_scatter` started asynchronously (see :func:`all_reduce_async`)."""
    n = _world(group)
    if n == 1:
        return lambda: x
    if not _native_collectives(group):
        total = all_reduce_async(x, group)
        return lambda: _split(total(), dim, group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by {n} ranks")
    stacked = torch.stack(x.chunk(n, dim=dim)).contiguous()
    out = torch.empty_like(stacked[0])
    work = dist.reduce_scatter_tensor(out, stacked, group=group, async_op=True)
    return lambda: (work.wait(), out)[1]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
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
    def forward(ctx, x, weight, bias, group, sequence_parallel, transposed):  # type: ignore[override]
        if sequence_parallel:
            x = _gather(x, 1, group)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.group, ctx.sp, ctx.transposed, ctx.x_shape = group, sequence_parallel, transposed, x.shape
        return _linear(x, weight, bias, transposed)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        pending = None
        if ctx.needs_input_grad[0]:
            dx = (g2 @ weight if ctx.transposed else g2 @ weight.t()).view(ctx.x_shape)
            pending = (reduce_scatter_async(dx, 1, ctx.group) if ctx.sp else all_reduce_async(dx, ctx.group))
        dw = None
        if ctx.needs_input_grad[1]:
            dw = g2.t() @ x2 if ctx.transposed else x2.t() @ g2
        db = g2.sum(0) if ctx.needs_input_grad[2] else None
        return (pending() if pending else None), dw, db, None, None, None


def parallel_input_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, *,
                          sequence_parallel: bool = False, transposed: bool = False) -> torch.Tensor:
    """``copy_to_tp(x) @ W + b`` (or the SP all-gather in place of f), with the backward
    all-reduce of ``dX`` overlapped with ``dW`` (:class:`_ParallelInputLinear`).  ``transposed``:
    ``W`` is stored ``(out, in)`` (an embedding used as the LM head) and ``y = x Wᵀ``."""
    if _world(group) == 1:
        return _linear(x, weight, bias, transposed)
    return _ParallelInputLinear.apply(x, weight, bias, group, sequence_parallel, transposed)


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
