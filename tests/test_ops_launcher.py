"""A rank never outlives its launcher, even during start-up (issue 43, items 1 and 5), through the
real ``deepspeed`` launcher.

On main b45273d SIGTERM to the ``deepspeed`` runner, or SIGKILL to ``launch.py``, 0.3 s after the
ranks were spawned (still importing torch) left both ranks training to the end with nobody
waiting, holding the output directory's lock; SIGTERM to a rank still importing killed it
without a word (``launch.py`` then exited 241).  Now ``import ds_mp`` arms the launcher guard
(``ds_mp/launcher_guard.py``) before torch is imported.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
from launcher_utils import children, cmdline, start, tiny_dataset, train_config
from test_signals import _alive

pytestmark = [pytest.mark.launcher, pytest.mark.serial, pytest.mark.timeout(600)]

#: The ranks end within a poll (0.2 s) of importing ds_mp; importing torch and DeepSpeed on a busy
#: 2-core machine is most of the bound, which stays far below a run that trains on.
ORPHAN_BOUND_S = 90


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("orphans")))


def _spawned(proc, limit: float = 180) -> tuple[int, list[int]]:
    """Wait until ``launch.py`` has started both ranks: (launch.py's pid, the ranks' pids)."""
    t0 = time.time()
    while time.time() - t0 < limit:
        job = [proc.pid, *children(proc.pid)]
        launcher = next((p for p in job if "deepspeed.launcher.launch" in cmdline(p)), None)
        ranks = [p for p in job if "launch/train.py" in cmdline(p) and p not in (proc.pid, launcher)]
        if launcher is not None and len(ranks) == 2:
            return launcher, ranks
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    raise AssertionError("the ranks were not spawned")


def _handles_sigterm(pid: int) -> bool:
    """``pid`` has a handler for SIGTERM (``SigCgt`` in ``/proc/PID/status``): ds_mp was imported."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(x.split()[1], 16) for x in f if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _all_gone(pids: list[int]) -> float:
    t0 = time.time()
    while any(_alive(p) for p in pids) and time.time() - t0 < ORPHAN_BOUND_S:
        time.sleep(0.1)
    left = [cmdline(p) for p in pids if _alive(p)]
    assert not left, f"still running {time.time() - t0:.0f} s after the signal: {left}"
    return time.time() - t0


def _cleanup(proc, pids: list[int]) -> None:
    for p in [proc.pid, *pids, *children(proc.pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.mark.parametrize("target,signum", [("runner", signal.SIGTERM), ("launch", signal.SIGKILL)])
def test_launcher_gone_during_start_up_ends_every_rank(tmp_path, data, target, signum):
    """SIGTERM to the runner / SIGKILL to ``launch.py`` 0.3 s after the ranks were spawned: every
    rank is gone within the bound, nothing trained, and the lock is free (a restart is not refused)."""
    from ds_mp.training.run_dir import RunDir, check_unlocked

    tmp = str(tmp_path)
    proc = start(tmp, train_config(tmp, data, steps=10_000, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                                      "export_hf": False}))
    launcher, ranks = _spawned(proc)
    try:
        time.sleep(0.3)
        os.kill(proc.pid if target == "runner" else launcher, signum)
        secs = _all_gone([launcher, *ranks])
        print(f"{target}: every rank gone {secs:.1f} s after the signal")
    finally:
        _cleanup(proc, [launcher, *ranks])
    run = os.path.join(tmp, "run")
    assert not os.path.exists(os.path.join(run, "checkpoints", "latest"))
    check_unlocked(run)  # what a restart checks first on every rank
    lock = RunDir()
    lock.lock(run)  # and what its rank 0 takes
    lock.release()


def test_sigterm_to_a_rank_still_importing_is_143_with_one_line(tmp_path, data):
    """SIGTERM to rank 1 once it imported ds_mp (it handles SIGTERM) and is importing torch: it exits
    128 + 15 with one line; ``launch.py`` ends rank 0 and the job exits 143 (main: 241, no line)."""
    tmp = str(tmp_path)
    proc = start(tmp, train_config(tmp, data, steps=10_000, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                                      "export_hf": False}))
    launcher, ranks = _spawned(proc)
    try:
        t0 = time.time()
        while not _handles_sigterm(ranks[1]) and time.time() - t0 < 60 and _alive(ranks[1]):
            time.sleep(0.005)
        os.kill(ranks[1], signal.SIGTERM)
        _all_gone([launcher, *ranks])
        output = proc.stdout.read()
        code = proc.wait(timeout=60)
    finally:
        _cleanup(proc, [launcher, *ranks])
    lines = [x[x.index("ds_mp: rank"):] for x in output.splitlines() if "stopped during start-up" in x]
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert any(x.startswith("ds_mp: rank 1 stopped during start-up: SIGTERM") for x in lines), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
