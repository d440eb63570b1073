"""Helpers for end-to-end runs through the real ``deepspeed`` launcher."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from typing import Any

from dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 512, "n_positions": 64, "dropout": 0.0}


def tiny_dataset(root: str) -> str:
    """A small prepared dataset (a few stdlib modules, 400-token BPE), built once per dir."""
    from ds_mp.data import prepare_data, stdlib_files

    out = os.path.join(root, "data")
    if not os.path.exists(os.path.join(out, "meta.json")):
        files = [f for f in stdlib_files() if os.path.basename(f) in
                 ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "colorsys.py", "bisect.py", "heapq.py")]
        prepare_data(files, out, vocab_size=400, val_fraction=0.3, show_progress=False)
    return out


def train_config(tmp: str, data: str, *, tp: int = 1, pp: int = 2, schedule: str = "1f1b", steps: int = 4,
                 micro: int = 2, gas: int = 2, lr: float = 3e-3, **extra: Any) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "ds_mp": {"model": dict(TINY_MODEL), "tensor_parallel": {"size": tp},
                     "pipeline": {"stages": pp, "schedule": schedule},
                     "data": {"path": data, "seq_len": 32},
                     "training": {"steps": steps, "log_interval": 1, "eval_interval": 2, "eval_batches": 1,
                                  "checkpoint_interval": 2, "output_dir": os.path.join(tmp, "run")}}}
    for key, value in extra.items():
        if key == "ds":
            cfg.update(value)
        elif isinstance(value, dict):
            cfg["ds_mp"].setdefault(key, {}).update(value)
        else:
            cfg["ds_mp"][key] = value
    return cfg


def _command(cmd_tail: list[str], n: int, launcher_args: tuple, collective_timeout: int) -> tuple[list[str], dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_MP_TIMEOUT=str(collective_timeout), PYTHONUNBUFFERED="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), *launcher_args,
           "--master_port", str(free_port())]
    if "--hostfile" not in launcher_args:
        cmd += ["--num_gpus", str(n)]
    return cmd + cmd_tail, env


def _write_config(tmp: str, cfg: dict) -> str:
    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def start(tmp: str, cfg: dict, args: tuple = (), collective_timeout: int = 30) -> subprocess.Popen:
    """``deepspeed --num_gpus 2 launch/train.py ...`` started in the background (stdout and stderr
    together in ``proc.stdout``)."""
    cmd, env = _command(["launch/train.py", "--deepspeed_config", _write_config(tmp, cfg), *args], 2, (),
                        collective_timeout)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (launch.py, the ranks, their helpers)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in children(k)]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def wait_for_steps(run_dir: str, n: int, proc: subprocess.Popen, limit: float = 180) -> None:
    """Wait until ``log.csv`` has ``n`` rows (the run failing first fails the test)."""
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


def launch(tmp: str, cfg: dict | None, n: int = 2, script: str = "launch/train.py", args: tuple = (),
           timeout: float = 240, launcher_args: tuple = (), config_path: str | None = None,
           collective_timeout: int = 60) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus n <script> --deepspeed_config <cfg>``; returns the finished process.
    ``collective_timeout``: seconds a rank waits in a collective before failing (``DS_MP_TIMEOUT``)."""
    if config_path is None:
        config_path = _write_config(tmp, cfg)
    cmd, env = _command([script, "--deepspeed_config", config_path, *args], n, launcher_args, collective_timeout)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_log(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "log.csv")) as f:
        return list(csv.DictReader(f))


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def loop_rank(rank: int, cfg_path: str, args: list[str]) -> tuple[int, str]:
    """Rank program for ``dist_utils.run_ranks``: ``ds_mp.training.loop.main`` on ``cfg_path`` with
    ``args``; returns its exit code and what it wrote to stderr (the one-line errors tests read)."""
    import io
    import sys

    from ds_mp.training.loop import main

    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        return main(["--deepspeed_config", cfg_path, *args]), sys.stderr.getvalue()
    finally:
        sys.stderr = err


def loop_rank_output(rank: int, cfg_path: str, args: list[str]) -> tuple[int, str, str]:
    """:func:`loop_rank` that also returns what the rank printed to stdout."""
    import io
    import sys

    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        rc, err = loop_rank(rank, cfg_path, args)
        return rc, sys.stdout.getvalue(), err
    finally:
        sys.stdout = out


def train_in_process(tmp: str, cfg: dict, n: int, args: tuple = (), timeout: float = 300) -> list[str]:
    """What ``launch(tmp, cfg, n=n, args=args)`` runs (``launch/train.py``, or ``launch/finetune.py``
    with ``--model``), on ``n`` in-process ranks (``run_ranks``): the same training loop without
    the launcher's start-up.  Fails the test unless every rank exits 0 (showing each rank's stderr);
    returns what each rank printed to stdout."""
    from dist_utils import run_ranks

    got = run_ranks(loop_rank_output, n, _write_config(tmp, cfg), list(args), timeout=timeout)
    assert all(rc == 0 for rc, _, _ in got), "\n".join(f"rank {r}: exit {rc}\n{err[-3000:]}"
                                                       for r, (rc, _, err) in enumerate(got))
    return [out for _, out, _ in got]


# Variables an in-process test of the same pytest session may have left in os.environ (Accelerate's
# settings written by TrainingArguments, a rank's rendezvous): a launched job must not inherit them.
_SESSION_LEFTOVERS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without Accelerate's ``ACCELERATE_*`` settings and rendezvous variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k not in _SESSION_LEFTOVERS}
    env.update(extra)
    return env
