"""Held memory of a pipeline step, measured between instructions: the storage census
(:class:`ds_mp.schedules.memory.HeldMemory`) taken after every instruction a ds_mp engine runs.

Counts every tensor storage alive on this rank other than the weights, their gradients, module
buffers and optimizer state: the activations autograd saved, the gradients a split backward
recorded for its W, the pipe buffers (received activations and gradients, outputs), the posted
sends still in flight, the losses.  A measurement tool (a heap walk per instruction: seconds per
step), not for training runs.
"""
from __future__ import annotations

from typing import Any, Callable

from ds_mp.schedules.memory import HeldMemory, static_tensors


def held_during(engine: Any, step: Callable[[], Any]) -> tuple[int, int]:
    """Run ``step()`` (e.g. one ``engine.train_batch``) with a census after every pipeline
    instruction (the engine's instruction map, shadowed on the instance for the call); returns
    (peak held bytes, bytes held before the step)."""
    census = HeldMemory(lambda: static_tensors(engine.module, engine.optimizer))

    def sampled(method: Callable) -> Callable:
        def run(self: Any, **kwargs: Any) -> Any:
            out = method(self, **kwargs)
            census.sample()
            return out
        return run

    engine._INSTRUCTION_MAP = {k: sampled(v) for k, v in type(engine)._INSTRUCTION_MAP.items()}
    try:
        with census:
            before = census.sample()
            step()
    finally:
        del engine._INSTRUCTION_MAP
    return census.peak, before


__all__ = ["held_during"]
