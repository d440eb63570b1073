"""``ds_mp.hf.SFTTrainer`` at DP = 2 with gradient accumulation, and resumed from a checkpoint,
against the plain ``trl.SFTTrainer`` on one process (the outside oracle; fp32, dropout 0), on
launch/trl_sft.py's packed chats with assistant-only loss (target counts differ per micro-batch and
per replica).

DP = 2 with GA = 2: in step t, DP rank d's k-th micro-batch is the plain run's micro-batch
t·4 + 2k + d, so one process with GA = 4 sees the same global batch: the same logged losses (1e-5
relative), eval loss and saved weights.  Resume: 3 steps at TP = 2 with a checkpoint every 3 steps,
then ``resume_from_checkpoint=True`` at PP = 2 up to step 5 equals the uninterrupted plain run.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from dist_utils import run_ranks
from test_hf_sft import ARGS, _run, compare, ds_json, plain, saved, trl_sft_script

pytestmark = pytest.mark.timeout(1500)


def _with(args: list[str], **kw: Any) -> list[str]:
    """``args`` with ``--key value`` replaced (or appended)."""
    out = list(args)
    for key, value in kw.items():
        flag = f"--{key}"
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def test_sft_dp2_with_accumulation_equals_plain_trl_with_twice_the_accumulation(tmp_path: Any) -> None:
    root = str(tmp_path / "plain")
    os.makedirs(root)
    ref = plain(root, args=_with(ARGS, gradient_accumulation_steps=4))  # the oracle: one process, GA × DP
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"))
    res = run_ranks(_run, 2, ARGS + ["--output_dir", out, "--deepspeed", cfg], False, timeout=900)[0]
    compare(ref, res, saved(out), "DP2 GA2")


def _resume_rank(rank: int, argv: list[str], stop: int | None, resume: bool) -> dict | None:
    """ds_mp's SFTTrainer with a checkpoint every 3 steps; ``stop``: end after that step (the run is
    cut there); ``resume``: continue from the last checkpoint in output_dir."""
    from transformers import TrainerCallback

    script = trl_sft_script()

    class Cut(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if stop is not None and state.global_step >= stop:
                control.should_training_stop = True

    import ds_mp.hf

    class Trainer(ds_mp.hf.SFTTrainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.add_callback(Cut())

        def train(self, *a: Any, **kw: Any) -> Any:
            return super().train(resume_from_checkpoint=True) if resume else super().train()

    trainer = script.main(argv, trainer_class=Trainer)
    if rank:
        return None
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h], "steps": [h["step"] for h in history if "loss" in h],
            "eval": [h["eval_loss"] for h in history if "eval_loss" in h]}


@pytest.mark.slow
def test_sft_resume_at_another_layout_equals_the_uninterrupted_plain_run(tmp_path: Any) -> None:
    ref = plain(str(tmp_path))
    out = str(tmp_path / "cut")
    argv = _with(ARGS, save_strategy="steps", save_steps=3, output_dir=out)
    first = run_ranks(_resume_rank, 2, argv + ["--deepspeed", ds_json(str(tmp_path / "tp.json"), tp=2)], 3, False,
                      timeout=900)[0]
    assert first["steps"] == [1, 2, 3] and os.path.isdir(os.path.join(out, "checkpoint-3", "ds_mp"))
    second = run_ranks(_resume_rank, 2, argv + ["--deepspeed", ds_json(str(tmp_path / "pp.json"), pp=2)], None, True,
                       timeout=900)[0]
    assert second["steps"] == [1, 2, 3, 4, 5]  # the trainer state carries steps 1-3
    compare(ref, second, saved(out), "resumed TP2 -> PP2")
