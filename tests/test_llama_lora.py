"""LoRA on the Llama family's TP layers equals PEFT's own LoRA on the single-process HF model.

The oracle: ``peft.get_peft_model`` (``nn.Linear``: ``fan_in_fan_out=False``) on a tiny
``Qwen2ForCausalLM`` (q/k/v biases, 2 key/value heads) targeting ``q_proj``, ``v_proj`` and
``down_proj`` (column, grouped key/value and row-parallel bases), its B factors randomised (PEFT
inits B = 0, which would leave A's gradient zero in step 1), handed to ``ds_mp.initialize``; both
take the same SGD steps.  At TP=2 and TP=2 × PP=2: per-step losses, a frozen base, and the exported
adapter (``PeftModel.from_pretrained``) and merged export (``from_pretrained``) giving the
reference's logits.  TP=3 with 2 key/value heads and ``v_proj`` targeted is refused at config time.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, hf_reference, randomise_lora_b
from test_llama import tiny_llama
from test_lora import train_and_export_lora

VOCAB, SEQ, R, ALPHA, LR = 1003, 16, 4, 8.0, 0.05
TARGETS = ["q_proj", "v_proj", "down_proj"]


def peft_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(tiny_llama("qwen2", kv=2, tied=True, seed=seed), cfg)
    return randomise_lora_b(model, seed + 7)


def steps_data(n: int = 2) -> list[list]:
    return [batches(2, 2, SEQ, VOCAB, seed=20 + i) for i in range(n)]


def lora_block() -> dict:
    return {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS}


def _rank(rank: int, tp: int, pp: int, out: str) -> dict:
    return train_and_export_lora(peft_model(), ds_config(tp=tp, pp=pp, lr=LR, seq=SEQ, lora=lora_block()),
                                 steps_data(), out)


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_lora_equals_peft(tp: int, pp: int, tmp_path) -> None:
    from peft import PeftModel
    from transformers import Qwen2ForCausalLM

    want, trained = hf_reference(peft_model(), steps_data(), lr=LR)
    results = run_ranks(_rank, tp * pp, tp, pp, str(tmp_path), timeout=600)
    assert all(r["frozen_grads"] == [] and r["frozen_in_opt"] == [] for r in results)
    assert results[0]["losses"] == pytest.approx(want, abs=2e-5)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    base = tiny_llama("qwen2", kv=2, tied=True)  # peft_model()'s base weights
    with torch.no_grad():
        ref = trained.eval()(input_ids=ids).logits
        assert (base(input_ids=ids).logits - ref).abs().max() > 1e-3  # the adapter matters
        loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        merged = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        assert (loaded(input_ids=ids).logits - ref).abs().max() < 1e-4
        assert (merged(input_ids=ids).logits - ref).abs().max() < 1e-4


def test_refusals_at_config_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on k_proj/v_proj where TP does not divide the KV heads, a schedule not tested with the
    family (a user's registered one), an MLP that TP does not split evenly (also of an inline shape),
    inline shapes mixing the families' fields, GPT-2 LoRA names: one line naming the key, before any
    collective."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    from ds_mp.config import ConfigError, load_config
    from ds_mp.schedules.registry import SCHEDULES

    hf = tiny_llama("qwen2", kv=2, inner=204).config.to_dict()  # 204: TP=3 splits the MLP
    cfg = ds_config(tp=3, lr=LR, seq=SEQ, lora=lora_block())
    with pytest.raises(ConfigError, match=r"k_proj/v_proj.*tensor_parallel.size=3.*2 key/value heads"):
        load_config(cfg, 3, hf)
    load_config(ds_config(tp=3, lr=LR, seq=SEQ, lora={**lora_block(), "target_modules": ["q_proj", "down_proj"]}),
                3, hf)
    monkeypatch.setitem(SCHEDULES, "mine", TrainSchedule)
    with pytest.raises(ConfigError, match=r"'mine' is not tested with qwen2.*1f1b, gpipe, terapipe, zb-h1, ouroboros"):
        load_config(ds_config(tp=1, pp=1, seq=SEQ, schedule="mine"), 1, hf)
    with pytest.raises(ConfigError, match=r"does not divide intermediate_size=200"):
        load_config(ds_config(tp=3, seq=SEQ), 3, tiny_llama("qwen2", kv=2).config.to_dict())
    inline = {"model_type": "qwen2", "n_layer": 2, "n_embd": 96, "n_head": 6, "intermediate_size": 200}
    with pytest.raises(ConfigError, match=r"does not divide intermediate_size=200"):  # an inline shape's family checks
        load_config(ds_config(tp=3, seq=SEQ, model=inline), 3)
    with pytest.raises(ConfigError, match=r"ds_mp.model.n_kv_head: 4 does not divide n_head=6"):
        load_config(ds_config(tp=1, seq=SEQ, model={**inline, "n_kv_head": 4}), 1)
    with pytest.raises(ConfigError, match=r"ds_mp.model.model_type: n_kv_head.*set model_type to llama"):
        load_config(ds_config(tp=1, seq=SEQ, model={"n_layer": 2, "n_kv_head": 2}), 1)
    with pytest.raises(ConfigError, match=r"ds_mp.model.model_type: 'bert' is not one of gpt2, llama"):
        load_config(ds_config(tp=1, seq=SEQ, model={"model_type": "bert"}), 1)
    with pytest.raises(ConfigError, match=r"target_modules.*c_attn.*q_proj"):
        load_config(ds_config(tp=1, seq=SEQ, lora={**lora_block(), "target_modules": ["c_attn"]}), 1, hf)
