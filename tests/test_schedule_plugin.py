"""A schedule registered from outside the package has the built-ins' power: its own instruction
type, handled by a method of its runtime, which owns its state and supplies hooks.

The example, ``counted-1f1b``, is DeepSpeed's 1F1B with every ``ForwardPass`` replaced by its own
``CountedForward`` instruction; its runtime counts the forwards it ran (state it keeps across
steps, saved through its ``state_dict`` hook) and forwards through the engine's public
``run_forward``.  Oracle: the built-in ``1f1b`` on the same model and batches, two pipeline ranks.
"""
from __future__ import annotations

from typing import Any, Iterator

from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2

VOCAB, GAS, STEPS = 203, 3, 2


class CountedForward(ds.BufferOpInstruction):
    """A forward of one pipe buffer, counted by the runtime."""


class CountedOneFOneB(ds.TrainSchedule):
    """DeepSpeed's 1F1B with :class:`CountedForward` in place of ``ForwardPass``."""

    def steps(self) -> Iterator[list]:
        for cmds in super().steps():
            yield [CountedForward(c.buffer_id) if isinstance(c, ds.ForwardPass) else c for c in cmds]


class Counter:
    """The runtime: handles ``CountedForward`` and owns the count."""

    instructions = {CountedForward: "counted_forward"}

    def __init__(self, engine: Any) -> None:
        self.engine, self.forwards = engine, 0

    def counted_forward(self, buffer_id: int) -> None:
        self.forwards += 1
        self.engine.run_forward(buffer_id)

    def state_dict(self) -> dict:
        return {"forwards": self.forwards}

    def load_state_dict(self, state: dict) -> None:
        self.forwards = state["forwards"]


def _rank(rank: int) -> dict:
    import ds_mp

    ds_mp.register_schedule("counted-1f1b", CountedOneFOneB, runtime=Counter)
    out = {}
    for name in ("1f1b", "counted-1f1b"):
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=VOCAB), config=ds_config(pp=2, gas=GAS, schedule=name))
        out[name] = [float(engine.train_batch(iter(batches(GAS, 2, 16, VOCAB, seed=s)))) for s in range(STEPS)]
        runtime = engine.schedule_support
    out["forwards"] = runtime.forwards
    out["state"] = engine.schedule_state_dict()
    out["on engine"] = hasattr(engine, "forwards") or hasattr(engine, "counted_forward")
    return out


def test_a_registered_schedule_runs_its_own_instructions_and_state() -> None:
    for r in run_ranks(_rank, 2, timeout=300):
        assert r["counted-1f1b"] == r["1f1b"], r  # the same steps, bit for bit
        assert r["forwards"] == GAS * STEPS and r["state"] == {"forwards": GAS * STEPS}, r
        assert not r["on engine"], r  # state and handler live in the runtime, nothing is set on the engine
