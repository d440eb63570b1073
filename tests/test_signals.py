"""Stopping a job through the real launcher (issue 36, part A): SIGTERM or SIGINT to the
``deepspeed`` runner, to ``launch.py`` or to one rank ends every process of the job within
STOP_BOUND_S, after the ranks finished the step and saved (``training.save_on_signal``), with
one line saying where; ``--resume`` then continues with the uninterrupted run's losses.

DeepSpeed 0.19.8's single-node runner installs no signal handler: before, a SIGTERM to it ended
the runner alone and ``launch.py`` and both ranks kept training (see ds_mp/training/signals.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from launcher_utils import children, cmdline, read_log, start, tiny_dataset, train_config, train_in_process, \
    wait_for_steps

pytestmark = pytest.mark.serial  # bounds the time from a signal to every process gone

#: A step and a save take about 1 s here; the bound leaves room for a busy 2-core machine.
STOP_BOUND_S = 120


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("signals")))


def _alive(pid: int) -> bool:
    """Running (a zombie no reaper collected counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(tmp: str, data: str, target: str, signum: int, save: bool) -> tuple[str, int | None, int]:
    """Train until step 2, send ``signum`` to ``target``; returns (output, exit code of the runner
    or None if it was the one signalled, the step the line names)."""
    cfg = train_config(tmp, data, steps=10_000, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                          "export_hf": False, "save_on_signal": save})
    proc = start(tmp, cfg)
    try:
        wait_for_steps(os.path.join(tmp, "run"), 2, proc)
        job = [proc.pid, *children(proc.pid)]
        launcher = next(p for p in job if "deepspeed.launcher.launch" in cmdline(p))
        ranks = [p for p in job if "launch/train.py" in cmdline(p) and p not in (proc.pid, launcher)]
        assert len(ranks) == 2, [cmdline(p) for p in job]
        os.kill({"runner": proc.pid, "launch": launcher, "rank": ranks[1]}[target], signum)
        t0 = time.time()
        while any(_alive(p) for p in job) and time.time() - t0 < STOP_BOUND_S:
            time.sleep(0.2)
        print(f"{target}: all gone {time.time() - t0:.1f} s after the signal")
        left = [cmdline(p) for p in job if _alive(p)]
        assert not left, f"still running {time.time() - t0:.0f} s after the signal: {left}"
        output = proc.stdout.read()
        code = proc.wait(timeout=10)
    finally:
        for p in [proc.pid, *children(proc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [line[line.index("ds_mp: stopped by"):] for line in output.splitlines() if "ds_mp: stopped by" in line]
    assert len(lines) == 1, output[-3000:]
    step = int(lines[0].split(" after step ")[1].split(":")[0].split(",")[0])
    return lines[0], code, step


@pytest.mark.launcher
@pytest.mark.timeout(600)
def test_sigterm_to_the_deepspeed_runner_stops_saves_and_resumes_exactly(tmp_path, data):
    """SIGTERM to the ``deepspeed`` PID (what a supervisor tracking one PID sends): the runner dies at
    once, the ranks see it (they watch launch.py's parent), finish the step, save, exit; then
    ``--resume`` continues with the losses of a run never interrupted (both on in-process ranks)."""
    tmp = str(tmp_path / "stopped")
    os.makedirs(tmp)
    line, _, step = _stop(tmp, data, "runner", signal.SIGTERM, save=True)
    run = os.path.join(tmp, "run")
    assert "SIGTERM" in line and f"checkpoint saved in {os.path.join(run, 'checkpoints', f'step{step}')}" \
        in line, line
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == f"step{step}"
    cfg = train_config(tmp, data, steps=step + 2, training={"checkpoint_interval": 0, "eval_interval": 0,
                                                            "export_hf": False})
    train_in_process(tmp, cfg, n=2, args=("--resume",))  # what follows the signal is not the launcher's
    full = str(tmp_path / "full")
    os.makedirs(full)
    training = {"checkpoint_interval": 0, "eval_interval": 0, "export_hf": False}
    train_in_process(full, train_config(full, data, steps=step + 2, training=training), n=2)
    got, want = read_log(run), read_log(os.path.join(full, "run"))
    assert [int(r["step"]) for r in got] == list(range(1, step + 3))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # 6 decimals: fp32 print precision


@pytest.mark.launcher
@pytest.mark.timeout(600)
@pytest.mark.parametrize("target,signum,save", [("launch", signal.SIGINT, True), ("rank", signal.SIGTERM, False),
                                                ("launch", signal.SIGKILL, True)])
def test_signal_to_launch_py_or_one_rank_stops_every_process(tmp_path, data, target, signum, save):
    """SIGINT to ``launch.py`` (it terminates rank 0 first: rank 1 learns from the per-step flag),
    SIGTERM to rank 1 alone with ``save_on_signal`` off, or SIGKILL to ``launch.py`` (its ranks get
    SIGTERM from the kernel: PR_SET_PDEATHSIG): every process ends after one line saying what was
    (or was not) saved."""
    line, code, step = _stop(str(tmp_path), data, target, signum, save)
    if signum != signal.SIGKILL:  # DeepSpeed's runner exits 0 when launch.py died of a signal
        assert code != 0
    ckpts = os.path.join(str(tmp_path), "run", "checkpoints")
    if save:
        assert f"checkpoint saved in {os.path.join(ckpts, f'step{step}')}" in line, line
        assert os.path.isdir(os.path.join(ckpts, f"step{step}"))
    else:
        assert "not saved (training.save_on_signal is off)" in line, line
        assert not os.path.exists(os.path.join(ckpts, "latest"))


def test_a_stop_that_cannot_finish_ends_the_rank_after_the_grace(tmp_path):
    """The backstop: a rank whose stop cannot finish (here: a main thread that never returns to the
    loop) exits 128 + signal with one line once ``grace_s`` has passed since the request, ending with
    what ``last_saved`` says (the Trainer path: the last complete checkpoint)."""
    code = ("import os, signal, time\n"
            "from ds_mp.training.signals import StopFlag\n"
            "StopFlag(grace_s=1.0, poll_s=0.1, last_saved=lambda: '; the last complete checkpoint is X').install()"
            ".running()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert time.time() - t0 < 50
    assert "stop requested by SIGTERM" in proc.stderr and "exiting without a save; the last complete checkpoint is X" \
        in proc.stderr, proc.stderr


def test_a_scripts_own_loop_is_not_told_it_was_in_start_up() -> None:
    """Under ``launch.py`` the guard of ``import ds_mp`` still handles the signals of a script that
    trains with its own loop after ``ds_mp.initialize`` (no StopFlag there): its line says that loop
    does not save on a signal, not "stopped during start-up: nothing was trained" (false there)."""
    code = ("import os, signal, time\n"
            "from ds_mp import launcher_guard\n"
            "launcher_guard._GUARD.append(launcher_guard.Guard(launcher_guard.Chain()).start())  # as arm() under launch.py\n"
            "launcher_guard.engine_built()  # what ds_mp.initialize calls\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RANK="1"))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "ds_mp: rank 1 stopped by SIGTERM: this script's training loop does not stop on a signal" in proc.stderr
    assert "start-up" not in proc.stderr, proc.stderr
