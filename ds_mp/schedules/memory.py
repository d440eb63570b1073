"""Activation memory of a schedule, measured: the bytes autograd keeps saved for backward.

A pipeline schedule decides how many micro-batches (or token slices) hold activations at
once; what they hold is what autograd saved in forward for the backward (inputs of matmuls,
softmax outputs, masks …).  :class:`SavedActivations` counts exactly that: inside the block,
every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``) is charged once per
storage while some graph still holds it, and released when the last graph holding it is
freed (after its backward, or when dropped).  Parameters (and views of them) are weights, not
activations, and are not counted.  ``peak`` is the largest total seen.

It measures the saved tensors themselves, not the allocator: deterministic, the same on CPU
and GPU, and blind to temporaries a kernel frees before returning.  Activation checkpointing
installs its own hooks inside the checkpointed region; measure with it off.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


class _Saved:
    """One saved tensor; releasing the last reference to its storage uncharges it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: "SavedActivations") -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedActivations:
    """``with SavedActivations(model.parameters()) as m: ...``; then ``m.peak`` / ``m.live`` in bytes."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self._params or key == 0:
            return t
        if key not in self._refs:
            self._refs[key] = 0
            self._bytes[key] = t.untyped_storage().nbytes()
            self.live += self._bytes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        # detached: a node saving its own output would otherwise hold itself through the tensor's
        # grad_fn (a reference cycle through this wrapper that is never collected)
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def __enter__(self) -> "SavedActivations":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


__all__ = ["SavedActivations"]
