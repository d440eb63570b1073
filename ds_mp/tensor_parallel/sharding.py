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

``nn.Linear`` stores ``W`` as ``[out, in]`` (``y = x Wᵀ + b``; the Llama family), so its cuts are
named by the features they split:

* ``linear_out``: column-parallel, ``W`` and ``b`` split along ``out`` (dim 0) — heads stay whole
  when ``p`` divides the heads (``q_proj``: rank r gets heads ``r·h/p … (r+1)·h/p − 1``).
* ``linear_in``: row-parallel, ``W`` split along ``in`` (last dim).
* ``kv``: grouped-query key/value projections (``n_head`` = the key/value heads): ``linear_out``
  by heads when ``p`` divides them, else every rank holds them all (the cut depends on the tensor
  and ``p`` only, so a checkpoint saved at one ``p`` re-cuts at another).

Mixture-of-experts tensors as transformers 5 fuses them (``experts.gate_up_proj`` ``(E, 2I, H)`` =
``[gate; up]`` per expert, ``experts.down_proj`` ``(E, H, I)``), in two layouts:

* ``experts``: whole experts, ``E`` split along dim 0 (rank r holds experts ``r·E/p … (r+1)·E/p − 1``);
* ``experts_gate_up``: each expert's intermediate dimension cut like a column-parallel MLP: rank r
  gets rows ``r·I/p … (r+1)·I/p − 1`` of the gate half and the same rows of the up half (dim 1);
* ``experts_down``: the matching row-parallel cut, columns of ``I`` (the last dim);
* ``experts_replicated``: a per-expert tensor the split layout keeps whole on every rank (LoRA's factor
  on the side of an expert tensor that is not cut: ``gate_up_proj``'s A, ``down_proj``'s B); like the
  others it is cut by experts in the ``whole`` layout.
"""
from __future__ import annotations

from typing import Callable

import torch

KINDS = ("column", "qkv", "row", "vocab", "replicated", "linear_out", "linear_in", "kv", "experts",
         "experts_gate_up", "experts_down", "experts_replicated")
EXPERT_KINDS = ("experts", "experts_gate_up", "experts_down", "experts_replicated")  # "whole" cuts them by expert
REPLICATED = ("replicated", "experts_replicated")  # every TP rank holds the whole tensor


def _as_conv1d_kind(kind: str, size: int, n_head: int) -> str:
    """The Conv1D-layout kind that cuts like ``kind`` (``linear_out`` cuts dim 0 as ``row`` does,
    ``linear_in`` the last dim as ``column``; ``kv`` is ``row`` or ``replicated``)."""
    if kind == "kv":
        if not n_head:
            raise ValueError("kind 'kv' needs n_head = the key/value heads")
        return "row" if n_head % size == 0 else "replicated"
    return {"linear_out": "row", "linear_in": "column", "experts_replicated": "replicated"}.get(kind, kind)


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
    kind = _as_conv1d_kind(kind, size, n_head)
    if kind == "replicated" or (size == 1 and kind != "vocab"):
        return full
    if kind in EXPERT_KINDS:
        dim, ranges, _ = shard_ranges(kind, rank, size, tuple(full.shape))
        return torch.cat([full.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)
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
    kind = _as_conv1d_kind(kind, len(shards), n_head)
    if kind == "replicated" or (len(shards) == 1 and kind != "vocab"):
        return shards[0]
    if kind == "experts":
        return torch.cat(shards, dim=0)
    if kind == "experts_down":
        return torch.cat(shards, dim=-1)
    if kind == "experts_gate_up":  # each shard is [gate_r; up_r] along dim 1
        halves = [s.chunk(2, dim=1) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
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


def shard_ranges(kind: str, rank: int, size: int, shape: tuple[int, ...], *, n_head: int = 0,
                 padded_vocab: int = 0) -> tuple[int, list[tuple[int, int]], int]:
    """Where :func:`shard` takes its shard from: ``(dim, ranges, length)``.

    The shard is the concatenation along ``dim`` of the full tensor's index ranges
    ``[lo, hi)`` in ``ranges``, zero-padded along ``dim`` to ``length`` (only ``vocab``
    pads).  ``dim`` depends on the kind only (``column``/``qkv``: last, ``row``/``vocab``/
    ``replicated``/``experts``: 0, ``experts_gate_up``: 1, ``experts_down``: last), also at ``size`` 1, so ranges of two layouts of one tensor can be
    intersected: a reader reads exactly these ranges instead of the whole tensor.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown shard kind {kind!r}; expected one of {KINDS}")
    kind = _as_conv1d_kind(kind, size, n_head)
    last = len(shape) - 1
    if kind in EXPERT_KINDS:
        dim = {"experts": 0, "experts_gate_up": 1, "experts_down": last}[kind]
        if shape[dim] % (2 * size if kind == "experts_gate_up" else size):
            raise ValueError(f"{kind}: dim {dim} of {list(shape)} is not divisible by tp={size}")
        if kind == "experts_gate_up":  # the gate rows then the up rows of this rank
            inner, per = shape[1] // 2, shape[1] // 2 // size
            return 1, [(h * inner + rank * per, h * inner + (rank + 1) * per) for h in range(2)], 2 * per
        per = shape[dim] // size
        return dim, [(rank * per, (rank + 1) * per)], per
    if kind == "replicated":
        return 0, [(0, shape[0])], shape[0]
    if kind in ("column", "row"):
        dim = last if kind == "column" else 0
        per = shape[dim] // size
        return dim, [(rank * per, (rank + 1) * per)], per
    if kind == "qkv":
        if n_head % size:
            raise ValueError(f"n_head={n_head} not divisible by tp={size}")
        C, per = shape[last] // 3, shape[last] // 3 // size
        return last, [(j * C + rank * per, j * C + (rank + 1) * per) for j in range(3)], 3 * per
    rows = padded_vocab or shape[0]
    if rows < shape[0] or rows % size:
        raise ValueError(f"padded vocab {rows} must be >= {shape[0]} and divisible by {size}")
    per = rows // size
    lo, hi = rank * per, min((rank + 1) * per, shape[0])
    return 0, ([(lo, hi)] if hi > lo else []), per


def read_shard(read: Callable[[int, int, int, torch.Tensor], None], shape: tuple[int, ...], kind: str, rank: int,
               size: int, *, n_head: int = 0, padded_vocab: int = 0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's shard of a full tensor of ``shape`` that is never materialised, equal to
    ``shard(full, ...)`` (a fresh ``dtype`` tensor).

    The shard is allocated once; ``read(dim, lo, hi, out)`` writes the full tensor's index
    range ``[lo, hi)`` along ``dim`` into ``out``, the view of the shard that holds it (e.g. a
    positioned file read, a seeded draw), and the vocab padding rows are zeroed: building a
    shard costs the shard, with no pieces to concatenate."""
    dim, ranges, length = shard_ranges(kind, rank, size, shape, n_head=n_head, padded_vocab=padded_vocab)
    out_shape = list(shape)
    out_shape[dim] = length
    out = torch.empty(out_shape, dtype=dtype)
    at = 0
    for lo, hi in ranges:
        read(dim, lo, hi, out.narrow(dim, at, hi - lo))
        at += hi - lo
    if at < length:  # vocab padding rows
        out.narrow(dim, at, length - at).zero_()
    return out


def locate(lo: int, hi: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Pieces of the full-tensor range ``[lo, hi)`` inside a shard made of ``ranges`` (as
    from :func:`shard_ranges`): ``(local_lo, local_hi, global_lo)`` offsets into the shard."""
    out, offset = [], 0
    for a, b in ranges:
        s, e = max(lo, a), min(hi, b)
        if e > s:
            out.append((offset + s - a, offset + e - a, s))
        offset += b - a
    return out
