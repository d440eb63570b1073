"""A job owns its output directory (issue 36, part A): one resume point for every rank, one run
at a time, leftovers cleaned, checkpoints rotated, ``log.csv`` continued without duplicates.

Every case runs ``ds_mp.training.loop.main`` on 2 spawned CPU ranks (PP = 2, gloo) against a copy
of one finished 4-step run (checkpoints step1 … step4).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from dist_utils import run_ranks
from launcher_utils import read_log, tiny_dataset, train_config


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("run_dir")))


def _config(tmp: str, data: str, steps: int, **training) -> str:
    cfg = train_config(tmp, data, steps=steps, training={"checkpoint_interval": 1, "eval_interval": 0,
                                                         "export_hf": False, **training})
    path = os.path.join(tmp, f"config-{steps}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _main(rank: int, argv: list[str], hook: str = "") -> dict:
    """``loop.main(argv)`` on this rank with its stdout/stderr captured; ``hook`` names a patch."""
    import contextlib
    import io

    from ds_mp.training import loop

    record = HOOKS[hook](rank) if hook else {}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = loop.main(argv)
        except Loaded:
            rc = "loaded"
        except Exception as e:  # noqa: BLE001 - a peer that failed first: reported as the result
            rc = f"{type(e).__name__}: {e}"
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), **record}


class Loaded(Exception):
    """Ends a rank right after its checkpoint load (the race test needs nothing more)."""


def _moving_latest(rank: int) -> dict:
    """Reproduce the requeue race: rank 0 reads ``latest`` (step2), then another job's save moves it
    to step4 before rank 1 reads it.  Records the tag each rank loads."""
    import time

    import ds_mp.checkpoint as ckpt
    import ds_mp.checkpoint.training as training
    import ds_mp.training.run_dir as run_dir

    original_read, original_load = training.read_latest, ckpt.load_checkpoint
    record: dict = {}

    def read_latest(root: str) -> str | None:
        marker = os.path.join(root, "..", "rank0-read")
        if rank == 0:
            tag = original_read(root)
            if not os.path.exists(marker):
                with open(os.path.join(root, "latest"), "w") as f:  # the other job's save lands now
                    f.write("step4\n")
                open(marker, "w").close()
            return tag
        deadline = time.time() + 20
        while not os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.05)
        return original_read(root)

    def load_checkpoint(engine, root, tag=None, **kw):
        record["loaded"] = tag
        original_load(engine, root, tag, **kw)
        raise Loaded

    training.read_latest = run_dir.read_latest = read_latest
    ckpt.load_checkpoint = load_checkpoint
    return record


def _disk_use(rank: int) -> dict:
    """Record the checkpoint directory's size after every rotation (rank 0 rotates)."""
    import ds_mp.training.run_dir as run_dir

    original, sizes = run_dir.rotate, []

    def rotate(root: str, keep_last: int) -> list[str]:
        deleted = original(root, keep_last)
        sizes.append(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs))
        with open(os.path.join(root, "..", "sizes.json"), "w") as f:
            json.dump(sizes, f)
        return deleted

    run_dir.rotate = rotate
    return {}


HOOKS = {"moving_latest": _moving_latest, "disk_use": _disk_use}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, data) -> str:
    """4 steps, a checkpoint after each (latest = step4)."""
    tmp = str(tmp_path_factory.mktemp("first"))
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 4)], timeout=240)
    assert [r["rc"] for r in results] == [0, 0], results
    return tmp


def _copy(first_run: str, tmp_path) -> str:
    dst = str(tmp_path / "job")
    shutil.copytree(first_run, dst)
    return dst


def _set_latest(tmp: str, text: str) -> None:
    with open(os.path.join(tmp, "run", "checkpoints", "latest"), "w") as f:
        f.write(text)


def _error_lines(result: dict) -> list[str]:
    return [line for line in result["err"].splitlines() if line.startswith("ds_mp: error:")]


def test_every_rank_resumes_from_the_tag_rank0_read(first_run, data, tmp_path):
    """``latest`` moves (step2 -> step4, another job saving) between rank 0's read and rank 1's:
    both ranks load the one tag rank 0 chose.  Before, each rank read ``latest`` itself: rank 0
    loaded step2, rank 1 step4, and the job trained a model made of two checkpoints."""
    tmp = _copy(first_run, tmp_path)
    _set_latest(tmp, "step2\n")
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 6), "--resume"], "moving_latest",
                        timeout=240)
    assert [r["rc"] for r in results] == ["loaded", "loaded"], results
    assert results[0]["loaded"] == results[1]["loaded"], [r["loaded"] for r in results]


@pytest.mark.parametrize("resume", [["--resume"], []])
def test_second_run_is_refused_naming_the_holder(first_run, data, tmp_path, resume):
    """A run holding ``output_dir`` (here: this test process) keeps it: a second run, resumed or
    not, is refused on every rank with one line naming the holder's pid and host."""
    from ds_mp.training.run_dir import RunDir

    tmp = _copy(first_run, tmp_path)
    holder = RunDir()
    holder.lock(os.path.join(tmp, "run"))
    try:
        results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 6), *resume], timeout=240)
    finally:
        holder.release()
    for r in results:
        assert r["rc"] == 2, r
        lines = _error_lines(r)
        assert len(lines) == 1 and "in use by another run" in lines[0] and f"pid {os.getpid()}" in lines[0], r


def test_fresh_run_into_a_used_directory_is_refused(first_run, data, tmp_path):
    """No ``--resume`` into a directory holding checkpoints: refused with both ways out (before, it
    moved ``latest`` back to its own step1 and truncated the log)."""
    tmp = _copy(first_run, tmp_path)
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 6)], timeout=240)
    for r in results:
        lines = _error_lines(r)
        assert r["rc"] == 2 and len(lines) == 1, r
        assert "already holds checkpoints" in lines[0] and "--resume" in lines[0] and "--output_dir" in lines[0]
    assert open(os.path.join(tmp, "run", "checkpoints", "latest")).read().strip() == "step4"


def test_empty_latest_names_the_newest_checkpoint(first_run, data, tmp_path):
    """``latest`` empty while step1 … step4 are complete: one line naming step4 and how to resume it."""
    tmp = _copy(first_run, tmp_path)
    _set_latest(tmp, "")
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 6), "--resume"], timeout=240)
    for r in results:
        lines = _error_lines(r)
        assert r["rc"] == 2 and len(lines) == 1, r
        assert "'step4'" in lines[0] and "--resume step4" in lines[0], lines


def test_resume_tag_rotation_leftovers_and_log(first_run, data, tmp_path):
    """``--resume step2`` (latest is step4) with ``keep_last: 2`` for 8 steps, into a directory a
    killed run left with a stale lock and temporaries:

    * the stale lock is taken over (its dead holder named) and the leftovers are removed;
    * steps 3 and 4 equal the uninterrupted first run's (the tag asked for was loaded);
    * ``log.csv`` holds steps 1 … 8 once each (the first run's rows 3 and 4 were dropped);
    * after every save at most 2 ``stepN`` checkpoints remain: disk use stays bounded;
    * no "HF model in" line with ``export_hf`` off."""
    tmp = _copy(first_run, tmp_path)
    run, ckpts = os.path.join(tmp, "run"), os.path.join(tmp, "run", "checkpoints")
    first_losses = [float(r["loss"]) for r in read_log(run)]
    with open(os.path.join(run, "ds_mp.lock"), "w") as f:
        json.dump({"host": "node7", "pid": 999999, "since": "2026-11-26T03:00:00"}, f)
    leftovers = [os.path.join(ckpts, "latest.tmp-4242"), os.path.join(ckpts, "step5.tmp"),
                 os.path.join(ckpts, "step3.old-4242"), os.path.join(run, "hf.tmp-4242")]
    open(leftovers[0], "w").close()
    for d in leftovers[1:]:
        os.makedirs(d)
    one = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ckpts, "step4")) for f in fs)
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 8, keep_last=2), "--resume", "step2"],
                        "disk_use", timeout=280)
    assert [r["rc"] for r in results] == [0, 0], results
    err, out = results[0]["err"], results[0]["out"]
    assert "took over" in err and "pid 999999 on node7" in err, err
    assert not [p for p in leftovers if os.path.exists(p)]
    log = read_log(run)
    assert [int(r["step"]) for r in log] == list(range(1, 9)), [r["step"] for r in log]
    losses = [float(r["loss"]) for r in log]
    assert losses[:4] == pytest.approx(first_losses, rel=1e-6, abs=0)
    assert sorted(d for d in os.listdir(ckpts) if d.startswith("step")) == ["step7", "step8"]
    sizes = json.load(open(os.path.join(tmp, "run", "sizes.json")))
    assert len(sizes) == 6 and max(sizes) <= 2.2 * one, (sizes, one)
    assert "ds_mp: done" in out and "HF model in" not in out, out[-500:]


def test_full_disk_on_log_is_one_line(data, tmp_path):
    """``log.csv`` on a full disk (here: a link to /dev/full): one line naming the log and the fix on
    rank 0, and every rank ends after the same step (rank 1 did not fail in a collective)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "run"))
    os.symlink("/dev/full", os.path.join(tmp, "run", "log.csv"))
    results = run_ranks(_main, 2, ["--deepspeed_config", _config(tmp, data, 2)], timeout=240)
    lines = _error_lines(results[0])
    assert [r["rc"] for r in results] == [2, 2] and len(lines) == 1, results
    assert not _error_lines(results[1]), results[1]["err"]
    assert "log.csv: cannot write the training log (No space left on device)" in lines[0], lines


def test_rotation_spares_latest_diagnostics_own_tags_and_saves_in_progress(tmp_path):
    """``keep_last: 2`` over step1 … step5 written in that order, ``latest`` pointing at step2 (a
    resume from it): step4 and step5 stay as the newest, step2 as latest's target; ``nan-step3``,
    ``best`` and the unfinished ``step6.tmp`` are not rotated."""
    import time

    from ds_mp.checkpoint.sharded import META
    from ds_mp.training.run_dir import rotate

    root = tmp_path / "checkpoints"
    for tag in ("step1", "nan-step3", "best", "step2", "step3", "step4", "step5", "step6.tmp"):
        (root / tag).mkdir(parents=True)
        (root / tag / META).write_text("{}")
        time.sleep(0.01)  # distinct write times: "newest" is by when a checkpoint was written
    (root / "latest").write_text("step2\n")
    assert sorted(rotate(str(root), 2)) == ["step1", "step3"]
    assert sorted(os.listdir(root)) == ["best", "latest", "nan-step3", "step2", "step4", "step5", "step6.tmp"]
    assert rotate(str(root), 0) == []
