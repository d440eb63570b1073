"""Fused vocab-parallel cross-entropy (Megatron-LM §3).

Rank r holds logits ``z[:, V_r]`` for its vocab block.  With ``m = max_v z_v`` and
``S = Σ_v exp(z_v − m)``, the loss of target t is ``log S − (z_t − m)``; each rank
contributes its partial max, partial S and (if it owns t) ``z_t``, so only three
per-token scalars (b·s values each) cross the TP group, never the b·s·v logits.  The
gradient is ``softmax(z) − onehot(t)``, computed locally.  Columns at or beyond the true
vocabulary (padding) get ``−inf`` logits: zero probability and zero gradient.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _allreduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, true_vocab, ignore_index, group):  # type: ignore[override]
        z = logits.float()  # (N, V_local)
        n_local = z.shape[-1]
        if vocab_start + n_local > true_vocab:  # this block holds padding columns (decided on the host: no sync)
            cols = torch.arange(vocab_start, vocab_start + n_local, device=z.device)
            z = z.masked_fill(cols >= true_vocab, float("-inf"))
        m = _allreduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)  # (N,)
        valid = target != ignore_index
        local_t = target - vocab_start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, n_local - 1)
        zt = torch.where(mine, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - m, torch.zeros_like(m))
        ez = torch.sub(z, m.unsqueeze(-1)).exp_()  # one (N, V_local) buffer: it becomes the softmax
        s, zt = _allreduce(torch.stack([ez.sum(dim=-1), zt]), dist.ReduceOp.SUM, group)  # one collective, (N,) each
        loss = torch.where(valid, s.log() - zt, torch.zeros_like(zt))
        ez.div_(s.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(ez, idx, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax  # softmax(z) - onehot(t) where this rank owns t: a scatter, no boolean indexing (no host sync)
        grad.scatter_add_(-1, idx.unsqueeze(-1), mine.to(grad.dtype).neg().unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int,
                                 true_vocab: int, group: Any = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ``target == ignore_index``) from local logits ``[N, V_local]``."""
    return _VocabParallelCE.apply(logits, target, vocab_start, true_vocab, ignore_index, group)
