"""LoRA on ds_mp's TP layers equals PEFT's own LoRA on the single-process HF GPT-2.

The oracle: ``peft.get_peft_model`` on the same ``GPT2LMHeadModel`` (``fan_in_fan_out=True`` for
GPT-2's Conv1D), with its B factors randomised (PEFT inits B = 0, which would leave A's
gradient zero in step 1) and handed to ``ds_mp.initialize`` as the model; both take the same
SGD steps (dropout 0).  Checked at TP=2, PP=2 and TP=2×PP=2: per-step losses, frozen base
(no gradient, no optimizer state), and the exported adapter loaded by
``PeftModel.from_pretrained`` (and the merged HF export) giving the reference's logits.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, hf_reference, randomise_lora_b, tiny_gpt2

VOCAB, SEQ, R, ALPHA, LR = 203, 16, 4, 8.0, 0.05
TARGETS = ["c_attn", "c_proj", "c_fc"]


def peft_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    base = tiny_gpt2(seed=seed, n_layer=4, n_embd=48, n_head=4, vocab=VOCAB)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, fan_in_fan_out=True,
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    return randomise_lora_b(model, seed + 7)


def steps_data(n: int = 3) -> list[list]:
    return [batches(2, 2, SEQ, VOCAB, seed=10 + i) for i in range(n)]


def lora_block() -> dict:
    return {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS}


def train_and_export_lora(model, config: dict, steps: list, out: str) -> dict:
    """Train a PEFT ``model`` under ``config`` (a ds_mp ``lora`` block), then export its adapter
    (``out/adapter``) and the merged model (``out/merged``): per-step losses, and the frozen
    parameters that got a gradient or sit in the optimizer (both must be empty)."""
    import ds_mp

    engine, *_ = ds_mp.initialize(model=model, config=config)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps]
    frozen_grads = [n for n, p in engine.module.named_parameters() if not p.requires_grad and p.grad is not None]
    opt_params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    frozen_in_opt = [n for n, p in engine.module.named_parameters() if not p.requires_grad and id(p) in opt_params]
    ds_mp.save_lora(engine, out + "/adapter")
    ds_mp.save_lora(engine, out + "/merged", merge=True)
    return {"losses": losses, "frozen_grads": frozen_grads, "frozen_in_opt": frozen_in_opt}


def _rank(rank: int, tp: int, pp: int, out: str) -> dict:
    return train_and_export_lora(peft_model(), ds_config(tp=tp, pp=pp, lr=LR, seq=SEQ, lora=lora_block()),
                                 steps_data(), out)


@pytest.fixture(scope="module")
def reference() -> dict:
    model = peft_model()
    losses, trained = hf_reference(model, steps_data(), lr=LR)
    return {"losses": losses, "model": trained.eval()}


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_lora_equals_peft(tp, pp, reference, tmp_path):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    results = run_ranks(_rank, tp * pp, tp, pp, str(tmp_path), timeout=240)
    for r in results:
        assert r["frozen_grads"] == [] and r["frozen_in_opt"] == []
    assert results[0]["losses"] == pytest.approx(reference["losses"], abs=2e-5)
    assert reference["losses"][-1] < reference["losses"][0]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    base = tiny_gpt2(seed=0, n_layer=4, n_embd=48, n_head=4, vocab=VOCAB)  # peft_model()'s base weights
    with torch.no_grad():
        want = reference["model"](input_ids=ids).logits
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapter matters
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - want).abs().max() < 1e-4
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-4


def _checkpointed_rank(rank: int, pp: int, interval: int) -> list[float]:
    import ds_mp

    config = ds_config(pp=pp, lr=LR, seq=SEQ, lora=lora_block(), pipeline={"activation_checkpoint_interval": interval})
    engine, *_ = ds_mp.initialize(model=peft_model(), config=config)
    return [float(engine.train_batch(iter(mbs))) for mbs in steps_data()]


@pytest.mark.parametrize("pp, interval", [(1, 1), (2, 2)], ids=["pp1-every-layer", "pp2-every-2"])
def test_lora_with_activation_checkpointing_equals_peft(pp, interval, reference):
    """The frozen embedding feeds DeepSpeed's reentrant checkpoint an input without a gradient:
    without ``inputs_carry_grad`` the adapters inside the checkpointed blocks trained nothing (a crash
    at the first backward)."""
    losses = run_ranks(_checkpointed_rank, pp, pp, interval, timeout=240)[0]
    assert losses == pytest.approx(reference["losses"], abs=2e-5)


def _loop_rank(rank: int, config_path: str, *extra: str) -> int:
    from ds_mp.training import loop

    return loop.main(["--deepspeed_config", config_path, *extra])


def test_training_loop_with_lora_checkpoints_resume_and_exports(tmp_path):
    """launch/finetune.py's loop on 2 ranks (TP=2) with ds_mp.lora (LoRA dropout on): trains 4 steps,
    checkpoints, writes <out>/adapter (PEFT) and <out>/hf (merged) that agree; ``--resume`` from the
    step-2 checkpoint (base, factors, Adam state of the factors, data position, RNG) repeats steps
    3–4 exactly."""
    import json
    import os
    import shutil

    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    from ds_mp.checkpoint import CheckpointError, ShardedReader, ds_to_hf
    from launcher_utils import read_log, tiny_dataset, train_config

    data = tiny_dataset(str(tmp_path))
    base_dir = str(tmp_path / "base")
    tiny_gpt2(seed=0, n_layer=2, n_embd=32, n_head=4, vocab=512).save_pretrained(base_dir)
    lora = {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["c_attn", "c_proj"]}
    cfg = train_config(str(tmp_path), data, tp=2, pp=1, steps=4, lr=1e-2, model=base_dir, lora=lora)
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert run_ranks(_loop_rank, 2, path, timeout=240) == [0, 0]
    out = tmp_path / "run"
    uninterrupted = [r["loss"] for r in read_log(str(out))]
    reader = ShardedReader(str(out / "checkpoints" / "step2"))
    assert reader.lora == {"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_proj"]}
    factor = "transformer.h.1.attn.c_attn.lora_B"  # saved as 2 qkv shards, read at TP=1: layout-free
    assert reader.get(factor).shape == (4, 96) and reader.get(factor).abs().max() > 0
    assert torch.equal(reader.get_shard(factor, "qkv", 0, 1, n_head=4), reader.get(factor))
    assert set(reader.get_state(factor)) == {"exp_avg", "exp_avg_sq", "step"}  # AdamW state of the factors
    assert reader.state_keys.get("transformer.h.1.attn.c_attn.weight") is None  # frozen base: no state
    with pytest.raises(CheckpointError, match="LoRA run's training checkpoint"):  # not the base alone
        ds_to_hf(reader.path, str(tmp_path / "base_only"))
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step2", resumed / "checkpoints" / "step2")
    (resumed / "checkpoints" / "latest").write_text("step2\n")
    cfg["ds_mp"]["training"].update(output_dir=str(resumed), export_hf=False)
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert run_ranks(_loop_rank, 2, path, "--resume", timeout=240) == [0, 0]
    rows = read_log(str(resumed))
    assert [int(r["step"]) for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == uninterrupted[2:]  # printed with 6 decimals: exact to fp32 print
    adapter = json.load(open(out / "adapter" / "adapter_config.json"))
    assert adapter["r"] == 4 and adapter["fan_in_fan_out"] and adapter["base_model_name_or_path"] == base_dir
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    base = GPT2LMHeadModel.from_pretrained(base_dir).eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
        merged = GPT2LMHeadModel.from_pretrained(str(out / "hf")).eval()(input_ids=ids).logits
        peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(input_ids=ids).logits
    assert (merged - peft).abs().max() < 1e-4 and (merged - before).abs().max() > 1e-4
    assert os.path.isfile(out / "hf" / "tokenizer.json")
