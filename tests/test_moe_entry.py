"""A mixture of experts from the launcher: ``launch/finetune.py --model <Qwen3-MoE dir>`` (in-process
ranks, ``train_in_process``; the directory is what transformers' ``save_pretrained`` writes, the Hub's
per-expert keys) with HF's aux loss on, at TP = 2 with ``whole`` experts on 2 ranks, logs the losses
(training and evaluation) of the same JSON at TP = 1 on one process, and its exported model loads in
``from_pretrained`` and generates.  Exactness of each layout against HF's model is tests/test_moe.py's
and tests/test_moe_pp_models.py's; this checks the launcher's path (config, weight reading, the aux
loss in the logged loss, export) end to end; PP = 2 (the aux loss's router sums crossing the stages) logs the
same losses too."""
from __future__ import annotations

import os
from typing import Any

import torch

from launcher_utils import read_log, tiny_dataset, train_in_process


def _moe_dir(tmp: str, data: str, aux: bool = True) -> str:
    import transformers
    from transformers import AutoTokenizer

    from ds_mp.data import DatasetInfo

    tok = AutoTokenizer.from_pretrained(DatasetInfo.load(data).tokenizer_dir)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, vocab_size=len(tok), max_position_embeddings=64, tie_word_embeddings=False,
        output_router_logits=aux, router_aux_loss_coef=0.1, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id)
    path = os.path.join(tmp, "qwen3_moe" if aux else "qwen3_moe_no_aux")
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _config(out: str, tp: int, pp: int = 1) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "gradient_clipping": 1.0, "steps_per_print": 10**6,
            "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp},
                      "moe": {"expert_layout": "whole"}, "data": {"seq_len": 32},
                      "training": {"steps": 3, "log_interval": 1, "eval_interval": 3, "eval_batches": 1,
                                   "checkpoint_interval": 0, "output_dir": out}}}


def test_launcher_finetunes_qwen3_moe_at_tp2_and_pp2_as_at_tp1(tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    tmp = str(tmp_path)
    data = tiny_dataset(tmp)
    model = _moe_dir(tmp, data)
    logs = {}
    for name, tp, pp, path in (("tp1", 1, 1, model), ("tp2", 2, 1, model), ("pp2", 1, 2, model),
                               ("no_aux", 1, 1, _moe_dir(tmp, data, aux=False))):
        out = os.path.join(tmp, name)
        os.makedirs(out)
        train_in_process(out, _config(out, tp, pp), n=tp * pp, args=("--model", path, "--data", data), timeout=400)
        logs[name] = read_log(out)
    assert len(logs["tp1"]) == 3 and logs["tp1"][-1].get("val_loss"), logs["tp1"]
    # the same weights without output_router_logits: the logged loss lacks the aux term (0.1 × aux > 0)
    assert float(logs["tp1"][0]["loss"]) - float(logs["no_aux"][0]["loss"]) > 1e-3, logs
    for key in ("loss", "val_loss"):
        one = [float(r[key]) for r in logs["tp1"] if r.get(key)]
        for other in ("tp2", "pp2"):  # PP2: the aux loss's router sums cross the stage boundary (the carry)
            two = [float(r[key]) for r in logs[other] if r.get(key)]
            assert one and len(one) == len(two), (key, other, logs)
            assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(one, two)), (key, other, one, two)
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "tp2", "hf"))
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([[1, 2, 3]])
    assert exported.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_launcher_trains_expert_lora_and_exports_peft_adapter(tmp_path: Any) -> None:
    """``"lora"`` with ``target_parameters`` through the launcher at TP2 ``split``: the PEFT adapter it
    writes loads in ``PeftModel.from_pretrained`` over the base model and gives the merged export's logits,
    and its expert factors trained (B starts at zero)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp = str(tmp_path)
    data = tiny_dataset(tmp)
    model = _moe_dir(tmp, data)
    out = os.path.join(tmp, "lora")
    os.makedirs(out)
    cfg = _config(out, 2)
    cfg["ds_mp"]["moe"] = {"expert_layout": "split"}
    cfg["ds_mp"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    train_in_process(out, cfg, n=2, args=("--model", model, "--data", data), timeout=400)
    adapter = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    experts_b = [v for k, v in adapter.items() if ".experts." in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(float(v.abs().max()) > 0 for v in experts_b), sorted(adapter)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), os.path.join(out, "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).eval()
    with torch.no_grad():
        want, got = peft(ids).logits, merged(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert merged.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 9)
