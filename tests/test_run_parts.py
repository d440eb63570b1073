"""A run's checkpointed parts (``ds_mp.training.parts``): one loop saves them, the same loop restores
them, under the on-disk keys every ds_mp checkpoint has used; checkpoints of older layouts (no
sampler, ramp or noise-scale entry, one rank's RNG as a dict) restore as before.  In-process, one
gloo rank; the oracles are torch's own RNG draws and the parts' own ``state_dict`` (JSON/pickle
round trip, as ``torch.save`` stores it)."""
from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ports import free_port

SEQ, KEYS = 4, ["step", "data", "layout", "sampler", "batch_ramp", "noise_scale", "rng"]


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group (the RNG part all-gathers), unless this process already has one."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    yield
    if mine:
        dist.destroy_process_group()


@pytest.fixture
def rows(tmp_path):
    """A token stream of 96 rows of SEQ tokens (the prepared-dataset layout ds_mp reads)."""
    from ds_mp.data import TokenDataset
    from ds_mp.data.prepare import DatasetInfo

    n = 96 * SEQ
    np.arange(n, dtype=np.uint32).tofile(tmp_path / "tokens.bin")
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "val_tokens.bin")
    (tmp_path / "meta.json").write_text(DatasetInfo(
        path=str(tmp_path), dtype="uint32", vocab_size=1 << 20, eos_id=0, train_tokens=n, val_tokens=10,
        train_documents=1, val_documents=1, sha256="0" * 64).to_json())
    return TokenDataset(str(tmp_path))


def make_parts(rows, dp: int = 1) -> tuple[dict, SimpleNamespace]:
    """The parts of a DP-``dp`` run with a linear batch ramp (sqrt LR scaling) and a noise probe."""
    from ds_mp.data import ChunkSampler
    from ds_mp.training.batch_ramp import BatchRamp, LrScaling
    from ds_mp.training.metrics import NoiseScaleEstimator
    from ds_mp.training.run import run_parts

    sampler = ChunkSampler(rows, SEQ, 2, 1, seed=3)
    ramp = BatchRamp("linear", 2, 8, 16, 1, "sqrt", 2)
    lr = LrScaling(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    probe = SimpleNamespace(estimator=NoiseScaleEstimator(0.9))
    engine = SimpleNamespace(topology=SimpleNamespace(tp=1, pp=1, dp=dp))
    parts = run_parts(engine, os.fspath("data/x"), sampler, ramp, lr, probe)
    return parts, SimpleNamespace(sampler=sampler, ramp=ramp, lr=lr, estimator=probe.estimator)


def advance(p: SimpleNamespace, steps: int) -> None:
    """``steps`` ramped steps: the sampler reads each step's batch, the estimator takes a measurement."""
    for t in range(steps):
        batch = p.ramp.before_step(t + 1)
        p.sampler.set_grad_accum(batch // 2)
        p.sampler.next_step()
        p.ramp.after_step()
        p.estimator.update(2.0 + t, 1.0, 2, 4)


def test_saved_keys_are_the_checkpoint_format(one_rank, rows) -> None:
    """The client state has exactly the keys older ds_mp checkpoints have, nothing else."""
    from ds_mp.training.parts import Stateful, save_states

    parts, _ = make_parts(rows)
    assert all(isinstance(part, Stateful) for part in parts.values())
    state = save_states(parts)
    assert list(state) == KEYS and state["layout"] == [1, 1, 1] and state["data"] == "data/x"
    assert isinstance(state["rng"], list) and len(state["rng"]) == 1  # by global rank


def test_load_restores_what_save_saved(one_rank, rows) -> None:
    """Save after 3 steps, train on, restore into fresh parts: every part's state is the saved one,
    and the RNG draws the same numbers it drew right after the save (torch's generator as oracle)."""
    from ds_mp.training.parts import load_states, save_states

    parts, p = make_parts(rows)
    advance(p, 3)
    parts["step"].load_state_dict(3)
    state = pickle.loads(pickle.dumps(save_states(parts)))  # as torch.save keeps it
    expected = torch.rand(5)
    advance(p, 2)
    fresh, q = make_parts(rows)
    load_states(fresh, state)
    assert torch.equal(torch.rand(5), expected)
    assert fresh["step"].state_dict() == 3
    assert q.sampler.state_dict() == state["sampler"] and q.sampler.consumed_samples == state["sampler"]["consumed_samples"] == 6
    assert {"ramp": q.ramp.state_dict(), "lr": q.lr.state_dict()} == state["batch_ramp"]
    assert q.estimator.state_dict() == state["noise_scale"]
    assert save_states(fresh).keys() == state.keys()


def test_older_layouts_restore_as_before(one_rank, rows) -> None:
    """A checkpoint without sampler/ramp/noise entries and with one rank's RNG as a dict: the sampler
    goes to step × global batch, the ramp and estimator stay at their start, the RNG dict applies;
    a checkpoint of another layout leaves this rank's RNG alone."""
    from ds_mp.tensor_parallel.random import rng_state
    from ds_mp.training.parts import load_states

    saved_rng = rng_state()
    expected = torch.rand(3)
    parts, p = make_parts(rows)
    load_states(parts, {"step": 5, "data": "data/x", "rng": saved_rng, "layout": [1, 1, 1]})
    assert torch.equal(torch.rand(3), expected)
    assert p.sampler.consumed_samples == 5 * 2 and p.ramp.consumed == 0 and p.estimator.updates == 0
    other, _ = make_parts(rows, dp=2)
    drawn = torch.get_rng_state()
    load_states(other, {"step": 1, "rng": [saved_rng], "layout": [1, 1, 2 + 1]})
    assert torch.equal(torch.get_rng_state(), drawn)
