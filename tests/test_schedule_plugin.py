"""A schedule registered from outside the package has the built-ins' power: one spec with its own
instruction type, handled by a method of its runtime, which owns its state and supplies hooks, its
own config check and its own batching rule.

The example, ``counted-1f1b``, is DeepSpeed's 1F1B with every ``ForwardPass`` replaced by its own
``CountedForward`` instruction; its runtime counts the forwards it ran (state it keeps across
steps, saved through its ``state_dict`` hook) and forwards through the engine's public
``run_forward``; its spec refuses one pipeline stage (nothing to count between stages) and makes a
batch ramp's sizes multiples of 3 micro-batches.  Oracle: the built-in ``1f1b`` on the same model
and batches, two pipeline ranks; the config refusals are those of the built-ins' checks.
"""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from ds_mp.config import ConfigError, DsMpConfig, InlineModel, load_config, ramp_micro_multiple
from ds_mp.config.registry import ScheduleSpec
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


class CountedSpec(ScheduleSpec):
    """The spec: a config check of its own and a batching rule, as the built-ins' specs have."""

    def check(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        if cfg.pipeline.stages < 2:
            raise ConfigError(f"ds_mp.pipeline.stages: {cfg.pipeline.stages}; counted-1f1b counts forwards between "
                              "stages, use at least 2")

    def micro_multiple(self, cfg: DsMpConfig) -> int:
        return 3


COUNTED = CountedSpec(timetable=CountedOneFOneB, runtime=Counter, batch_ramp=True)


def _rank(rank: int) -> dict:
    import ds_mp

    ds_mp.register_schedule("counted-1f1b", COUNTED)
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


def test_a_registered_spec_checks_its_config_and_batching(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's own check and batching hook run where the built-ins' do (config validation, the
    batch ramp's sizes); ``register_schedule(name, cls, runtime=)`` still builds a plain spec."""
    import ds_mp
    from ds_mp.config import registry

    for name in ("counted-1f1b", "plain-counted"):  # registered below, removed again after the test
        monkeypatch.setitem(registry.SCHEDULES, name, None)
    ds_mp.register_schedule("counted-1f1b", COUNTED)
    with pytest.raises(ConfigError, match=r"^ds_mp.pipeline.stages: 1; counted-1f1b counts forwards between stages"):
        load_config(ds_config(pp=1, schedule="counted-1f1b"), world_size=1)
    ramp = {"policy": "linear", "start": 8, "max": 12, "ramp_samples": 64}
    with pytest.raises(ConfigError, match=r"batch_ramp.start: 8 samples .* × DP \(1\) × 3 \(the counted-1f1b "
                                          r"schedule runs a multiple of 3 micro-batches per step\) = 6; use 6 or 12"):
        load_config(ds_config(pp=2, micro=2, gas=3, schedule="counted-1f1b", batch_ramp=ramp), world_size=2)
    cfg, _ = load_config(ds_config(pp=2, micro=2, gas=3, schedule="counted-1f1b", batch_ramp={**ramp, "start": 6}),
                         world_size=2)
    assert ramp_micro_multiple(cfg) == 3
    with pytest.raises(ConfigError, match=r"'counted-1f1b' is not tested with qwen2"):  # families: GPT-2 only
        load_config(ds_config(pp=2, schedule="counted-1f1b"), world_size=2,
                    hf_config={"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 32,
                               "num_attention_heads": 2, "vocab_size": 64, "max_position_embeddings": 64})
    ds_mp.register_schedule("plain-counted", CountedOneFOneB, runtime=Counter)  # the older call
    plain = registry.schedule_spec("plain-counted")
    assert (plain.timetable, plain.runtime, plain.batch_ramp) == (CountedOneFOneB, Counter, False)
