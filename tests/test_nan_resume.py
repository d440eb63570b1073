"""Diverged runs (issue 36, item 6): the diagnostic save leaves ``latest`` alone, ``on_nan: skip``
has a limit, and hyper-parameters changed in the config win on resume.

The loop runs in-process on one rank (``run_ranks``); the resume oracle is the uninterrupted run
whose optimizer groups were edited by hand at the resume point.
"""
from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch
from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2
from launcher_utils import loop_rank, loop_rank_output, read_log, tiny_dataset, train_config

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("nan")))


def _diverging(tmp: str, data: str, **training) -> tuple[str, str]:
    """A one-rank run whose first SGD step (lr 1e30) makes every later loss non-finite."""
    cfg = train_config(tmp, data, pp=1, steps=20, ds={"gradient_clipping": 0.0,
                                                     "optimizer": {"type": "SGD", "params": {"lr": 1e30}}},
                       training={"export_hf": False, "eval_interval": 0, "checkpoint_interval": 1, **training})
    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, os.path.join(tmp, "run", "checkpoints")


def _errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("ds_mp: error:")]


def test_nan_stop_keeps_latest_on_the_last_good_checkpoint(data, tmp_path):
    path, ckpts = _diverging(str(tmp_path), data, on_nan="stop")
    rc, err = run_ranks(loop_rank, 1, path, [], timeout=240)[0]
    lines = _errors(err)
    assert rc == 3 and len(lines) == 1, err[-3000:]
    assert os.path.isdir(os.path.join(ckpts, "nan-step2"))
    with open(os.path.join(ckpts, "latest")) as f:
        assert f.read().strip() == "step1"  # not nan-step2: --resume must not load diverged weights
    assert "nan-step2" in lines[0] and "(step1)" in lines[0], lines[0]
    # step1 holds the weights step 2 started from (the diverging ones): no "--resume" offered
    assert "start again in a new ds_mp.training.output_dir (--output_dir)" in lines[0], lines[0]


def test_skip_stops_after_max_consecutive_skips(data, tmp_path):
    path, ckpts = _diverging(str(tmp_path), data, on_nan="skip", max_consecutive_skips=3)
    rc, err = run_ranks(loop_rank, 1, path, [], timeout=240)[0]
    lines = _errors(err)
    assert rc == 3 and len(lines) == 1, err[-3000:]
    assert "3 steps in a row" in lines[0] and "steps 2-4" in lines[0] and "max_consecutive_skips=3" in lines[0]
    assert os.path.isdir(os.path.join(ckpts, "nan-step4")) and not os.path.isdir(os.path.join(ckpts, "step5"))
    with open(os.path.join(ckpts, "latest")) as f:
        assert f.read().strip() == "step3"  # skipped steps kept the weights: their checkpoints stay valid


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_on_two_ranks(tmp_path, data, policy):
    """PP=2 on two ranks (``launch/train.py``'s loop, in-process), SGD at lr 1e30: ``stop`` fails every
    rank saying so and keeps a ``nan-step`` checkpoint; ``skip`` finishes and logs the skipped steps."""
    cfg = train_config(str(tmp_path), data, steps=3, lr=1e30, training={"on_nan": policy, "export_hf": False,
                                                                        "eval_interval": 0},
                       ds={"gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e30}}})
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    got = run_ranks(loop_rank_output, 2, path, [], timeout=240)
    said = "".join(out + err for _, out, err in got)
    run = os.path.join(str(tmp_path), "run")
    if policy == "stop":
        assert all(rc != 0 for rc, _, _ in got), said[-3000:]
        assert "non-finite loss" in said
        assert any(d.startswith("nan-step") for d in os.listdir(os.path.join(run, "checkpoints")))
    else:
        assert all(rc == 0 for rc, _, _ in got), said[-3000:]
        assert int(read_log(run)[-1]["skipped"]) >= 1


def test_max_consecutive_skips_is_validated():
    from ds_mp.config import ConfigError, load_config

    cfg = ds_config(training={"max_consecutive_skips": -1})
    with pytest.raises(ConfigError, match="training.max_consecutive_skips: must be >= 0"):
        load_config(cfg, 1)


# --- hyper-parameters changed in the config win on resume -----------------------------------
HP = {"lr": 0.01, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}
NEW = {"lr": 0.002, "weight_decay": 0.05, "betas": [0.8, 0.99]}


def _cfg(params: dict, scheduler: bool = False) -> dict:
    cfg = ds_config(micro=2, gas=2, optimizer="AdamW")
    cfg["optimizer"]["params"] = dict(params)
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": params["lr"],
                                                           "warmup_num_steps": 3}}
    return cfg


def _hparams(engine) -> list[dict]:
    return [{k: g[k] for k in ("lr", "weight_decay", "betas", "eps")} for g in engine.optimizer.param_groups]


def _resume_with(rank: int, ckpt: str) -> dict:
    import ds_mp

    data = [batches(2, 2, 16, 203, seed=s) for s in range(4)]
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=_cfg(HP))
    for mbs in data[:2]:
        engine.train_batch(iter(mbs))
    ds_mp.save_checkpoint(engine, ckpt, "mid")
    saved = _hparams(engine)
    for g in engine.optimizer.param_groups:  # the oracle: the same run, its groups edited by hand
        g.update(lr=NEW["lr"], betas=tuple(NEW["betas"]), weight_decay=NEW["weight_decay"] if g["weight_decay"] else 0.0)
    want = [float(engine.train_batch(iter(mbs))) for mbs in data[2:]]
    out: dict = {"want": want, "saved": saved}
    for name, params, scheduler in (("changed", {**HP, **NEW}, False), ("same", HP, False),
                                    ("scheduled", {**HP, **NEW}, True)):
        resumed, *_ = ds_mp.initialize(model=tiny_gpt2(seed=1), config=_cfg(params, scheduler))
        err, sys.stderr = sys.stderr, io.StringIO()
        try:
            ds_mp.load_checkpoint(resumed, ckpt)
            out[name] = {"note": sys.stderr.getvalue(), "hp": _hparams(resumed)}
        finally:
            sys.stderr = err
        if name == "changed":
            out[name]["got"] = [float(resumed.train_batch(iter(mbs))) for mbs in data[2:]]
    return out


def test_changed_hyperparameters_win_on_resume(tmp_path):
    r = run_ranks(_resume_with, 1, str(tmp_path), timeout=240)[0]
    changed, same, scheduled = r["changed"], r["same"], r["scheduled"]
    torch.testing.assert_close(torch.tensor(changed["got"]), torch.tensor(r["want"]), rtol=1e-6, atol=0)
    decays = {g["weight_decay"] for g in changed["hp"]}
    assert decays == {0.0, 0.05} and all(g["lr"] == 0.002 and tuple(g["betas"]) == (0.8, 0.99) for g in changed["hp"])
    note = changed["note"].strip().splitlines()
    assert len(note) == 1 and all(w in note[0] for w in ("lr 0.01 -> 0.002", "weight_decay 0.1 -> 0.05", "betas")), note
    assert same["note"] == "" and same["hp"] == r["saved"]  # unchanged config: the exact resume
    assert "scheduler" in scheduled["note"] and "lr 0.01" not in scheduled["note"]  # the scheduler owns lr
    assert [g["lr"] for g in scheduled["hp"]] == [g["lr"] for g in r["saved"]]
    assert {g["weight_decay"] for g in scheduled["hp"]} == {0.0, 0.05}


def test_split_groups_pair_by_a_changed_weight_decay():
    """Ouroboros keeps one group per module (more engine groups than saved ones), paired by weight
    decay: a decay the config changed is looked up under its saved value."""
    from ds_mp.checkpoint import CheckpointError
    from ds_mp.checkpoint.training import _matching_groups

    ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    base = torch.optim.AdamW([{"params": [p], "weight_decay": 0.05 * (i % 2 == 0)} for i, p in enumerate(ps)], lr=0.1)
    saved = [{"weight_decay": 0.1, "lr": 0.3}, {"weight_decay": 0.0, "lr": 0.3}]
    pairs = _matching_groups(base, saved, "ckpt", (0.1, 0.05))
    assert [s["weight_decay"] for _, s in pairs] == [0.1, 0.0, 0.1, 0.0]
    with pytest.raises(CheckpointError, match="weight decay"):  # without knowing the change: refused
        _matching_groups(base, saved, "ckpt")
