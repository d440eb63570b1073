"""The training recipe around the engine: gradient noise scale, fp16 / skipped-step
accounting, validation perplexity in the log, ``ds-mp eval`` on ds_mp checkpoints,
``ds-mp lr-find``, and the shipped Megatron recipe (LAMB, warm-up + cosine LR).

Multi-rank parts run as spawned CPU ranks over gloo (``dist_utils.run_ranks``).
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, hf_reference, tiny_gpt2
from launcher_utils import REPO, tiny_dataset, train_config
from ds_mp.training.metrics import NoiseScaleEstimator, gradient_sq_estimate, trace_estimate

RECIPE = os.path.join(REPO, "ds_configs", "megatron_recipe.json")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("recipe")))


# ----------------------------------------------------------------------------- noise scale
def test_noise_scale_estimates_by_hand():
    # |G|² = 4, tr(Σ) = 12: E|G_B|² = 4 + 12/B -> B=2: 10, B=8: 5.5
    assert gradient_sq_estimate(10.0, 5.5, 2, 8) == pytest.approx(4.0)   # (8·5.5 − 2·10)/6
    assert trace_estimate(10.0, 5.5, 2, 8) == pytest.approx(12.0)        # 4.5/(1/2 − 1/8)
    est = NoiseScaleEstimator(beta=0.5)
    assert est.value is None and est.gradient_sq is None
    assert est.update(10.0, 5.5, 2, 8) == pytest.approx(3.0)             # first value = 12/4
    # second measurement |G|² = 2, tr(Σ) = 16 (B=2: 10, B=8: 4). Raw EMAs from 0:
    # |G|²: 0.5·(0.5·4) + 0.5·2 = 2,  tr(Σ): 0.5·(0.5·12) + 0.5·16 = 11;  bias correction 1 − 0.5² = 0.75
    assert est.update(10.0, 4.0, 2, 8) == pytest.approx(11.0 / 2.0)
    assert est.gradient_sq == pytest.approx(2.0 / 0.75) and est.trace == pytest.approx(11.0 / 0.75)
    assert est.update(float("inf"), 4.0, 2, 8) == pytest.approx(5.5)     # an overflow step is ignored
    assert est.updates == 2
    noisy = NoiseScaleEstimator()
    assert noisy.update(1.0, 1.2, 2, 8) is None                          # negative tr(Σ): undefined
    with pytest.raises(ValueError, match="b_small < b_big"):
        gradient_sq_estimate(1.0, 1.0, 4, 4)


@pytest.mark.parametrize("model", ["gpt2", "qwen2_gqa_untied", "llama_kv_replicated_tied"])
def test_logged_flops_equal_torchs_count_of_the_hf_model(model: str) -> None:
    """The FLOPs per step logged as ``tflops`` (:func:`decoder_flops`) equal torch's
    ``FlopCounterMode`` over forward + backward of the unmodified HF model (eager attention, whose
    score matmuls it counts) and, for GPT-2, Megatron-LM's closed form."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_mp.training.metrics import decoder_flops
    from test_llama import tiny_llama

    hf = {"gpt2": lambda: tiny_gpt2(),
          "qwen2_gqa_untied": lambda: tiny_llama("qwen2", kv=2, hidden=72, inner=128),
          "llama_kv_replicated_tied": lambda: tiny_llama("llama", kv=3, tied=True, n_layer=3)}[model]()
    hf.config._attn_implementation = "eager"
    B, s = 2, 16
    with FlopCounterMode(display=False) as counted:
        hf(input_ids=torch.randint(0, hf.config.vocab_size, (B, s))).logits.sum().backward()
    assert decoder_flops(hf.config, s, B) == counted.get_total_flops()
    if model == "gpt2":
        c = hf.config
        h, l, V = c.n_embd, c.n_layer, c.vocab_size
        assert decoder_flops(c, s, B) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))


def test_noise_scale_interval_config():
    from ds_mp.config import ConfigError, load_config

    base = ds_config(training={"noise_scale_interval": 5})
    assert load_config(base, world_size=2)[0].training.noise_scale_interval == 5
    with pytest.raises(ConfigError, match=r"noise_scale_interval: must be >= 0, got -1"):
        load_config(ds_config(training={"noise_scale_interval": -1}), world_size=2)
    for extra in ({"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 1}}):  # measured: test_batch_ramp
        load_config({**base, **extra}, world_size=2)
    with pytest.raises(ConfigError, match="noise_scale_interval: the noise scale is measured in fp32 or bf16 at ZeRO 0/1"):
        load_config({**base, "zero_optimization": {"stage": 2}}, world_size=2)


def _probe_rank(rank: int, micro: int, gas: int, seq: int) -> dict:
    import ds_mp

    vocab = 203
    cfg = ds_config(micro=micro, gas=gas, seq=seq, lr=0.0, training={"noise_scale_interval": 1})
    from ds_mp.training.metrics import NoiseScaleProbe

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=vocab), config=cfg)
    engine.noise_scale = probe = NoiseScaleProbe.from_config(engine.ds_mp_config, engine.topology)
    engine.train_batch(iter(batches(gas, micro, seq, vocab, seed=10 + rank)))
    return {"small": probe.small_sq, "big": probe.big_sq, "value": probe.value}


def test_noise_scale_probe_dp2_equals_single_process_gradients():
    """DP=2: |G_small|² (replica-averaged, before the all-reduce) and |G_big|² equal the
    squared norms of single-process HF gradients over each replica's / both batches."""
    micro, gas, seq, vocab = 2, 2, 16, 203
    got = run_ranks(_probe_rank, 2, micro, gas, seq, timeout=180)
    model = tiny_gpt2(vocab=vocab).train()
    local = []
    for rank in range(2):
        model.zero_grad()
        for ids, labels in batches(gas, micro, seq, vocab, seed=10 + rank):
            (model(input_ids=ids, labels=labels).loss / gas).backward()
        local.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    small = sum(float(g.pow(2).sum()) for g in local) / 2
    big = float(((local[0] + local[1]) / 2).pow(2).sum())
    for r in got:
        assert r["small"] == pytest.approx(small, rel=1e-5) and r["big"] == pytest.approx(big, rel=1e-5)
    b = micro * gas
    want = trace_estimate(small, big, b, 2 * b) / gradient_sq_estimate(small, big, b, 2 * b)
    assert got[0]["value"] == pytest.approx(want, rel=1e-4)


# ----------------------------------------------------------------------------- training-loop log
def _train_rank(rank: int, config_path: str, overflow_at: int) -> None:
    """train.main with DeepSpeed's overflow protocol (``optimizer.overflow``) raised at one step."""
    import ds_mp
    from ds_mp.training import loop as train

    real = ds_mp.initialize

    def initialize(**kw):
        out = real(**kw)
        opt, steps = out[0].optimizer, [0]

        def flag(o, args, kwargs):
            steps[0] += 1
            o.overflow = steps[0] == overflow_at

        opt.register_step_post_hook(flag)
        return out

    ds_mp.initialize = initialize
    assert train.main(["--deepspeed_config", config_path]) == 0


def test_log_counts_deepspeed_skipped_steps_val_ppl_and_noise_scale(tmp_path, data):
    cfg = train_config(str(tmp_path), data, pp=1, steps=4, training={"noise_scale_interval": 1,
                                                                    "checkpoint_interval": 0, "export_hf": False})
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    run_ranks(_train_rank, 2, path, 2, timeout=240)   # DP=2, DeepSpeed "overflow" at step 2
    with open(tmp_path / "run" / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["skipped"]) for r in rows] == [0, 1, 1, 1]
    evals = [r for r in rows if r["val_loss"]]
    assert evals and all(float(r["val_ppl"]) == pytest.approx(math.exp(float(r["val_loss"])), rel=1e-4)
                         for r in evals)
    scales = [float(r["noise_scale"]) for r in rows if r["noise_scale"]]
    assert scales and all(s > 0 for s in scales)


def _fp16_rank(rank: int) -> list[float]:
    import ds_mp

    cfg = ds_config(micro=2, gas=2, seq=16, optimizer="Adam", lr=1e-3)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}   # 2^24 overflows at first
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
    steps = 16
    losses = [float(engine.train_batch(iter(batches(2, 2, 16, 203, seed=s)))) for s in range(steps)]
    assert 1 <= engine.skipped_steps < steps   # the loss scaler backed off, then the model trained
    return losses


def test_fp16_through_the_engine():
    """fp16 with dynamic loss scaling (on every CPU: tests/cpu_fp16.py)."""
    losses = run_ranks(_fp16_rank, 1, timeout=180)[0]
    assert all(math.isfinite(x) for x in losses)


def _fp16_sgd_rank(rank: int, tp: int, pp: int, zero: int) -> list[float]:
    import ds_mp

    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, seq=16, optimizer="SGD", lr=0.5)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}  # 2^8: no overflow on this model
    if zero:
        cfg["zero_optimization"] = {"stage": zero}
        cfg["zero_allow_untested_optimizer"] = True  # DeepSpeed's rule for SGD under ZeRO
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
    losses = [float(engine.train_batch(iter(batches(2, 2, 16, 203, seed=0)))) for _ in range(4)]  # one batch, learnt
    assert engine.skipped_steps == 0
    return losses


@pytest.mark.parametrize("tp, pp, zero", [(1, 1, 0), (1, 1, 1), (2, 2, 0)], ids=["1x1", "1x1-zero1", "tp2xpp2"])
def test_fp16_trains_like_fp32_hf(tp: int, pp: int, zero: int):
    """fp16 follows HF's fp32 SGD trajectory (the outside oracle) within fp16's precision,
    without ZeRO, with ZeRO-1 (whose optimizer scales the loss itself: scaled once, not twice)
    and at TP × PP = 2 × 2 (the last stage's scaled loss sends scaled gradients back).
    DeepSpeed 0.19's ``backward`` leaves the loss unscaled for its non-ZeRO fp16 optimizers,
    which still divide by the scale in ``step``: gradients 2^8 times too small here, and a
    loss that does not move (``deepspeed_compat.unapplied_loss_scale``)."""
    got = run_ranks(_fp16_sgd_rank, tp * pp, tp, pp, zero, timeout=180)[0]  # train_batch: the batch loss on every rank
    want, _ = hf_reference(tiny_gpt2(), [batches(2, 2, 16, 203, seed=0) for _ in range(4)], lr=0.5)
    assert want[0] - want[-1] > 0.2  # the reference moves far more than the tolerance below
    assert got == pytest.approx(want, abs=2e-2), (got, want)


# ----------------------------------------------------------------------------- ds-mp eval
def _eval(capsys, *argv: str) -> dict:
    from ds_mp.tools.evaluate import eval_cli

    assert eval_cli([*argv, "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_on_ds_checkpoint_equals_hf_dir(tmp_path, data, capsys):
    import numpy as np
    from transformers import AutoTokenizer

    from ds_mp.checkpoint import convert_cli
    from ds_mp.data import DatasetInfo

    tok_dir = DatasetInfo.load(data).tokenizer_dir
    hf, ds = str(tmp_path / "hf"), str(tmp_path / "ds")
    tiny_gpt2(vocab=len(AutoTokenizer.from_pretrained(tok_dir))).save_pretrained(hf)
    assert convert_cli(["hf-to-ds", hf, ds, "--tp", "2", "--pp", "2"]) == 0
    np.save(tmp_path / "tokens.npy", np.fromfile(os.path.join(data, "val_tokens.bin"), dtype=np.uint16)[:150])
    common = ["--data", str(tmp_path / "tokens.npy"), "--window", "32", "--stride", "16"]
    a, b = _eval(capsys, "--model", hf, *common), _eval(capsys, "--model", ds, *common)
    assert a["scored_tokens"] == b["scored_tokens"] == 149
    assert b["nll"] == pytest.approx(a["nll"], rel=1e-6)
    text = tmp_path / "text.txt"
    text.write_text("def main(argv):\n    return sorted(set(argv))\n" * 3)
    a = _eval(capsys, "--model", hf, "--tokenizer", tok_dir, "--data", str(text))
    b = _eval(capsys, "--model", ds, "--tokenizer", tok_dir, "--data", str(text))
    assert a["tokens"] == b["tokens"] > 10 and b["ppl"] == pytest.approx(a["ppl"], rel=1e-6)
    from ds_mp.tools.evaluate import eval_cli

    assert eval_cli(["--model", str(tmp_path), "--data", str(text)]) == 2   # neither HF nor ds_mp
    assert "neither an HF directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- ds-mp lr-find
def test_lr_find_cli_writes_csv_png_and_suggests(tmp_path, data, capsys):
    from ds_mp.tools.lr_find import lr_find_cli

    cfg = train_config(str(tmp_path), data, pp=1, micro=2, gas=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "lrf"
    assert lr_find_cli(["--config", str(path), "--steps", "12", "--lr-min", "1e-4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "suggested lr" in printed
    suggested = float(printed.split("suggested lr ")[1].split()[0])
    with open(out / "lr_find.csv") as f:
        rows = list(csv.DictReader(f))
    assert 3 <= len(rows) <= 12 and rows[0]["lr"] and float(rows[0]["lr"]) == pytest.approx(1e-4)
    assert 1e-4 <= suggested <= 1.0
    assert (out / "lr_find.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- Megatron recipe
def test_megatron_recipe_validates_and_builds_lamb_without_decay_on_biases_and_layernorm():
    from transformers import GPT2LMHeadModel

    from ds_mp.config import load_config
    from ds_mp.optim import Lamb
    from ds_mp.engine.optimizer import optimizer_setup
    from ds_mp.models.gpt2 import hf_config_from

    cfg, raw = load_config(RECIPE, world_size=2)   # PP=2
    assert (cfg.tp, cfg.pp, cfg.dp) == (1, 2, 1)
    ds_dict = {k: v for k, v in copy.deepcopy(raw).items() if k != "ds_mp"}
    model = GPT2LMHeadModel(hf_config_from(cfg.shape))
    groups, opt = optimizer_setup(model, ds_dict, None)
    assert isinstance(opt, Lamb) and "optimizer" not in ds_dict   # handed to DeepSpeed as a client optimizer
    assert opt.defaults["lr"] == raw["optimizer"]["params"]["lr"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert all(n.endswith(".bias") or ".ln_" in n for n in plain) and "transformer.ln_f.weight" in plain
    assert not any(n.endswith(".bias") or ".ln_" in n for n in decayed)
    assert "transformer.wte.weight" in decayed and "transformer.h.0.attn.c_attn.weight" in decayed


def _expected_lr(step: int, p: dict, lr: float) -> float:
    """DeepSpeed WarmupCosineLR after ``step`` scheduler steps (its documented formula)."""
    warm = max(2, p["warmup_num_steps"])
    if step < warm:
        frac = (math.log(step + 1) / math.log(warm) if p.get("warmup_type", "log") == "log" else step / warm)
        return lr * (p["warmup_min_ratio"] + frac * (1 - p["warmup_min_ratio"]))
    progress = min(1.0, (step - warm + 1) / max(1, p["total_num_steps"] - warm))
    return lr * (p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * progress)) / 2)


def _schedule_rank(rank: int, chosen: list[int]) -> dict[int, float]:
    import ds_mp

    with open(RECIPE) as f:
        cfg = json.load(f)
    cfg["ds_mp"]["model"] = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 101, "n_positions": 32}
    cfg["ds_mp"]["pipeline"]["stages"] = 1                     # one rank
    cfg["ds_mp"]["data"]["seq_len"] = 16
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 1, 1
    engine, opt, _, sched = ds_mp.initialize(config=cfg)
    assert type(sched).__name__ == "WarmupCosineLR" and type(opt).__name__ == "Lamb"
    seen = {}
    for step in range(1, max(chosen) + 1):
        if step <= 3:   # real optimizer steps drive the scheduler ...
            engine.train_batch(iter(batches(1, 1, 16, 101, seed=step)))
        else:           # ... then step it alone (what train_batch does after the update)
            sched.step()
        if step in chosen:
            seen[step] = engine.get_lr()[0]
    return seen


def test_recipe_warmup_cosine_lr_at_chosen_steps():
    with open(RECIPE) as f:
        raw = json.load(f)
    p, lr = raw["scheduler"]["params"], raw["optimizer"]["params"]["lr"]
    chosen = [1, 3, 15, p["warmup_num_steps"], p["warmup_num_steps"] + 1,
              (p["warmup_num_steps"] + p["total_num_steps"]) // 2, p["total_num_steps"]]
    seen = run_ranks(_schedule_rank, 1, chosen, timeout=180)[0]
    for step in chosen:   # after n optimizer steps the scheduler has stepped n times from -1
        assert seen[step] == pytest.approx(_expected_lr(step - 1, p, lr), rel=1e-9, abs=1e-12), step
    assert seen[p["total_num_steps"]] == pytest.approx(lr * p["cos_min_ratio"])   # floor at the end
    mid = (p["warmup_num_steps"] + p["total_num_steps"]) // 2
    assert seen[mid] == pytest.approx(lr * (p["cos_min_ratio"] + 1) / 2, rel=0.02)  # half-way down the cosine
