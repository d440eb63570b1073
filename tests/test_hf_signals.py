"""Stopping a job on the Trainer path (``ds_mp.hf.stop``): a SIGTERM to one rank during
``trainer.train()`` makes every rank save checkpoint-k after the same step and exit 128 + 15 with one
true line; ``resume_from_checkpoint=True`` continues from it with the uninterrupted run's losses and
skips a newer, half-written checkpoint; a save that fails leaves no ``checkpoint-N`` at all.

The ranks run in-process (``run_ranks``); the start-up guard that ``import ds_mp`` arms under
DeepSpeed's ``launch.py`` is armed by hand in them, as it is there (before, it stayed on through
training: the signal ended the rank at once with "stopped during start-up: nothing was trained or
saved", and nothing was saved).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest

from dist_utils import run_ranks
from test_hf_trainer import _logs, collate, ds_json, rows, training_args


def _rank(rank: int, model_dir: str, out: str, signal_at: int | None, resume: bool) -> dict:
    import contextlib
    import io
    import signal

    from transformers import TrainerCallback

    from ds_mp import launcher_guard
    from ds_mp.hf import Trainer

    # what ds_mp.launcher_guard.arm() does in a rank of deepspeed's launch.py (no launcher to watch here)
    launcher_guard._GUARD.append(launcher_guard.Guard(launcher_guard.Chain()).start())

    class Kill(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if rank == 1 and state.global_step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # one rank only: rank 0 learns it from the step's agreement

    trainer = Trainer(model=model_dir, args=training_args(out, ds_json(tp=2)), train_dataset=rows(24),
                      data_collator=collate, callbacks=[Kill()])
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            trainer.train(resume_from_checkpoint=True if resume else None)
        except SystemExit as e:
            code = e.code
    # after train() the start-up guard's "nothing was trained" handler is not put back: the default is
    return {"code": code, "stderr": err.getvalue(), "logs": _logs(trainer.state),
            "default_handler": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}


def test_sigterm_saves_a_complete_checkpoint_that_resumes_exactly(gpt2_dir: str, tmp_path: Any) -> None:
    """SIGTERM to rank 1 after step 3 of 5 (TP = 2, save_strategy "no"): both ranks exit 143 after
    step 3, rank 0 says where checkpoint-3 is; it is complete (trainer_state.json at step 3, ds_mp's
    state, no staging left); a newer half-written checkpoint-4 (no trainer_state.json, a
    ``latest.tmp-PID``) is skipped with one line and the resumed run logs the uninterrupted one's
    losses, grad norms and LRs for steps 1-5."""
    full = run_ranks(_rank, 2, gpt2_dir, str(tmp_path / "full"), None, False, timeout=600)
    assert all(r["code"] == 0 and r["default_handler"] for r in full)
    out = str(tmp_path / "cut")
    cut = run_ranks(_rank, 2, gpt2_dir, out, 3, False, timeout=600)
    assert [r["code"] for r in cut] == [143, 143], cut
    ckpt = os.path.join(out, "checkpoint-3")
    line = [s for s in cut[0]["stderr"].splitlines() if s.startswith("ds_mp:")]
    assert line == [f"ds_mp: stopped by SIGTERM after step 3: checkpoint saved in {ckpt}; continue with "
                    "trainer.train(resume_from_checkpoint=True)"], cut[0]["stderr"][-2000:]
    assert not any("start-up" in r["stderr"] for r in cut) and "ds_mp:" not in cut[1]["stderr"]
    assert sorted(os.listdir(out)) == ["checkpoint-3"]  # nothing else: the staging directory is gone
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3
    assert open(os.path.join(ckpt, "latest")).read().strip() == "ds_mp"

    half = os.path.join(out, "checkpoint-4")  # what a save killed mid-way wrote before ds_mp.hf.stop
    shutil.copytree(ckpt, half)
    os.remove(os.path.join(half, "trainer_state.json"))
    os.rename(os.path.join(half, "latest"), os.path.join(half, "latest.tmp-123"))
    resumed = run_ranks(_rank, 2, gpt2_dir, out, None, True, timeout=600)
    assert f"ds_mp: resume skips {half}: no readable trainer_state.json" in resumed[0]["stderr"]
    assert [r["code"] for r in resumed] == [0, 0]
    got, want = resumed[0]["logs"], full[0]["logs"]
    assert [h["step"] for h in got] == [1, 2, 3, 4, 5] == [h["step"] for h in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6) and g["learning_rate"] == w["learning_rate"], (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)


def _failing_save_rank(rank: int, model_dir: str, out: str) -> dict:
    from transformers.trainer_utils import get_last_checkpoint

    from ds_mp.hf import Trainer

    class FailingSave(Trainer):
        def _save_rng_state(self, output_dir: str) -> None:
            if self.state.global_step == 4:
                raise OSError(28, "No space left on device")
            super()._save_rng_state(output_dir)

    args = training_args(out, ds_json(), max_steps=4, save_strategy="steps", save_steps=2,
                         per_device_train_batch_size=1, gradient_accumulation_steps=1)
    trainer = FailingSave(model=model_dir, args=args, train_dataset=rows(8), data_collator=collate)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    return {"entries": sorted(os.listdir(out)), "last": get_last_checkpoint(out)}


def test_a_failed_save_leaves_no_checkpoint_under_its_name(gpt2_dir: str, tmp_path: Any) -> None:
    """The Trainer's save of checkpoint-4 fails half-way (after the model and ds_mp's state): only
    checkpoint-2 carries a checkpoint name, so transformers' own ``get_last_checkpoint`` picks it."""
    got = run_ranks(_failing_save_rank, 1, gpt2_dir, str(tmp_path), timeout=300)[0]
    assert got["entries"] == [".ds_mp-partial", "checkpoint-2"], got
    assert got["last"] == os.path.join(str(tmp_path), "checkpoint-2")


def test_resume_skips_or_refuses_an_incomplete_checkpoint(tmp_path: Any) -> None:
    """``last_complete`` takes the newest checkpoint with a readable trainer_state.json and a finished
    ds_mp/ (``latest``), saying one line per newer one skipped; an explicit incomplete path is refused
    in one line naming the last complete one."""
    from types import SimpleNamespace

    from ds_mp.config import ConfigError
    from ds_mp.hf.stop import last_complete, resume_point

    def make(step: int, state: bool = True, latest: str | None = "ds_mp") -> str:
        path = os.path.join(str(tmp_path), f"checkpoint-{step}")
        os.makedirs(os.path.join(path, "ds_mp"))
        if state:
            with open(os.path.join(path, "trainer_state.json"), "w") as f:
                json.dump({"global_step": step}, f)
        if latest is not None:
            with open(os.path.join(path, "latest"), "w") as f:
                f.write(latest)
        return path

    good = make(2)
    no_state, no_latest = make(10, state=False), make(7, latest=None)
    with open(os.path.join(str(tmp_path), "checkpoint-12"), "w") as f:  # not a directory
        f.write("x")
    said: list[str] = []
    assert last_complete(str(tmp_path), said.append) == good
    assert said[0] == f"ds_mp: resume skips {os.path.join(str(tmp_path), 'checkpoint-12')}: not a directory"
    assert said[1] == f"ds_mp: resume skips {no_state}: no readable trainer_state.json (a save that was interrupted)"
    assert said[2].startswith(f"ds_mp: resume skips {no_latest}: no finished ds_mp/ checkpoint") and len(said) == 3
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), is_world_process_zero=lambda: True)
    assert resume_point(trainer, True) == good
    with pytest.raises(ConfigError) as e:
        resume_point(trainer, no_state)
    assert f"{no_state} is incomplete" in str(e.value) and f"last complete checkpoint is {good}" in str(e.value)
    assert "\n" not in str(e.value)


EXIT_SCRIPT = '''
import atexit, sys
import torch
import torch.distributed as dist

atexit.register(lambda: print(f"rank {dist_rank} at exit: group {'alive' if dist.is_initialized() else 'gone'}",
                              flush=True))  # registered first: runs after ds_mp's shutdown
import ds_mp
from ds_mp.engine.initialize import init_distributed

init_distributed()
dist_rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
if "--destroy" in sys.argv:  # a script that tears the group down itself
    dist.destroy_process_group()
print(f"rank {dist_rank} done {t.item():.0f}", flush=True)
'''


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_finished_job_exits_0_under_every_launcher(tmp_path: Any) -> None:
    """A script that initialised distributed through ds_mp and did its collective ends with the
    process group destroyed (``init_distributed`` registers ``shutdown_distributed`` at exit:
    before, only launch/*.py did, and a group left to the exit-time destructors aborted 2 of 8
    finished ``accelerate launch`` Trainer runs on a loaded machine: "terminate called without an
    active exception", exit 1).  Four ends per launcher (``deepspeed``, ``torchrun``, ``accelerate
    launch``), two launches at a time (4 ranks on the 2 cores: the load); half of the scripts destroy
    the group themselves (the registered shutdown then does nothing).  Every launch exits 0."""
    from concurrent.futures import ThreadPoolExecutor

    from test_hf_trainer import _launch

    script, config = str(tmp_path / "end.py"), str(tmp_path / "ds.json")
    with open(script, "w") as f:
        f.write(EXIT_SCRIPT)
    with open(config, "w") as f:
        json.dump(ds_json(), f)
    runs = [(kind, i) for i in range(4) for kind in ("deepspeed", "torchrun", "accelerate")]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda run: _launch(run[0], script, [str(tmp_path), "--destroy" if run[1] % 2
                                                                   else "--keep", config]), runs))
    for (kind, i), proc in zip(runs, procs):
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{kind} #{i}: exit {proc.returncode}\n{out[-3000:]}"
        for rank in (0, 1):
            assert f"rank {rank} done 2" in out and f"rank {rank} at exit: group gone" in out, f"{kind} #{i}\n{out[-3000:]}"
