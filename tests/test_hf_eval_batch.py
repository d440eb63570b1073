"""``per_device_eval_batch_size`` is read by ``ds_mp.hf.Trainer.evaluate`` (it was silently the train
micro-batch): an eval step is that many rows, cut into the pipeline's fixed micro-batches; the
Trainer's ``on_prediction_step`` (its eval progress bar) fires once per eval step, as the plain
Trainer's does, and the eval loss is the per-token loss over the whole set whatever the batch size
(the outside oracle: the plain Trainer on one process with the whole eval set in one batch)."""
from __future__ import annotations

from typing import Any

import pytest

from dist_utils import run_ranks
from helpers import tiny_gpt2
from test_hf_trainer import collate, ds_json, rows, training_args

pytestmark = pytest.mark.timeout(900)


def _evaluate(model_dir: str, out: str, ds: dict | None, eval_rows: int) -> dict:
    """Eval steps (``on_prediction_step`` calls) and eval loss of an untrained model, 8 eval rows."""
    from transformers import AutoModelForCausalLM, Trainer as PlainTrainer, TrainerCallback

    from ds_mp.hf import Trainer as DsMpTrainer

    steps = []

    class Count(TrainerCallback):
        def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(1)

    model, Trainer = model_dir, DsMpTrainer
    if ds is None:
        model, Trainer = AutoModelForCausalLM.from_pretrained(model_dir), PlainTrainer
        model.loss_type = "ForCausalLM"
    trainer = Trainer(model=model, args=training_args(out, ds, per_device_eval_batch_size=eval_rows),
                      train_dataset=rows(8), eval_dataset=rows(8, seed=9), data_collator=collate, callbacks=[Count()])
    return {"loss": trainer.evaluate()["eval_loss"], "steps": len(steps)}


def _rank(rank: int, *a: Any) -> dict:
    return _evaluate(*a)


def test_per_device_eval_batch_size_is_read(tmp_path: Any) -> None:
    model_dir = str(tmp_path / "model")
    tiny_gpt2().save_pretrained(model_dir)
    whole = _evaluate(model_dir, str(tmp_path / "p8"), None, 8)  # one batch: the per-token loss of the set
    plain3 = _evaluate(model_dir, str(tmp_path / "p3"), None, 3)
    assert (whole["steps"], plain3["steps"]) == (1, 3)
    got = run_ranks(_rank, 2, model_dir, str(tmp_path / "ds"), ds_json(tp=2), 3, timeout=600)
    for res in got:  # every rank evaluated 3 steps of 3, 3, 2 rows (micro-batches of 2 rows each)
        assert res["steps"] == plain3["steps"]
        assert res["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    dp = run_ranks(_rank, 2, model_dir, str(tmp_path / "dp"), ds_json(), 5, timeout=600)
    assert [r["steps"] for r in dp] == [1, 1]  # DP = 2: an eval step of 5 rows per replica, 3 on the second
    assert dp[0]["loss"] == pytest.approx(whole["loss"], rel=1e-5)
