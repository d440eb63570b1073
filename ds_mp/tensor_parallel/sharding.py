"""How one full (Hugging Face layout) tensor maps to its TP shards, and back.

Pure tensor functions shared by the parallel layers and the checkpoint converters, so a
shard is cut the same way when training and when converting.  GPT-2's ``Conv1D`` stores
``W`` as ``[in, out]`` (``y = x W + b``), so:

* ``column``: split ``W`` and ``b`` along ``out`` (last dim): ``W = [W_1 … W_p]``.
* ``qkv``: the fused ``c_attn`` output is ``[q | k | v]``, each ``n_head × head_dim``; rank
  r gets q, k and v of heads ``r·h/p … (r+1)·h/p − 1`` (a plain column split would hand
  rank 0 all of q and part of k).
* ``row``: split ``W`` along ``in`` (first dim): ``W = [W_1; …; W_p]``; its bias is
  ``replicated`` and added once after the all-reduce.
* ``vocab``: embedding rows, zero-padded to ``padded_vocab`` then split in ``p`` blocks.
* ``replicated``: every rank holds the full tensor.
"""
from __future__ import annotations

import torch

KINDS = ("column", "qkv", "row", "vocab", "replicated")


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple × tp`` that is >= ``vocab``."""
    step = multiple * tp
    return -(-vocab // step) * step


def _qkv_view(t: torch.Tensor, n_head: int) -> torch.Tensor:
    # (..., 3C) -> (..., 3, nh, hs)
    return t.reshape(*t.shape[:-1], 3, n_head, t.shape[-1] // (3 * n_head))


def shard(full: torch.Tensor, kind: str, rank: int, size: int, *, n_head: int = 0,
          padded_vocab: int = 0) -> torch.Tensor:
    """This rank's shard of ``full`` (a view where possible; callers clone)."""
    if kind == "replicated" or (size == 1 and kind != "vocab"):
        return full
    if kind == "column":
        return full.chunk(size, dim=-1)[rank]
    if kind == "row":
        return full.chunk(size, dim=0)[rank]
    if kind == "qkv":
        if n_head % size:
            raise ValueError(f"n_head={n_head} not divisible by tp={size}")
        v = _qkv_view(full, n_head).chunk(size, dim=-2)[rank]  # (..., 3, nh/p, hs)
        return v.reshape(*full.shape[:-1], -1)
    if kind == "vocab":
        rows = padded_vocab or full.shape[0]
        if rows < full.shape[0] or rows % size:
            raise ValueError(f"padded vocab {rows} must be >= {full.shape[0]} and divisible by {size}")
        per = rows // size
        out = full.new_zeros((per, *full.shape[1:]))
        lo, hi = rank * per, min((rank + 1) * per, full.shape[0])
        if hi > lo:
            out[: hi - lo] = full[lo:hi]
        return out
    raise ValueError(f"unknown shard kind {kind!r}; expected one of {KINDS}")


def unshard(shards: list[torch.Tensor], kind: str, *, n_head: int = 0, vocab: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's shard (in rank order).

    For ``vocab`` the padding rows are dropped (``vocab`` = true vocabulary size).
    """
    if kind == "replicated" or (len(shards) == 1 and kind != "vocab"):
        return shards[0]
    if kind == "column":
        return torch.cat(shards, dim=-1)
    if kind == "row":
        return torch.cat(shards, dim=0)
    if kind == "qkv":
        per = n_head // len(shards)
        views = [_qkv_view(s, per) for s in shards]
        full = torch.cat(views, dim=-2)  # (..., 3, nh, hs)
        return full.reshape(*shards[0].shape[:-1], -1)
    if kind == "vocab":
        full = torch.cat(shards, dim=0)
        return full[: vocab or full.shape[0]]
    raise ValueError(f"unknown shard kind {kind!r}; expected one of {KINDS}")
