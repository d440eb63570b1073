"""Ouroboros and TeraPipe end to end: ``launch/train.py``'s loop on in-process CPU ranks (gloo).

Ouroboros, K modules on K-1 ranks: train, checkpoint (weights + in-flight state), ``--resume``
to more steps, export an HF directory that ``GPT2LMHeadModel.from_pretrained`` loads and whose
loss on the validation batch is the one the run logged (the trained weights, all ranks' parts).
TeraPipe ``"slices": "auto"``: the engine profiles its stages, plans, trains and rank 0 writes
the fitted cost model to ``<output_dir>/terapipe_profile.json``.  The ranks are in-process
(``train_in_process``, as ``deepspeed`` would start them but without its per-run start-up of 10-30 s):
the launcher adds nothing these check, and its own path runs end to end in test_launcher.py.
"""
from __future__ import annotations

import os

import pytest
from launcher_utils import TINY_MODEL, read_log, tiny_dataset, train_config, train_in_process

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("schedule_runs")))


@pytest.mark.parametrize("K, tp, dp, bf16", [(3, 2, 1, False), (3, 1, 2, True)], ids=["K3-tp2", "K3-dp2-bf16"])
def test_ouroboros_train_checkpoint_resume_export(tmp_path, data, K, tp, dp, bf16):
    """K=3 with TP=2 inside modules and K=3 × DP=2 in bf16, each on 4 ranks: 2 steps (checkpoint
    at the end), resume to 4, export (the in-process tests compare the same layouts, K=3 on 2
    ranks and K=4 on 3 ranks, with the Algorithm-1 reference)."""
    import torch
    from transformers import GPT2LMHeadModel

    from ds_mp.data import TokenDataset, ValidationBatches

    cfg = train_config(str(tmp_path), data, pp=K - 1, tp=tp, schedule="ouroboros", steps=2, micro=2, gas=1, lr=1e-2,
                       ouroboros={"modules": K})
    if bf16:
        cfg["bf16"] = {"enabled": True}
    n = (K - 1) * tp * dp
    train_in_process(str(tmp_path), cfg, n=n)
    run = os.path.join(str(tmp_path), "run")
    assert [int(r["step"]) for r in read_log(run)] == [1, 2]
    with open(os.path.join(run, "checkpoints", "latest")) as f:
        tag = f.read().strip()
    assert tag == "step2"
    inflight = {f for f in os.listdir(os.path.join(run, "checkpoints", tag)) if f.startswith("schedule-")}
    assert inflight == {f"schedule-pp{r:02d}-tp{t:02d}-dp{d:02d}.pt"  # every rank's work in flight
                        for r in range(K - 1) for t in range(tp) for d in range(dp)}

    cfg["ds_mp"]["training"]["steps"] = 4
    train_in_process(str(tmp_path), cfg, n=n, args=("--resume",))
    rows = read_log(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(float(r["loss"]) > 0 for r in rows) and rows[3]["val_loss"]

    model = GPT2LMHeadModel.from_pretrained(os.path.join(run, "hf"))
    assert (model.config.n_layer, model.config.n_embd) == (TINY_MODEL["n_layer"], TINY_MODEL["n_embd"])
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    losses = []
    for d in range(dp):  # what eval_batches=1 reads on each DP replica (the run averages them)
        ids, labels = next(iter(ValidationBatches(TokenDataset(data, "val"), 32, 2, 1, d, dp)))
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=labels).loss))
    loss = sum(losses) / dp
    tol = 3e-2 if bf16 else 1e-4  # bf16: the run evaluated in bf16, HF here in fp32
    assert float(loss) == pytest.approx(float(rows[3]["val_loss"]), abs=tol)  # the trained weights, exported


def test_terapipe_auto_slices_writes_profile(tmp_path, data):
    cfg = train_config(str(tmp_path), data, pp=2, schedule="terapipe", steps=2, gas=2,
                       terapipe={"slices": "auto", "granularity": 8},
                       training={"export_hf": False, "checkpoint_interval": 0})
    train_in_process(str(tmp_path), cfg, n=2)
    run = os.path.join(str(tmp_path), "run")
    rows = read_log(run)
    assert [int(r["step"]) for r in rows] == [1, 2] and all(float(r["loss"]) > 0 for r in rows)
    from ds_mp.schedules.terapipe.cost_model import load_cost_model

    cost = load_cost_model(os.path.join(run, "terapipe_profile.json"))  # reusable via ds_mp.terapipe.profile
    table = cost.models[max(cost.sizes)]  # the micro-batch size's measured t(i, 0) table
    assert len(table.lengths) > 3 and all(t > 0 for t in table.times)
