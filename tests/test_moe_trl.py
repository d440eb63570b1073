"""A tiny Qwen3-MoE with its aux loss through ``ds_mp.hf.Trainer`` and ``ds_mp.hf.SFTTrainer`` at PP=2 (and a
Mixtral through the SFTTrainer at TP=2),
against the plain ``transformers.Trainer`` and plain ``trl.SFTTrainer`` on one process (the oracles).

HF's Trainer adds each forward's ``coef · aux`` whole (with ``num_items_in_batch``: no division by the
accumulation), TRL 1.16's SFTTrainer divides it by the accumulation steps; ds_mp's trainers set the
engine's ``aux_reduction`` to match ("sum", "mean").  The runs are test_hf_trainer's (padded rows with
masked prompts, AdamW with warm-up, clipping) and test_hf_sft's (ChatML, packing padding-free, assistant-only
loss, SGD, clipping).  Compared: the logged losses (1e-5 relative: they hold the aux term as each trainer
logs it), grad norms (1e-4), the saved weights, and the SFTTrainer's eval loss with its aux term over one
eval batch (several eval batches, each pooled as HF pools it, at every layout: tests/test_moe_eval.py).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from test_moe_pp_models import tiny_moe4

WEIGHT_TOL = 1e-4  # Adam's eps 1e-6 on near-zero gradients (tests/family_checks.trainer_equals_plain_trainer)


def _no_eval(logs: list[dict]) -> list[dict]:
    return [h for h in logs if "loss" in h]


def test_trainer_with_aux_loss_equals_plain_trainer(tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    from test_hf_trainer import _ds_mp_rank, ds_json, plain_run

    model_dir = str(tmp_path / "model")
    model = tiny_moe4(vocab=203)  # test_hf_trainer's rows draw ids below 203
    model.save_pretrained(model_dir)
    got = run_ranks(_ds_mp_rank, 2, model_dir, str(tmp_path / "ds_mp"), ds_json(pp=2), 5, timeout=600)[0]
    ref = plain_run(model_dir, str(tmp_path / "plain"), 2)
    assert [h["step"] for h in got["logs"]] == [h["step"] for h in ref["logs"]]
    for g, r in zip(got["logs"], ref["logs"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (g, r)
    a = AutoModelForCausalLM.from_pretrained(got["dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(ref["dir"]).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=WEIGHT_TOL, msg=k)


@pytest.mark.parametrize("model_type, tp, pp", [("qwen3_moe", 1, 2), ("mixtral", 2, 1)])
def test_sft_trainer_with_aux_loss_equals_plain_trl(tmp_path: Any, model_type: str, tp: int, pp: int) -> None:
    """Qwen3-MoE across two pipeline stages, Mixtral (always renormalised) with its experts ``whole`` over TP2."""
    from transformers import AutoModelForCausalLM

    from test_hf_sft import ARGS, _run, ds_json, trl_sft_script

    tokenizer = trl_sft_script().tiny_tokenizer()
    model_dir = str(tmp_path / "model")
    tiny_moe4(model_type, vocab=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    argv = ARGS + ["--model_name_or_path", model_dir]
    ref = run_ranks(_run, 1, argv + ["--output_dir", str(tmp_path / "plain")], True, timeout=600)[0]
    cfg = ds_json(str(tmp_path / "ds.json"), tp, pp)
    res = run_ranks(_run, 2, argv + ["--output_dir", str(tmp_path / "ds_mp"), "--deepspeed", cfg], False,
                    timeout=900)[0]
    assert len(res["losses"]) == len(ref["losses"]) == 5
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert len(res["eval"]) == len(ref["eval"]) == 1  # one eval batch: HF's per-batch mean is per token
    assert res["eval"] == pytest.approx(ref["eval"], rel=1e-5)  # the aux term pooled over the eval batch
    want, got = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).state_dict() for d in ("plain", "ds_mp"))
    assert want.keys() == got.keys()  # (TRL saves the Hub's per-expert keys, ds_mp the fused tensors: both load)
    worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
    assert worst <= 1e-5, worst


def _collate_no_mask(batch: list[dict]) -> dict[str, torch.Tensor]:
    """test_hf_trainer's collator without the ``attention_mask``: HF then pools every token it is given
    (the batch's own right padding too) into the aux loss, and none of ds_mp's padding to seq_len."""
    from test_hf_trainer import collate

    out = collate(batch)
    del out["attention_mask"]
    return out


def _no_mask_run(rank: int, model_dir: str, out: str, ds: dict | None) -> list[dict]:
    from transformers import AutoModelForCausalLM, Trainer

    from test_hf_trainer import _logs, rows, training_args

    if ds is None:  # the oracle: the plain Trainer on one process
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.loss_type = "ForCausalLM"
    else:
        from ds_mp.hf import Trainer  # type: ignore[no-redef]

        model = model_dir
    trainer = Trainer(model=model, args=training_args(out, ds, max_steps=3), train_dataset=rows(12),
                      data_collator=_collate_no_mask)
    trainer.train()
    return _logs(trainer.state)


def test_trainer_aux_loss_without_attention_mask_counts_no_seq_len_padding(tmp_path: Any) -> None:
    """A collator without an ``attention_mask`` (rows shorter than ds_mp's ``seq_len``): the aux term counts
    the tokens HF's model is given, not ds_mp's padding to ``seq_len`` (which it did before the fix)."""
    from test_hf_trainer import ds_json

    model_dir = str(tmp_path / "model")
    tiny_moe4(vocab=203).save_pretrained(model_dir)
    ref = run_ranks(_no_mask_run, 1, model_dir, str(tmp_path / "plain"), None, timeout=600)[0]
    got = run_ranks(_no_mask_run, 2, model_dir, str(tmp_path / "ds_mp"), ds_json(pp=2), timeout=600)[0]
    assert len(got) == len(ref) == 3
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (g, r)
