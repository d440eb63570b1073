"""Failure behaviour through the real launcher: dead ranks, killed saves (NaN losses: test_nan_resume.py)."""
from __future__ import annotations

import os
import signal
import time

import pytest
from launcher_utils import children, cmdline, read_log, start, tiny_dataset, train_config, train_in_process, wait_for_steps

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("failures")))


@pytest.mark.serial  # bounds the time from a killed rank to the job's end
def test_killed_rank_fails_the_job_within_60s(tmp_path, data):
    cfg = train_config(str(tmp_path), data, steps=10_000, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                                     "export_hf": False})
    proc = start(str(tmp_path), cfg)
    try:
        wait_for_steps(os.path.join(str(tmp_path), "run"), 2, proc)
        ranks = [p for p in children(proc.pid) if "launch/train.py" in cmdline(p)]
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
    """SIGKILL the job while it writes checkpoints; the last complete one loads and resumes (on
    in-process ranks)."""
    run = os.path.join(str(tmp_path), "run")
    cfg = train_config(str(tmp_path), data, steps=10_000, training={"checkpoint_interval": 1, "eval_interval": 0,
                                                                     "export_hf": False})
    proc = start(str(tmp_path), cfg)
    try:
        wait_for_steps(run, 3, proc)
        for p in children(proc.pid) + [proc.pid]:  # every save is in flight or just done
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
    train_in_process(str(tmp_path), cfg, n=2, args=("--resume",))  # the resume itself needs no launcher
    assert int(read_log(run)[-1]["step"]) == done + 1
