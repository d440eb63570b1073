"""Held memory of a pipeline step, measured between instructions: the storage census
(:class:`ds_mp.engine.memory.HeldMemory`) taken after every instruction a ds_mp engine runs.

Counts every tensor storage alive on this rank other than the weights, their gradients, module
buffers and optimizer state: the activations autograd saved, the gradients a split backward
recorded for its W, the pipe buffers (received activations and gradients, outputs), the posted
sends still in flight, the losses.  A measurement tool (a heap walk per instruction: seconds per
step), not for training runs.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator

import torch

from ds_mp import deepspeed_compat as compat
from ds_mp.engine.memory import HeldMemory, static_tensors
from ds_mp.engine_view import RuntimeEngine


def source_weights(module: Any) -> list[torch.Tensor]:
    """The tensors reachable from the layer specs DeepSpeed's ``PipelineModule`` keeps
    (``_layer_specs``: every stage's layers' constructor arguments, whose weight source references
    the Hugging Face model's whole state dict): weights, not a schedule's memory.  Found by a walk
    over ``gc.get_referents`` that does not enter built modules."""
    seen, out, todo = set(), {}, compat.layer_spec_arguments(module)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or issubclass(type(obj), (torch.nn.Module, type)):
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.Tensor):
            out[obj.untyped_storage().data_ptr()] = obj
            continue
        todo.extend(gc.get_referents(obj))
    return list(out.values())


def held_during(engine: RuntimeEngine, step: Callable[[], Any]) -> tuple[int, int]:
    """Run ``step()`` (e.g. one ``engine.train_batch``) with a census after every pipeline
    instruction (the engine's instruction map, shadowed on the instance for the call); returns
    (peak held bytes, bytes held before the step).  Weights, their gradients, optimizer state and
    the source weights the module keeps (:func:`source_weights`) are not charged."""
    kept = source_weights(engine.module)
    census = HeldMemory(lambda: static_tensors(engine.module, engine.optimizer) + kept)

    def sampled(method: Callable) -> Callable:
        def run(self: Any, **kwargs: Any) -> Any:
            out = method(self, **kwargs)
            census.sample()
            return out
        return run

    with compat.instruction_handlers(engine, sampled), _sampling_runtime(engine.schedule_support, census), census:
        before = census.sample()
        step()
    return census.peak, before


@contextlib.contextmanager
def _sampling_runtime(runtime: Any, census: HeldMemory) -> Iterator[None]:
    """Within: the instructions the schedule's runtime handles itself (its ``instructions``: ZB-H1's
    B and W, the chunk passes of interleaved and ZB-V) are followed by a census too — the engine
    looks their methods up on the runtime per step, so instance attributes shadow them."""
    names = sorted(set(getattr(runtime, "instructions", {}).values()))
    for name in names:
        def run(*args: Any, _method: Callable = getattr(runtime, name), **kwargs: Any) -> Any:
            out = _method(*args, **kwargs)
            census.sample()
            return out
        setattr(runtime, name, run)
    try:
        yield
    finally:
        for name in names:
            delattr(runtime, name)


__all__ = ["held_during", "source_weights"]
