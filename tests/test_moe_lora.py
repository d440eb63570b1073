"""LoRA on a mixture of experts' fused expert tensors (PEFT's ``target_parameters``) against PEFT itself.

The oracle: ``peft.get_peft_model`` on the unmodified HF Qwen3-MoE (4 experts, top-2, 3 layers, layer 1
dense) with ``LoraConfig(target_modules=[q, k, v, o], target_parameters=[mlp.experts.gate_up_proj,
mlp.experts.down_proj])`` (PEFT's ``ParamWrapper``: ``W_e + s · B_e A_e`` per expert), its B factors
drawn (PEFT inits B = 0, which leaves A's gradient zero in step 1), trained on one process with SGD and
clipping (``test_moe_pp_models.hf_oracle``: padded rows with an attention mask, the aux loss as TRL's
SFTTrainer weighs it, routing margins asserted).  ds_mp trains the same PeftModel (``ds_mp.lora`` with
``target_parameters``) at TP1, TP2 ``whole``, TP2 ``split``, PP2 and TP2 × PP2 (ZeRO-1 in two; and a
Mixtral, every layer sparse, at TP2 ``split``): losses,
pre-clip grad norms and every factor after 3 steps within 1e-5 relative, the base weights unchanged bit
for bit, the first micro-batch's routing as HF's.

Checkpoints: the adapter ``save_lora`` writes loads in ``PeftModel.from_pretrained`` (with its
``target_parameters``) with the trained PeftModel's logits, and the merged export in ``from_pretrained``;
a training checkpoint saved at TP2 ``whole`` resumes at TP2 ``split``, and that one at TP1, with PEFT's
uninterrupted losses.  ``ds_mp.hf.Trainer`` given the PeftModel equals the plain Trainer.  Refusals:
LoRA dropout with ``target_parameters``, a name that is not a fused expert tensor, ``target_parameters``
on a dense family.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config
from test_moe_pp_models import CLIP, LR, RTOL, hf_oracle, ranks_agree, steps, tiny_moe4

R, ALPHA, SEQ, VOCAB = 4, 8.0, 16, 1003
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_moe(aux: bool = True, seed: int = 0, vocab: int = VOCAB, model_type: str = "qwen3_moe") -> Any:
    """test_moe_pp_models' model at 3 layers and 4 experts (Qwen3-MoE / Qwen2-MoE: layer 1 dense, no expert
    factors there; Mixtral: every layer sparse)."""
    return tiny_moe4(model_type, seed, vocab, aux, layers=3, experts=4)


def peft_moe(aux: bool = True, targets: list | None = None, model_type: str = "qwen3_moe") -> Any:
    from peft import LoraConfig, get_peft_model

    from helpers import randomise_lora_b

    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION,
                     target_parameters=targets or EXPERTS)
    return randomise_lora_b(get_peft_model(tiny_moe(aux, model_type=model_type), cfg), 7)


def lora_block(targets: list | None = None) -> dict:
    return {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": ATTENTION,
            "target_parameters": targets or EXPERTS}


def ds_names(peft_model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (by ``peft_model``'s names) by ds_mp's names and layout (expert factors (E, r, in), (E, out, r))."""
    from ds_mp.models.weights import peft_to_hf_names

    return peft_to_hf_names(tensors, {n: m.parameter_name for n, m in peft_model.named_modules()
                                      if hasattr(m, "parameter_name")})


CASES = {  # (TP, PP, expert layout, aux loss, ZeRO stage); Qwen3-MoE unless named
    "tp1": (1, 1, "whole", True, 0),
    "tp2_whole_zero1": (2, 1, "whole", False, 1),
    "tp2_split": (2, 1, "split", True, 0),
    "pp2": (1, 2, "whole", True, 0),
    "tp2_pp2_split_zero1": (2, 2, "split", False, 1),
    "mixtral_tp2_split": (2, 1, "split", True, 0),
    "qwen2_moe_tp2_whole": (2, 1, "whole", True, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expert_lora_trains_as_peft(name: str) -> None:
    from test_moe_pp_models import _rank

    tp, pp, layout, aux, zero = CASES[name]
    model_type = next((t for t in ("mixtral", "qwen2_moe") if name.startswith(t)), "qwen3_moe")
    model = peft_moe(aux, model_type=model_type)
    sparse = [0, 1, 2] if model_type == "mixtral" else [0, 2]
    data = steps(2)
    want_losses, want_norms, trained, want_routes = hf_oracle(model, data)
    want = ds_names(model, trained)
    base = ds_names(model, dict(model.named_parameters()))
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, lora=lora_block(), zero=zero,
                    moe={"expert_layout": layout})
    out = run_ranks(_rank, tp * pp, model, data, cfg, timeout=600)
    got, routes = ranks_agree(out, want_losses, want_norms, name)
    assert sorted(routes) == sparse and all(torch.equal(routes[i], r) for i, r in zip(sparse, want_routes)), name
    assert set(got) == set(want), set(got) ^ set(want)
    for n, w in want.items():
        if ".lora_" in n:
            assert float((got[n] - w).abs().max()) <= RTOL * float(w.abs().max()), (name, n)
            assert not torch.equal(w, base[n]), n  # every factor trained
        else:
            assert torch.equal(got[n], base[n]), (name, n)  # the base frozen


# --- the adapter and the merged export -------------------------------------------------------------------
def _export_rank(rank: int, model: Any, data: list, cfg: dict, out: str) -> dict:
    from test_lora import train_and_export_lora

    return train_and_export_lora(model, cfg, data, out)


@pytest.mark.parametrize("tp, layout, targets", [(2, "split", EXPERTS), (1, "whole", ["down_proj"])],
                         ids=["tp2_split", "tp1_down_only"])
def test_adapter_and_merged_export(tp: int, layout: str, targets: list, tmp_path: Any) -> None:
    """``save_lora``'s adapter loads in ``PeftModel.from_pretrained`` (PEFT nests one ParamWrapper per targeted
    tensor: with both, gate_up's is ``experts.base_layer``; alone, each is ``experts``) with the trained
    PeftModel's logits; the merged export loads in ``from_pretrained`` with them too, and generates."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, data = peft_moe(aux=True, targets=targets), steps(2)
    want_losses, _, trained, _ = hf_oracle(model, data)
    ref = copy.deepcopy(model)
    ref.load_state_dict(trained, strict=False)
    cfg = ds_config(tp=tp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, lora=lora_block(targets),
                    moe={"expert_layout": layout})
    got = run_ranks(_export_rank, tp, model, data, cfg, str(tmp_path), timeout=600)
    assert all(r["frozen_grads"] == [] and r["frozen_in_opt"] == [] for r in got)
    assert got[0]["losses"] == pytest.approx(want_losses, rel=RTOL)
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["target_parameters"] == targets
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref.eval()(input_ids=ids).logits
        assert float((tiny_moe()(input_ids=ids).logits - want).abs().max()) > 1e-3  # the adapter matters
        loaded = PeftModel.from_pretrained(tiny_moe(), str(tmp_path / "adapter")).eval()
        assert float((loaded(input_ids=ids).logits - want).abs().max()) < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        assert float((merged(input_ids=ids).logits - want).abs().max()) < 1e-4
    assert merged.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


# --- a training checkpoint resumed at another layout -------------------------------------------------------
def peft_momentum_oracle(model: Any, data: list) -> list[float]:
    """``test_moe_pp_models.hf_oracle``'s steps with SGD momentum 0.9 (the optimizer state crosses the
    checkpoints too): the uninterrupted run's losses."""
    from helpers import targets
    from test_moe_pp_models import COEF, hf_micro_batch

    model = copy.deepcopy(model).train()
    opt, losses = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), []
    for mbs in data:
        opt.zero_grad()
        count, total = sum(targets(mb["labels"]) for mb in mbs), 0.0
        for mb in mbs:
            lm, aux, _ = hf_micro_batch(model, mb, [])
            loss = lm * (targets(mb["labels"]) / count) + COEF * aux / len(mbs)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total)
    return losses


def _resume_rank(rank: int, model: Any, tp: int, layout: str, data: list, root: str, load: bool) -> list[float]:
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    cfg = ds_config(tp=tp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, lora=lora_block(), moe={"expert_layout": layout})
    cfg["optimizer"]["params"]["momentum"] = 0.9
    engine, *_ = ds_mp.initialize(model=model, config=cfg)
    if load:
        load_checkpoint(engine, root)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in data]
    save_checkpoint(engine, root, f"{layout}{tp}")
    return losses


def test_resume_at_another_layout(tmp_path: Any) -> None:
    """One SGD-momentum step at TP2 ``whole``, checkpoint; resumed at TP2 ``split`` (the factors and their
    momenta re-cut: B of gate_up by rows, A of down by columns, the others whole), one step, checkpoint;
    resumed at TP1, one step: PEFT's uninterrupted losses."""
    model, data, root = peft_moe(), steps(2, n=3), str(tmp_path / "ckpt")
    want = peft_momentum_oracle(model, data)
    for i, (tp, layout) in enumerate([(2, "whole"), (2, "split"), (1, "whole")]):
        got = run_ranks(_resume_rank, tp, model, tp, layout, data[i:i + 1], root, i > 0, timeout=600)[0]
        assert got == pytest.approx(want[i:i + 1], rel=RTOL), (tp, layout)


# --- refusals -----------------------------------------------------------------------------------------------
def test_refused_in_one_line() -> None:
    """LoRA dropout with ``target_parameters`` (PEFT's ParamWrapper refuses it: the update is folded into
    W_e), a name that is not a fused expert tensor, ``target_parameters`` on a dense family; from a PEFT
    ``LoraConfig`` (the SFTTrainer's ``peft_config``) the same dropout and DoRA, before any model is built, and
    PEFT's own conversion of gate/up/down on a MoE (a rank_pattern) with the explicit form to use instead."""
    from peft import LoraConfig

    from ds_mp.config import ConfigError, load_config
    from ds_mp.hf.lora import lora_block as peft_block
    from helpers import tiny_qwen3

    def refused(match: str, lora: dict, hf: Any = None) -> None:
        with pytest.raises(ConfigError, match=match) as e:
            load_config(ds_config(lora=lora), 1, (hf or tiny_moe()).config.to_dict())
        assert "\n" not in str(e.value)

    refused(r"^ds_mp.lora.dropout: 0.1 with target_parameters .*set dropout to 0", {**lora_block(), "dropout": 0.1})
    refused(r"^ds_mp.lora.target_parameters: \['mlp.gate.weight'\] not qwen3_moe fused parameter names; choose from",
            {**lora_block(), "target_parameters": ["mlp.gate.weight"]})
    refused(r"^ds_mp.lora.target_parameters: .* not qwen3 fused parameter names; it has none", lora_block(),
            tiny_qwen3())
    load_config(ds_config(lora={**lora_block(["gate_up_proj"]), "target_modules": []}), 1, tiny_moe().config.to_dict())
    assert peft_block(LoraConfig(r=R, target_parameters=EXPERTS))["target_modules"] == []
    for bad, match in [({"lora_dropout": 0.1}, r"lora_dropout=0.1 with target_parameters"),
                       ({"use_dora": True}, r"use_dora=True")]:
        with pytest.raises(ConfigError, match=r"^peft_config: " + match) as e:
            peft_block(LoraConfig(r=R, target_modules=ATTENTION, target_parameters=EXPERTS, **bad))
        assert "\n" not in str(e.value)
    # PEFT 0.22 turns the usual MLP targets of a MoE into the fused tensors, gate_up_proj at rank 2r: named
    from peft import get_peft_model

    converted = get_peft_model(tiny_moe(), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ATTENTION + [
        "gate_proj", "up_proj", "down_proj"])).peft_config["default"]
    assert converted.rank_pattern, "PEFT no longer converts gate/up/down of a MoE with a rank_pattern"
    with pytest.raises(ConfigError, match=r"^peft_config: rank_pattern=.*gate_up_proj.* name the experts yourself, "
                                          r"e.g. LoraConfig\(target_modules=") as e:
        peft_block(converted)
    assert "\n" not in str(e.value)


# --- ds_mp.hf.Trainer given the PeftModel -------------------------------------------------------------------
def _trainer_run(out: str, ds: dict | None) -> dict:
    """3 SGD steps of the Trainer (test_hf_trainer's padded rows, clipping) on :func:`peft_moe` (aux loss on:
    HF's Trainer adds each forward's coef · aux, ds_mp's engine matches it), then ``save_model``."""
    import os

    from transformers import Trainer as PlainTrainer

    from ds_mp.hf import Trainer
    from test_hf_peft import _lora_state
    from test_hf_trainer import collate, rows, training_args

    cls = PlainTrainer if ds is None else Trainer
    trainer = cls(model=peft_moe(), args=training_args(out, ds, max_steps=3, optim="sgd", learning_rate=0.1),
                  train_dataset=rows(24), data_collator=collate)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "model": _lora_state(trainer.model), "dir": os.path.join(out, "final")}


def _trainer_rank(rank: int, out: str, ds: dict) -> dict:
    return _trainer_run(out, ds)


def test_trainer_trains_the_peft_models_expert_adapter(tmp_path: Any) -> None:
    """``ds_mp.hf.Trainer(model=<PeftModel with target_parameters>)`` at TP2 ``split``: the plain Trainer's
    losses, the adapter ``save_model`` writes equal to PEFT's own (its ParamWrapper names), and
    ``trainer.model`` holding the trained factors over the unchanged base, on every rank."""
    from test_hf_peft import _lora_state, _same_adapter
    from test_hf_trainer import ds_json

    initial = _lora_state(peft_moe())
    ref = _trainer_run(str(tmp_path / "plain"), None)
    got = run_ranks(_trainer_rank, 2, str(tmp_path / "ds_mp"), ds_json(tp=2, moe={"expert_layout": "split"}),
                    timeout=900)
    assert len(ref["losses"]) == 3 and got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert any("experts.base_layer.lora_B" in k and not torch.equal(v, initial[k]) for k, v in ref["model"].items())
    for res in got:
        _same_adapter(res, ref, initial)


def _sft_run(out: str, model_dir: str, ds: dict | None) -> dict:
    """3 SGD steps of TRL's SFT on raw chats (test_hf_peft's), the model named by path and
    ``peft_config=LoraConfig(target_modules=attention, target_parameters=experts)``: PEFT wraps it as TRL does."""
    import os

    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from ds_mp.hf import SFTTrainer
    from test_hf_peft import SFT_ARGS, _lora_state
    from test_hf_sft import trl_sft_script

    cls = trl.SFTTrainer if ds is None else SFTTrainer
    chats = Dataset.from_list(trl_sft_script().tiny_chats(40))
    peft_config = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION,
                             target_parameters=EXPERTS)
    trainer = cls(model=model_dir, args=trl.SFTConfig(output_dir=out, deepspeed=ds, **SFT_ARGS),
                  train_dataset=chats.select(range(32)), processing_class=AutoTokenizer.from_pretrained(model_dir),
                  peft_config=peft_config)
    initial = _lora_state(trainer.model)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "model": _lora_state(trainer.model), "initial": initial, "dir": os.path.join(out, "final")}


def _sft_rank(rank: int, *args: Any) -> dict:
    return _sft_run(*args)


def test_sft_trainer_with_expert_peft_config_equals_plain_trl(tmp_path: Any) -> None:
    """``ds_mp.hf.SFTTrainer(model=<dir>, peft_config=LoraConfig(..., target_parameters=experts))`` at TP2
    ``whole`` (aux loss on): TRL's initial factors, plain TRL's losses, adapter and ``trainer.model``."""
    from test_hf_peft import _same_adapter
    from test_hf_sft import trl_sft_script
    from test_hf_trainer import ds_json

    tokenizer = trl_sft_script().tiny_tokenizer()
    model_dir = str(tmp_path / "model")
    tiny_moe(vocab=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    ref = _sft_run(str(tmp_path / "plain"), model_dir, None)
    cfg = ds_json(tp=2)
    del cfg["ds_mp"]["data"]  # seq_len from max_length, as TRL's scripts leave it
    got = run_ranks(_sft_rank, 2, str(tmp_path / "ds_mp"), model_dir, cfg, timeout=900)
    assert len(ref["losses"]) == 3 and got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for k, v in ref["initial"].items():
        assert torch.equal(got[0]["initial"][k], v), k  # the same PEFT model (TRL's seed, TRL's load)
    for res in got:
        _same_adapter(res, ref, ref["initial"])
