"""TeraPipe's per-stage key/value cache: slice i attends to the cached keys/values of slices < i.

Attention of slice i (tokens [c, c+l), c = l_1 + … + l_{i−1}) in one block, per TP rank
(its own heads), against the keys/values of the earlier slices of the same sequence:

    K̃_i = [K̂_1; …; K̂_{i−1}; K_i]   Ṽ_i likewise            (B, nh_l, c+l, hs)
    Y_i = softmax(Q_i K̃_iᵀ/√hs + M_i) Ṽ_i,   M_i[q, k] = 0 if k ≤ c + q else −∞

K̂_j is K_j *detached* into a leaf that requires grad, so slice i's graph ends at K̂_j and
each graph is backpropagated exactly once.  Backward runs slices in reverse, so when slice
j's backward runs, K̂_j.grad = Σ_{i>j} ∂L/∂K̂_j is complete; _AddCachedGrad (the identity on
K_j in slice j's own graph) adds it, giving dK_j = ∂L/∂K_j|own + K̂_j.grad — the gradient of
unsliced training.  Memory: the cached K/V of a sequence plus the usual stashed activations.

:class:`KVContext` implements the model's key/value extension protocol
(``extend(index, k, v) -> (K̃, Ṽ, mask)``, see ``ds_mp.models.gpt2.layers.Block``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch


@dataclass
class _Cached:
    k: torch.Tensor  # (B, nh_l, l, hs) detached leaf: later slices attend to it, .grad collects
    v: torch.Tensor


class _AddCachedGrad(torch.autograd.Function):
    """y = x;  dx = dy + (cached copy of x).grad — the gradient later slices left on x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, entry: _Cached, name: str) -> torch.Tensor:
        ctx.entry, ctx.name = entry, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        extra = getattr(ctx.entry, ctx.name).grad
        return (grad if extra is None else grad + extra), None, None


def context_mask(length: int, context: int, device: Any) -> torch.Tensor | None:
    """Boolean SDPA mask (l, c+l): query q sees key k iff k ≤ c + q (None when c = 0: causal)."""
    if context == 0:
        return None
    return torch.ones(length, context + length, dtype=torch.bool, device=device).tril(diagonal=context)


class KVContext:
    """Keys/values of earlier token slices, per sequence ``key`` and block index.

    ``Block.attention`` calls ``extend(index, k, v)`` with the current slice's (B, nh_l, l, hs)
    keys/values and gets ``(K̃, Ṽ, mask)``; the slice is then cached for the next slices.

    ``slice`` (set by the engine with ``key``) numbers the slice within its sequence: a second
    ``extend`` of a slice already cached — activation checkpointing recomputing its forward in
    backward — attends to the same earlier entries and reuses its own entry (whose ``.grad``
    later slices filled) instead of appending, so recomputation is exact.  ``requires_grad``
    (set by the engine: grad mode of the training step) makes the cached copies leaves that
    collect gradients even when the first forward runs without a graph (reentrant checkpoint).
    """

    def __init__(self) -> None:
        self.key: Hashable = None
        self.slice: int | None = None  # None: append (profiling, unnumbered use)
        self.requires_grad: bool | None = None  # None: as the keys/values themselves
        self._cache: dict[Hashable, dict[int, list[_Cached]]] = {}

    def extend(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        cached = self._cache.setdefault(self.key, {}).setdefault(index, [])
        pos = len(cached) if self.slice is None else self.slice
        if pos < len(cached):  # recomputation of a cached slice
            entry = cached[pos]
        elif pos == len(cached):
            grad = k.requires_grad if self.requires_grad is None else self.requires_grad
            entry = _Cached(k.detach().requires_grad_(grad), v.detach().requires_grad_(grad))
            cached.append(entry)
        else:
            raise RuntimeError(f"terapipe: slice {pos} of sequence {self.key} arrived before slice {len(cached)}")
        before = cached[:pos]
        k_own, v_own = _AddCachedGrad.apply(k, entry, "k"), _AddCachedGrad.apply(v, entry, "v")
        c = sum(e.k.shape[2] for e in before)
        if before:
            k_own = torch.cat([e.k for e in before] + [k_own], dim=2)  # (B, nh_l, c+l, hs)
            v_own = torch.cat([e.v for e in before] + [v_own], dim=2)
        return k_own, v_own, context_mask(k.shape[2], c, k.device)

    def prefill(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Cache ``k``, ``v`` (B, nh_l, c, hs) as if earlier slices had produced them (profiling)."""
        self._cache.setdefault(self.key, {}).setdefault(index, []).append(_Cached(k, v))

    def leaves(self) -> list[torch.Tensor]:
        """Every cached tensor of the current sequence."""
        return [t for es in self._cache.get(self.key, {}).values() for e in es for t in (e.k, e.v)]

    def release(self, key: Hashable) -> None:
        self._cache.pop(key, None)

    def __len__(self) -> int:
        return len(self._cache)



__all__ = ["KVContext", "context_mask"]
