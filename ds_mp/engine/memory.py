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

import gc
from typing import Any, Callable, Iterable

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




# ------------------------------------------------------------------ every storage held, by census

def _held(tensor: torch.Tensor) -> torch.Tensor:
    """Pack hook: a saved tensor as a Python tensor object of its own (a heap walk finds it);
    detached, or a node saving its own output would hold itself (through the tensor's ``grad_fn``)
    in a cycle through C++ that ``gc`` cannot see, and the census would keep every graph alive."""
    return tensor.detach()


class HeldMemory:
    """A storage census: the bytes of every tensor storage this process holds, deduplicated by
    storage, less the static ones (weights, their ``.grad``, optimizer state, module buffers).

    ``with HeldMemory(static) as census: ... census.sample() ...``; ``census.peak`` / ``census.samples``
    in bytes.  ``static()`` returns the tensors not to charge (evaluated at every sample: gradients
    appear mid-step).  What a sample counts (``gc`` collects once, on entering the block; garbage in
    reference cycles made later is charged until the next collection, as it holds memory till then):

    * every ``torch.Tensor`` the Python heap holds (``gc.get_objects``): the pipe buffers, received
      activations and gradients, posted sends waiting in a list, the gradients a split backward
      recorded for its W, losses, outputs;
    * every tensor autograd saved for backward inside the block: a pack hook keeps each as a Python
      tensor object of its own (:func:`_held`), so the same walk finds the activations the graphs hold.

    A storage is charged once, at its full ``nbytes`` (views of one storage cost it once).  Not
    seen: tensors only C++ holds outside autograd's saved tensors (none between the pipeline's
    instructions: autograd and p2p hand theirs back to Python), and an allocator's free-but-cached
    memory.  Sample between operations, not inside one.
    """

    def __init__(self, static: Callable[[], Iterable[torch.Tensor]] = lambda: ()) -> None:
        self.static = static
        self.samples: list[int] = []
        self._ctx: Any = None

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def held(self) -> int:
        """Bytes of every non-static storage alive now (one census)."""
        skip = {t.untyped_storage().data_ptr() for t in self.static() if isinstance(t, torch.Tensor)}
        sizes: dict[int, int] = {}
        for obj in gc.get_objects():
            if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key and key not in skip:
                sizes[key] = storage.nbytes()
        return sum(sizes.values())

    def sample(self) -> int:
        """Take a census, record it and return it."""
        self.samples.append(self.held())
        return self.samples[-1]

    def __enter__(self) -> "HeldMemory":
        gc.collect()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(_held, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def static_tensors(module: torch.nn.Module, optimizer: Any = None) -> list[torch.Tensor]:
    """What :class:`HeldMemory` does not charge to a schedule: parameters, their gradients, module
    buffers and every tensor in the optimizer's state (DeepSpeed's wrappers: their ``optimizer``'s)."""
    out = [t for p in module.parameters() for t in (p, p.grad) if t is not None]
    out += list(module.buffers())
    opt = optimizer
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "optimizer", None)
    if opt is not None:
        out += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


__all__ = ["SavedActivations", "HeldMemory", "static_tensors"]
