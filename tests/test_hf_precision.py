"""``ds_mp.hf.Trainer`` with ZeRO-1 / ZeRO-2 and with bf16, against the one-process oracle: the plain
``transformers.Trainer`` (no ds_mp, no DeepSpeed) on the same checkpoint, data and arguments
(:mod:`test_hf_trainer`'s machinery: uneven rows, masked prompts, AdamW with warm-up, decay,
clipping and weight decay, 5 steps; DP = 2 against one process with twice the accumulation).

* fp32, ZeRO-1 and ZeRO-2 at DP = 2 (the optimizer state, and with stage 2 the gradients,
  partitioned over the two replicas): the plain Trainer's losses, grad norms, LRs, eval loss and
  saved weights to fp32 tolerance (:func:`test_hf_trainer.assert_same_run`, 1e-5).
* bf16: the plain Trainer with ``bf16=True`` is torch autocast (fp32 weights, matmuls in bf16,
  softmax / layer norm / loss in fp32); DeepSpeed's bf16 keeps bf16 weights and activations
  everywhere and an fp32 master copy in the optimizer.  The two round in different places, each
  rounding worth up to 2^-8 = 0.4 % relative (bf16's 8-bit significand), so they agree to bf16
  roundings, not to fp32 noise.  The stated tolerance: every logged loss and the eval loss within
  :data:`BF16_LOSS` relative of the plain bf16 run (a loss averages hundreds of token losses, whose
  roundings partly cancel: measured 3.4e-4 worst), the grad norms within :data:`BF16_NORM` (measured
  3.1e-3), the LRs exactly, and each saved tensor within :data:`BF16_APART` of its training move:
  ``|ds_mp - plain| <= BF16_APART * |plain - initial|`` (Frobenius norms; measured 5.1e-2 at TP = 2).
  The weights get the loosest bound because AdamW divides each gradient by its own running RMS: a
  rounding difference in a small gradient (the key bias' true gradient is 0) becomes a difference
  the size of a whole update.  Both bf16 runs' weights are farther than 1e-3 of their move from the
  fp32 runs' (asserted: the runs were bf16; fp32 runs agree to ~1e-5).
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from dist_utils import run_ranks
from test_hf_trainer import _ds_mp_rank, _logs, assert_same_run, collate, ds_json, plain_run, rows, training_args

BF16_LOSS = 3e-3  # relative, losses and eval loss (measured 3.4e-4 worst: TP = 2, DP = 2 with ZeRO-1 / ZeRO-2)
BF16_NORM = 3e-2  # relative, pre-clip grad norms (measured 3.1e-3 worst)
BF16_APART = 0.1  # per tensor: |ds_mp - plain| / |plain - initial| (measured 5.1e-2 at TP = 2)


@pytest.fixture(scope="module")
def oracle(gpt2_dir: str, tmp_path_factory: Any) -> Any:
    """The plain Trainer in fp32 (:func:`test_hf_trainer.plain_run`), one run per accumulation count."""
    cache: dict[int, dict] = {}

    def get(gas: int) -> dict:
        if gas not in cache:
            cache[gas] = plain_run(gpt2_dir, str(tmp_path_factory.mktemp(f"plain{gas}")), gas)
        return cache[gas]
    return get


def _zero(stage: int, tp: int = 1, pp: int = 1) -> dict:
    ds = ds_json(tp, pp)
    ds["zero_optimization"] = {"stage": stage}
    return ds


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_zero_fp32_equals_plain_trainer(stage: int, gpt2_dir: str, oracle: Any, tmp_path: Any) -> None:
    """ZeRO-``stage`` at DP = 2, fp32: the plain Trainer's run with 4 micro-batches per step."""
    got = run_ranks(_ds_mp_rank, 2, gpt2_dir, str(tmp_path), _zero(stage), 5, timeout=600)
    assert got[0]["logs"] == got[1]["logs"]
    assert_same_run(got[0], oracle(4))


def _plain_bf16(model_dir: str, out: str, gas: int) -> dict:
    """The oracle in bf16: the plain Trainer on one process with ``bf16=True`` (CPU autocast)."""
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.loss_type = "ForCausalLM"  # see test_hf_trainer's docstring
    eval_rows = rows(8, seed=9)
    trainer = Trainer(model=model, args=training_args(out, gradient_accumulation_steps=gas, bf16=True,
                                                      per_device_eval_batch_size=len(eval_rows)),
                      train_dataset=rows(24), eval_dataset=eval_rows, data_collator=collate)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))
    return {"logs": _logs(trainer.state), "eval_loss": eval_loss, "dir": os.path.join(out, "final")}


@pytest.fixture(scope="module")
def plain_bf16(gpt2_dir: str, tmp_path_factory: Any) -> Any:
    cache: dict[int, dict] = {}

    def get(gas: int) -> dict:
        if gas not in cache:
            cache[gas] = _plain_bf16(gpt2_dir, str(tmp_path_factory.mktemp(f"plain_bf16_{gas}")), gas)
        return cache[gas]
    return get


def _apart(got: str, ref: str, initial: str) -> float:
    """The largest ``|got - ref| / |ref - initial|`` over the saved tensors (Frobenius norms): how far
    apart two runs end, as a fraction of how far training moved each tensor."""
    from transformers import AutoModelForCausalLM

    a, b, w0 = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (got, ref, initial))
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).norm() / (b[k].float() - w0[k].float()).norm()) for k in a)


BF16_LAYOUTS = [pytest.param(2, 1, 0, id="tp2"), pytest.param(1, 1, 1, id="dp2-zero1"),
                pytest.param(1, 1, 2, id="dp2-zero2"), pytest.param(1, 2, 0, id="pp2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp,pp,stage", BF16_LAYOUTS)
def test_bf16_within_the_stated_tolerance_of_plain_bf16(tp: int, pp: int, stage: int, gpt2_dir: str, oracle: Any,
                                                       plain_bf16: Any, tmp_path: Any) -> None:
    """``bf16=True`` at TP = 2, PP = 2 and DP = 2 with ZeRO-1 / ZeRO-2 (each DP replica its own rows)."""
    dp = 2 // (tp * pp)
    got = run_ranks(_ds_mp_rank, 2, gpt2_dir, str(tmp_path), _zero(stage, tp, pp), 5, {"bf16": True},
                    timeout=600)[0]
    ref, fp32 = plain_bf16(2 * dp), oracle(2 * dp)
    assert [h["step"] for h in got["logs"]] == [h["step"] for h in ref["logs"]] == [1, 2, 3, 4, 5]
    for g, r in zip(got["logs"], ref["logs"]):
        assert g["learning_rate"] == pytest.approx(r["learning_rate"], rel=1e-9, abs=1e-12)
        assert g["loss"] == pytest.approx(r["loss"], rel=BF16_LOSS), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=BF16_NORM), (g, r)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=BF16_LOSS)
    apart = _apart(got["dir"], ref["dir"], gpt2_dir)
    assert apart <= BF16_APART, apart
    assert _apart(got["dir"], fp32["dir"], gpt2_dir) > 1e-3, "ds_mp's weights are fp32's: was the run bf16?"
    assert _apart(ref["dir"], fp32["dir"], gpt2_dir) > 1e-3, "the plain bf16 run is fp32's: autocast did not apply"
