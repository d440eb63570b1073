"""Start-up faults said in one line (issue 43, items 4 and 5): a damaged or escaping ``latest``,
NaN diagnostics that are not the run's checkpoints, a full disk when the lock is written, a lock
held by a process that is not a ds_mp run, DeepSpeed-side config mistakes, a taken rendezvous
port and a changed ``seq_len`` on resume.  Each case failed on main b45273d with a traceback, a
wrong answer or advice that did not work."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from dist_utils import run_ranks
from launcher_utils import REPO, loop_rank, tiny_dataset, train_config

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("ops")))


def _root(tmp_path, tags=("step2", "step4"), latest: bytes | None = None) -> str:
    """A checkpoint root with finished (meta-holding) tag directories and a ``latest`` of these bytes."""
    from ds_mp.checkpoint.sharded import META

    root = str(tmp_path / "checkpoints")
    for t in tags:
        os.makedirs(os.path.join(root, t))
        with open(os.path.join(root, t, META), "w") as f:
            f.write("{}")
    if latest is not None:
        with open(os.path.join(root, "latest"), "wb") as f:
            f.write(latest)
    return root


@pytest.mark.parametrize("latest,why", [(b"\xff\xfestep4\n", "not UTF-8"), (b"\0" * 16, "not one checkpoint"),
                                        (b"step9\n", "'step9', which is not a finished checkpoint"),
                                        (b"../..\n", "not one checkpoint directory"),
                                        (b"nan-step3\n", "not a finished checkpoint")])
def test_damaged_latest_is_one_line_naming_the_tags(tmp_path, latest, why):
    """``--resume`` with a ``latest`` of other bytes, NULs, a missing tag, a path out of the run or
    a diagnostic: refused before the engine is built, naming the tags that exist; following the
    advice (``--resume step4``) is accepted."""
    from ds_mp.checkpoint import CheckpointError
    from ds_mp.training.run_dir import RunDirError, choose_resume

    root = _root(tmp_path, tags=("step2", "step4", "nan-step3"), latest=latest)
    with pytest.raises((CheckpointError, RunDirError)) as e:
        choose_resume(root, "latest")
    msg = str(e.value)
    assert "latest is damaged" in msg and why in msg and "step2, step4" in msg and "--resume TAG" in msg, msg
    assert "\n" not in msg and "nan-step3" not in msg.split("finished checkpoints here")[1], msg
    assert choose_resume(root, "step4") == "step4"


def test_nan_diagnostics_are_not_the_runs_checkpoints(tmp_path):
    """A directory holding only ``nan-stepN`` diagnostics: a fresh start is allowed (what the NaN
    message advises) and ``--resume`` says there is nothing to resume and why."""
    from ds_mp.training.run_dir import RunDirError, choose_resume

    root = _root(tmp_path, tags=("nan-step2",))
    assert choose_resume(root, None) is None
    with pytest.raises(RunDirError, match=r"only NaN diagnostics.*run without --resume first"):
        choose_resume(root, "latest")


def test_full_disk_when_the_lock_is_written(tmp_path, monkeypatch):
    """ENOSPC writing ``ds_mp.lock``: one line with the path and the fix, no empty lock file left."""
    from ds_mp.training.run_dir import RunDir, RunDirError

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    out = str(tmp_path / "run")
    with pytest.raises(RunDirError) as e:
        RunDir().lock(out)
    assert os.path.join(out, "ds_mp.lock") in str(e.value) and "No space left" in str(e.value), e.value
    assert "free space" in str(e.value) and "--output_dir" in str(e.value)
    assert not os.path.exists(os.path.join(out, "ds_mp.lock"))
    monkeypatch.undo()
    RunDir().lock(out)  # the advice followed (space freed): the run starts


def test_lock_held_by_another_program_names_it(tmp_path):
    """A ``flock`` on ``ds_mp.lock`` by a program that is not ds_mp (a backup tool, a stray
    shell): every rank's refusal names that process, not "an unknown holder"."""
    from ds_mp.training.run_dir import RunDir, RunDirError, check_unlocked

    out = str(tmp_path / "run")
    os.makedirs(out)
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, os.path.join(out, "ds_mp.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for attempt in (lambda: check_unlocked(out), lambda: RunDir().lock(out)):
            with pytest.raises(RunDirError) as e:
                attempt()
            assert f"pid {holder.pid} (" in str(e.value) and "not a ds_mp run" in str(e.value), e.value
    finally:
        holder.kill()
        holder.wait()


def _write(tmp: str, cfg: dict, name: str = "config.json") -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("ds_mp: error:")]


@pytest.mark.parametrize("ds,key", [
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.01, "torch_adam": True}}}, "optimizer.params.torch_adam"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "3e-4", "torch_adam": True}}}, "optimizer.params.lr"),
    ({"scheduler": {"type": "WarmupCosineLr", "params": {}}}, "did you mean 'WarmupCosineLR'"),
    ({"scheduler": {"type": "ExponentialLr", "params": {"gamma": 0.9}}}, "did you mean 'ExponentialLR'"),
])
def test_deepspeed_config_mistakes_are_one_line(data, tmp_path, ds, key):
    """DeepSpeed-side mistakes (a leftover ``torch_adam`` under SGD, ``lr`` as a string, a misspelt
    scheduler) stop every rank before the engine with one line naming the key (main: TypeError /
    AssertionError tracebacks from inside DeepSpeed)."""
    cfg = train_config(str(tmp_path), data, pp=1, steps=2, ds=ds, training={"export_hf": False})
    rc, err = run_ranks(loop_rank, 1, _write(str(tmp_path), cfg), [], timeout=240)[0]
    lines = _errors(err)
    assert rc == 2 and len(lines) == 1 and key in lines[0], err[-3000:]
    assert "Traceback" not in err


def test_changed_seq_len_on_resume_names_the_key(data, tmp_path):
    """``--resume`` with another ``data.seq_len``: one line naming ``ds_mp.data.seq_len`` and both
    values (main: ``sampler state has num_chunks=… but this run has …``); the advice (resume with
    the saved seq_len) then works."""
    tmp = str(tmp_path)
    cfg = train_config(tmp, data, pp=1, steps=2, training={"export_hf": False, "eval_interval": 0})
    rc, err = run_ranks(loop_rank, 1, _write(tmp, cfg), [], timeout=240)[0]
    assert rc == 0, err[-3000:]
    cfg["ds_mp"]["training"]["steps"] = 3
    cfg["ds_mp"]["data"]["seq_len"] = 16
    rc, err = run_ranks(loop_rank, 1, _write(tmp, cfg, "short.json"), ["--resume"], timeout=240)[0]
    lines = _errors(err)
    assert rc == 2 and len(lines) == 1 and "ds_mp.data.seq_len" in lines[0] and "32" in lines[0], err[-3000:]
    cfg["ds_mp"]["data"]["seq_len"] = 32
    rc, err = run_ranks(loop_rank, 1, _write(tmp, cfg, "same.json"), ["--resume"], timeout=240)[0]
    assert rc == 0, err[-3000:]


@pytest.mark.serial  # bounds the time to exit
def test_taken_rendezvous_port_is_one_line(data, tmp_path):
    """A second job on the rendezvous port of a running one (EADDRINUSE): one line naming the port
    and ``--master_port`` (main: a DistNetworkError traceback)."""
    cfg = train_config(str(tmp_path), data, pp=1, steps=2, training={"export_hf": False})
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    code = "import sys\nfrom ds_mp.training.loop import main\nsys.exit(main(sys.argv[1:]))\n"
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", code, "--deepspeed_config", _write(str(tmp_path), cfg)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    finally:
        taken.close()
    lines = _errors(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"127.0.0.1:{port} is in use" in lines[0] and "--master_port" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and time.time() - t0 < 200


def test_token_file_rewritten_in_place_is_checked_again(data, tmp_path):
    """A token file rewritten in place (same size) with its mtime put back (``touch -r``): the cached
    largest id is not trusted (the ctime moved), so an id beyond the vocab is refused at open
    naming the file (main: the stale cache passed it to the first stage's check mid-training)."""
    import shutil

    import numpy as np

    from ds_mp.data import DataError
    from ds_mp.data import checks
    from ds_mp.data.dataset import TokenDataset

    copy = str(tmp_path / "data")
    shutil.copytree(data, copy)
    file = os.path.join(copy, "tokens.bin")
    checks.check_token_ids(TokenDataset(copy), 512)  # cached: largest id < 400
    before = os.stat(file)
    time.sleep(0.05)
    tokens = np.memmap(file, dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = 600
    tokens.flush()
    del tokens
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(file).st_size == before.st_size and os.stat(file).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(DataError, match=r"tokens.bin: token id 600 >= the model's vocab_size 512"):
        checks.check_token_ids(TokenDataset(copy), 512)
