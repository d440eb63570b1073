"""End-to-end runs through the real ``deepspeed`` launcher on CPU ranks (gloo), and what else a
launched run is checked against: a run stopped and resumed, other schedules, TP and bf16, a bad
config, on in-process ranks (``train_in_process``: the same training loop without the launcher's
start-up)."""
from __future__ import annotations

import json
import os

import pytest
from dist_utils import run_ranks
from launcher_utils import explain, launch, loop_rank, read_log, tiny_dataset, train_config, train_in_process

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("launcher")))


@pytest.mark.launcher
def test_train_pp2_checkpoint_exact_resume_export(tmp_path, data):
    """4 steps through the launcher log, validate, checkpoint and export; a run stopped after 2
    steps and resumed to 4 (on in-process ranks) has the launched run's losses at steps 1-4."""
    full = os.path.join(str(tmp_path), "full")
    os.makedirs(full)
    cfg = train_config(full, data, steps=4, lr=1e-2)
    proc = launch(full, cfg)
    assert proc.returncode == 0, explain(proc)
    run = os.path.join(full, "run")
    rows = read_log(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])  # it learns
    assert rows[1]["val_loss"] and rows[3]["val_loss"]
    assert os.path.isfile(os.path.join(run, "hf", "config.json"))
    assert os.path.isfile(os.path.join(run, "checkpoints", "latest"))
    part = os.path.join(str(tmp_path), "part")
    os.makedirs(part)
    cfg = train_config(part, data, steps=2, lr=1e-2)
    train_in_process(part, cfg, n=2)
    cfg["ds_mp"]["training"]["steps"] = 4
    train_in_process(part, cfg, n=2, args=("--resume",))
    got = read_log(os.path.join(part, "run"))
    assert [int(r["step"]) for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == [r["loss"] for r in rows]  # printed with 6 decimals: fp32 print precision


@pytest.mark.parametrize("schedule,tp,pp,ds", [("gpipe", 1, 2, {}), ("1f1b", 2, 1, {"bf16": {"enabled": True}})],
                         ids=["gpipe-pp2", "1f1b-tp2-bf16"])
def test_schedules_tp_and_bf16_train(tmp_path, data, schedule, tp, pp, ds):
    cfg = train_config(str(tmp_path), data, tp=tp, pp=pp, schedule=schedule, steps=2, ds=ds,
                       training={"export_hf": False})
    train_in_process(str(tmp_path), cfg, n=2)
    rows = read_log(os.path.join(str(tmp_path), "run"))
    assert len(rows) == 2 and all(float(r["loss"]) > 0 for r in rows)


@pytest.mark.launcher
def test_hostfile_localhost(tmp_path, data):
    """The multi-node path (hostfile) with a hostfile naming only localhost."""
    hostfile = os.path.join(str(tmp_path), "hostfile")
    with open(hostfile, "w") as f:
        f.write("localhost slots=2\n")
    cfg = train_config(str(tmp_path), data, steps=1, training={"export_hf": False})
    proc = launch(str(tmp_path), cfg, launcher_args=("--hostfile", hostfile, "--num_nodes", "1", "--no_ssh_check",
                                                     "--master_addr", "127.0.0.1"))
    assert proc.returncode == 0, explain(proc)


def test_bad_config_fails_fast_on_two_ranks(tmp_path, data):
    """Both ranks refuse the config in one line and write nothing (in-process: the launcher's own
    handling of a failed rank is test_bad_inputs.py's launcher cases)."""
    cfg = train_config(str(tmp_path), data, tensor_parallel={"size": 3})  # 3 does not divide 4 heads
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    got = run_ranks(loop_rank, 2, path, [], timeout=60)
    assert all(rc != 0 and "ds_mp.tensor_parallel.size: 3 does not divide n_head=4" in err for rc, err in got), got
    assert not os.path.exists(os.path.join(str(tmp_path), "run", "checkpoints"))


def test_shipped_quickstart_config_is_what_readme_runs():
    with open(os.path.join(os.path.dirname(__file__), "..", "ds_configs", "quickstart.json")) as f:
        cfg = json.load(f)
    assert cfg["ds_mp"]["pipeline"]["stages"] == 2 and cfg["ds_mp"]["data"].get("path", "") == ""
