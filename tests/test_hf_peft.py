"""PEFT under ``ds_mp.hf`` as the outside tests of issue 48 use it, against plain TRL / the plain
Trainer on one process (fp32, dropout 0, SGD) at TP = 2:

* a ``PeftModel`` passed as ``model`` (TRL's ``test_train_peft_model``) trains its adapter, not the
  base: the adapter ``save_model`` writes and the one in ``trainer.model`` equal the plain run's, the
  base weights stay, for ``ds_mp.hf.Trainer`` and ``SFTTrainer``;
* ``SFTTrainer(model="<path>", peft_config=LoraConfig(...))`` loads the model as TRL does and trains
  the same adapter;
* ``SFTTrainer.evaluate(eval_dataset=<raw chat dataset>)`` prepares the set as TRL does: the same
  eval loss.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import randomise_lora_b, tiny_gpt2
from test_hf_sft import trl_sft_script
from test_hf_trainer import collate, ds_json, rows, training_args

pytestmark = pytest.mark.timeout(1200)


def _adapter(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "adapter_model.safetensors"))


def _lora_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt2_peft() -> Any:
    from peft import LoraConfig, get_peft_model

    base = tiny_gpt2()
    base.loss_type = "ForCausalLM"  # test_hf_trainer's module docstring (the oracle's count)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0)
    return randomise_lora_b(get_peft_model(base, cfg), 5)  # B ≠ 0: A trains from the first step


def _trainer_run(out: str, ds: dict | None) -> dict:
    from transformers import Trainer as PlainTrainer

    from ds_mp.hf import Trainer

    cls = PlainTrainer if ds is None else Trainer
    trainer = cls(model=_gpt2_peft(), args=training_args(out, ds, max_steps=3, optim="sgd", learning_rate=0.5),
                  train_dataset=rows(24), data_collator=collate)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "model": _lora_state(trainer.model),
            "dir": os.path.join(out, "final")}


def _trainer_rank(rank: int, out: str, ds: dict) -> dict:
    return _trainer_run(out, ds)


def _same_adapter(got: dict, ref: dict, initial: dict) -> None:
    a, b = _adapter(got["dir"]), _adapter(ref["dir"])
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    moved = [k for k in ref["model"] if "lora_" in k and not torch.equal(ref["model"][k], initial[k])]
    assert moved, "the oracle's adapter did not train"
    for k, v in ref["model"].items():  # trainer.model: the trained adapter, the base as it was
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-5, msg=f"trainer.model: {k}")
        if "lora_" not in k:
            assert torch.equal(got["model"][k], initial[k]), k


def test_trainer_trains_a_peft_models_adapter(tmp_path: Any) -> None:
    initial = _lora_state(_gpt2_peft())
    ref = _trainer_run(str(tmp_path / "plain"), None)
    got = run_ranks(_trainer_rank, 2, str(tmp_path / "ds_mp"), ds_json(tp=2), timeout=900)
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for res in got:
        _same_adapter(res, ref, initial)


SFT_ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, optim="sgd",
                learning_rate=0.5, max_length=48, per_device_eval_batch_size=64, logging_steps=1, save_strategy="no",
                report_to="none", seed=0, bf16=False, use_cpu=True, disable_tqdm=True)


def _qwen2_lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
                      task_type="CAUSAL_LM")


def _sft_run(out: str, model_dir: str, ds: str | None, as_peft_model: bool) -> dict:
    """3 SGD steps of TRL's SFT on raw chats, LoRA from ``peft_config`` on a model named by path,
    or (``as_peft_model``) a PeftModel passed as ``model``; then ``evaluate`` of a raw chat set."""
    import trl
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from ds_mp.hf import SFTTrainer

    script = trl_sft_script()
    cls = trl.SFTTrainer if ds is None else SFTTrainer
    args = trl.SFTConfig(output_dir=out, deepspeed=ds, **SFT_ARGS)
    chats = Dataset.from_list(script.tiny_chats(40))
    model, peft_config = model_dir, _qwen2_lora()
    if as_peft_model:
        set_seed(1)
        model, peft_config = randomise_lora_b(get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                                             peft_config), 5), None
    trainer = cls(model=model, args=args, train_dataset=chats.select(range(32)),
                  processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config)
    initial = _lora_state(trainer.model)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    eval_loss = trainer.evaluate(eval_dataset=chats.select(range(32, 40)))["eval_loss"]
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "eval_loss": eval_loss,
            "model": _lora_state(trainer.model), "initial": initial, "dir": os.path.join(out, "final")}


def _sft_rank(rank: int, *args: Any) -> dict:
    return _sft_run(*args)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: Any) -> str:
    script = trl_sft_script()
    path = str(tmp_path_factory.mktemp("qwen2"))
    tok = script.tiny_tokenizer()
    script.tiny_model("qwen2", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("as_peft_model", [pytest.param(False, id="path-and-peft_config"),
                                           pytest.param(True, id="peft-model")])
def test_sft_lora_and_raw_eval_set_equal_plain_trl(as_peft_model: bool, qwen2_dir: str, tmp_path: Any) -> None:
    ref = _sft_run(str(tmp_path / "plain"), qwen2_dir, None, as_peft_model)
    cfg = ds_json(tp=2)
    del cfg["ds_mp"]["data"]  # seq_len from max_length, as TRL's scripts leave it
    got = run_ranks(_sft_rank, 2, str(tmp_path / "ds_mp"), qwen2_dir, cfg, as_peft_model, timeout=900)
    assert len(ref["losses"]) == 3 and got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got[0]["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    for k, v in ref["initial"].items():
        assert torch.equal(got[0]["initial"][k], v), k  # the same PEFT model (TRL's seed, TRL's load)
    for res in got:
        _same_adapter(res, ref, ref["initial"])
