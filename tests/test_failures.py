"""Failure behaviour through the real launcher: dead ranks, NaN losses, killed saves."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from launcher_utils import REPO, explain, launch, read_log, tiny_dataset, train_config

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("failures")))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def _start(tmp: str, cfg: dict, args: tuple = ()) -> subprocess.Popen:
    import json

    from dist_utils import free_port

    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_MP_TIMEOUT="30", PYTHONUNBUFFERED="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(free_port()),
           "--num_gpus", "2", "launch/train.py", "--deepspeed_config", path, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(run_dir: str, n: int, proc: subprocess.Popen, limit: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        try:
            if len(read_log(run_dir)) >= n:
                return
        except (OSError, StopIteration):
            pass
        time.sleep(0.5)
    raise AssertionError("training did not reach the wanted step")


def test_killed_rank_fails_the_job_within_60s(tmp_path, data):
    cfg = train_config(str(tmp_path), data, steps=10_000, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                                     "export_hf": False})
    proc = _start(str(tmp_path), cfg)
    try:
        _wait_for_steps(os.path.join(str(tmp_path), "run"), 2, proc)
        ranks = [p for p in _children(proc.pid)
                 if "launch/train.py" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
        assert ranks, "no rank processes found"
        os.kill(ranks[-1], signal.SIGKILL)
        t0 = time.time()
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert time.time() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, data):
    """SIGKILL the job while it writes checkpoints; the last complete one loads and resumes."""
    run = os.path.join(str(tmp_path), "run")
    cfg = train_config(str(tmp_path), data, steps=10_000, training={"checkpoint_interval": 1, "eval_interval": 0,
                                                                     "export_hf": False})
    proc = _start(str(tmp_path), cfg)
    try:
        _wait_for_steps(run, 3, proc)
        for p in _children(proc.pid) + [proc.pid]:  # every save is in flight or just done
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ckpts = os.path.join(run, "checkpoints")
    with open(os.path.join(ckpts, "latest")) as f:
        tag = f.read().strip()
    done = int(tag.replace("step", ""))
    assert done >= 1
    cfg["ds_mp"]["training"]["steps"] = done + 1
    out = launch(str(tmp_path), cfg, args=("--resume",))
    assert out.returncode == 0, explain(out)
    assert int(read_log(run)[-1]["step"]) == done + 1


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss(tmp_path, data, policy):
    cfg = train_config(str(tmp_path), data, steps=3, lr=1e30, training={"on_nan": policy, "export_hf": False,
                                                                        "eval_interval": 0},
                       ds={"gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e30}}})
    proc = launch(str(tmp_path), cfg)
    run = os.path.join(str(tmp_path), "run")
    if policy == "stop":
        assert proc.returncode != 0, explain(proc)
        assert "non-finite loss" in proc.stderr + proc.stdout
        assert any(d.startswith("nan-step") for d in os.listdir(os.path.join(run, "checkpoints")))
    else:
        assert proc.returncode == 0, explain(proc)
        assert int(read_log(run)[-1]["skipped"]) >= 1
