"""Tensor-parallel layers built from full Hugging Face (``Conv1D``-layout) tensors.

Each layer is constructed from the *full* weight (``[in, out]``, as GPT-2's ``Conv1D``
stores it), or a lazy weight that yields only this rank's shard, and keeps only this rank's shard (:mod:`ds_mp.tensor_parallel.sharding`), so
the same classes serve freshly initialised and ``from_pretrained`` models.  Every
parameter carries ``tp_kind`` (how it is sharded) for clipping and checkpointing.

With sequence parallelism on, activations between layers are split along the sequence
(dim 1); the all-reduce of a TP region becomes all-gather at entry and reduce-scatter at
exit, and replicated parameters used there (LayerNorm, the row-parallel bias, wpe) see only
a slice of tokens, so they enter through ``copy_to_tp`` and autograd sums their gradients
over the TP group in backward (before any optimizer wrapper reads them).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ds_mp.tensor_parallel.mappings import (copy_to_tp, parallel_input_linear, reduce_from_tp,
                                            reduce_scatter_to_sequence)
from ds_mp.tensor_parallel.sharding import shard


#: ``tp_kind`` values whose tensors are split over the TP group (each rank holds a different part).
SHARD_KINDS = frozenset({"column", "qkv", "row", "vocab", "linear_out", "linear_in", "kv", "experts", "experts_gate_up",
                         "experts_down"})


def tp_parameter(full: Any, kind: str, rank: int, size: int, **meta: int) -> nn.Parameter:
    """An ``nn.Parameter`` holding this rank's shard of ``full``, tagged with ``tp_kind``.

    ``full`` is the full tensor (its shard, a view, is copied), or a lazy weight with
    ``shard(kind, rank, size, **meta)`` that produces this rank's shard without the full
    tensor (a sliced read, a sliced init) as a new tensor, which the parameter takes over:
    no copy, so building a stage allocates each shard once (a copy per shard left freed
    blocks in the heap that kept GPT-2 medium's last stage ~200 MiB above its parameters).

    Shards (``kind`` in :data:`SHARD_KINDS`) also carry DeepSpeed's (Megatron's) marking
    ``tensor_model_parallel = True``: DeepSpeed's bf16/fp16 and ZeRO optimizers decide with
    ``deepspeed.runtime.utils.is_model_parallel_parameter`` which parameters each TP rank
    adds to the global gradient norm (a marked one on every TP rank, an unmarked one on TP
    rank 0 only).  Without it TP rank 1 of a bf16 run has no gradients to norm (crash) and
    ZeRO drops the other ranks' shards from the clip norm.  ``"replicated"`` tensors are
    marked ``False`` (identical on every TP rank: counted once).
    """
    if isinstance(full, torch.Tensor):
        local = shard(full.detach(), kind, rank, size, **meta).clone()  # own storage, not a view of full
    else:
        local = full.shard(kind, rank, size, **meta)  # a fresh tensor (LazyWeight's contract)
    p = nn.Parameter(local.contiguous())
    p.tp_kind = kind  # type: ignore[attr-defined]
    p.tensor_model_parallel = kind in SHARD_KINDS  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """``Y_r = X A_r + b_r`` with ``A = [A_1 … A_p]`` split by columns; no communication
    on the output (a following GeLU is element-wise).  Backward all-reduces ``dX`` while it
    computes ``dA_r`` (:func:`~ds_mp.tensor_parallel.mappings.parallel_input_linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Any, rank: int, size: int,
                 kind: str = "column", n_head: int = 0, sequence_parallel: bool = False,
                 overlap_comm: bool = True) -> None:
        super().__init__()
        self.weight = tp_parameter(weight, kind, rank, size, n_head=n_head)  # (in, out/p)
        self.bias = tp_parameter(bias, kind, rank, size, n_head=n_head)  # (out/p,)
        self.group, self.sequence_parallel, self.overlap_comm = group, sequence_parallel, overlap_comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SP: x is (B, T/p, C) and is all-gathered to (B, T, C) first
        return parallel_input_linear(x, self.weight, self.bias, self.group, sequence_parallel=self.sequence_parallel,
                                     overlap=self.overlap_comm)


class RowParallelLinear(nn.Module):
    """``Y = Σ_r X_r A_r + b`` with ``A = [A_1; …; A_p]`` split by rows; one all-reduce
    (reduce-scatter along the sequence with SP) and the replicated bias added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Any, rank: int, size: int,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = tp_parameter(weight, "row", rank, size)  # (in/p, out)
        self.bias = tp_parameter(bias, "replicated", rank, size)  # (out,)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(x.reshape(-1, x.shape[-1]), self.weight)  # (B·T, out): fresh, not a view
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y.view(*x.shape[:-1], -1), self.group, dim=1)
        else:  # g sums the fresh partial product in place (a view of it would be copied first)
            y = reduce_from_tp(y, self.group).view(*x.shape[:-1], -1)
        # SP: the replicated bias meets only this rank's tokens; copy_to_tp sums its gradient over TP
        return y + (copy_to_tp(self.bias, self.group) if self.sequence_parallel else self.bias)


class _EmbeddingLookup(torch.autograd.Function):
    """``y = W[ids]`` whose backward, when it can, hands AccumulateGrad only the rows it touched.

    The gradient is ``dW = Σ_t e_{ids_t} dy_tᵀ``: nonzero on the looked-up rows alone.
    ``F.embedding`` materialises it as a dense ``(V, D)`` tensor (zeros, then an index-add),
    which AccumulateGrad then adds into ``W.grad``: two passes over ``V·D`` values per
    backward.  A step of M micro-batches or n TeraPipe token slices pays that M or n times
    (measured on a 2-stage TeraPipe step with 8 slices: the zero-fill alone was 18 % of
    the first stage's time).  Here, when ``W.grad`` already holds a dense gradient (a later
    micro-batch or slice of the same step), the backward returns ``dW`` as a sparse COO
    tensor of the ``tokens × D`` rows and AccumulateGrad adds it into ``W.grad`` in place:
    ``O(tokens · D)``.  The first backward of a step (``W.grad`` still unset) returns the
    dense gradient, which AccumulateGrad keeps without a copy, so ``W.grad`` is always dense.
    ``sparse=False`` always returns the dense gradient (callers of ``torch.autograd.grad``
    that read the gradients themselves).
    """

    @staticmethod
    def forward(ctx, ids, weight, sparse):  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.shape, ctx.sparse = weight.shape, sparse
        ctx.leaf = weight if weight.is_leaf else None  # whose .grad a later backward adds into
        return nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[1]:
            return None, None, None
        (ids,), leaf = ctx.saved_tensors, ctx.leaf
        rows, flat = grad.reshape(-1, grad.shape[-1]), ids.reshape(-1)
        accumulated = leaf is not None and leaf.grad is not None and leaf.grad.layout == torch.strided
        if ctx.sparse and accumulated and not torch.is_grad_enabled():
            return None, torch.sparse_coo_tensor(flat.unsqueeze(0), rows, ctx.shape, is_coalesced=False,
                                                    check_invariants=False), None
        return None, torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device).index_add_(0, flat, rows), None


def sparse_lookups(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` whose lookups accumulate sparsely (they carry ``sparse_grads``:
    :class:`VocabParallelEmbedding`, GPT-2's positions)."""
    return [m for m in module.modules() if hasattr(m, "sparse_grads")]


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor, sparse_grads: bool = True) -> torch.Tensor:
    """``weight[ids]`` (``F.embedding``) with the gradient accumulation of :class:`_EmbeddingLookup`."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return nn.functional.embedding(ids, weight)
    return _EmbeddingLookup.apply(ids, weight, sparse_grads)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r·V_p/p, (r+1)·V_p/p)`` of the (padded) embedding on rank r.

    ``forward(ids)``: local lookup with out-of-block ids zeroed, then all-reduce (or
    reduce-scatter along the sequence with SP).  ``logits(h)``: the tied LM head,
    ``h Eᵀ`` restricted to the local vocab block, ``(B, T, V_p/p)``.

    ``sparse_grads``: later backwards of a step add only the looked-up rows into ``.grad``
    (:func:`embedding_lookup`); an engine that reads gradients from ``torch.autograd.grad``
    instead of ``.grad`` turns it off.
    """

    sparse_grads = True

    def __init__(self, weight: torch.Tensor, group: Any, rank: int, size: int, padded_vocab: int,
                 sequence_parallel: bool = False, overlap_comm: bool = True) -> None:
        super().__init__()
        self.weight = tp_parameter(weight, "vocab", rank, size, padded_vocab=padded_vocab)
        self.per_rank = padded_vocab // size
        self.vocab_start = rank * self.per_rank
        self.group, self.sequence_parallel, self.overlap_comm = group, sequence_parallel, overlap_comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        emb = embedding_lookup(local.masked_fill(outside, 0), self.weight, self.sparse_grads)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(emb, self.group, dim=1)
        return reduce_from_tp(emb, self.group)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h Eᵀ`` on the local vocab block; backward all-reduces ``dh`` while it computes ``dE``."""
        return parallel_input_linear(h, self.weight, None, self.group, sequence_parallel=self.sequence_parallel,
                                     transposed=True, overlap=self.overlap_comm)
