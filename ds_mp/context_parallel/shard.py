"""Which tokens of a full row each context-parallel (CP) rank holds.

Under CP a micro-batch row of ``T`` tokens is split over the ``C`` ranks of a CP group: rank ``r``
holds ``T/C`` of them, in ascending full-row order, through every layer and every pipeline stage.

* ``balanced=False``: rank ``r`` holds the contiguous chunk ``r`` (tokens ``r·T/C … (r+1)·T/C − 1``).
* ``balanced=True`` (the 2·C-chunk zigzag): the row is cut into ``2C`` chunks of ``T/(2C)`` and rank
  ``r`` holds chunks ``r`` and ``2C − 1 − r``.  Under causal attention a query at full-row index ``i``
  attends to ``i + 1`` keys, so a contiguous split gives rank ``C − 1`` about ``2C − 1`` times the score
  work of rank 0; the zigzag pairs an early chunk with a late one and every rank does the same work
  (to within one chunk's diagonal).

Which impl holds which split: :func:`~ds_mp.context_parallel.rules.balanced_for`.

Document masks make the actual work data-dependent (a packed row of short documents is nearly
block-diagonal); the zigzag balances the causal bound, which is what a long document costs.
"""
from __future__ import annotations

import torch

from ds_mp.context_parallel.rules import DEFAULT_IMPL, IMPLS, balanced_for, check_heads, check_seq_len


def shard_index(seq_len: int, cp: int, cp_rank: int, balanced: bool, device: torch.device | str | None = None
                ) -> torch.Tensor:
    """The ascending full-row indices ``(seq_len / cp,)`` (long) that CP rank ``cp_rank`` holds."""
    check_seq_len(seq_len, cp, balanced)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context_parallel: cp_rank {cp_rank} outside 0 … {cp - 1}")
    if not balanced:
        n = seq_len // cp
        return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)
    n = seq_len // (2 * cp)
    first, last = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat((torch.arange(first, first + n, device=device), torch.arange(last, last + n, device=device)))


def shard_order(seq_len: int, cp: int, balanced: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """``cat(shard_index(seq_len, cp, r, balanced) for r in 0 … cp-1)``: the full-row index of each
    position of the CP ranks' shards laid end to end (an all-gather's output order)."""
    return torch.cat([shard_index(seq_len, cp, r, balanced, device) for r in range(cp)])


__all__ = ["DEFAULT_IMPL", "IMPLS", "balanced_for", "check_heads", "check_seq_len", "shard_index", "shard_order"]
