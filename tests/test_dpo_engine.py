"""DPO through the engine (``"loss": {"type": "dpo"}``) against plain TRL 1.16 on one process
(``DPOTrainer._compute_loss`` on HF models, SGD, the same pairs and order): the reference log-probs
precomputed on the same engine from the initial weights (``ds_mp.engine.reference.ref_log_probs``;
equal to HF's), step-1 loss ln 2, the losses of 3 steps and TRL's logged reward / log-prob metrics
from the last stage's rows (``engine.step_rows``): GPT-2 at PP 2 (ZB-V: the loss on rank 0; 1F1B
is tests/test_dpo_run.py's launcher run) and DP 2 with accumulation, Qwen2 at TP 2; each DP replica on its own pairs of very uneven lengths (one truncated at max_length);
and with LoRA, the reference pass with the adapters disabled equal to HF's base model (and a
micro-batch of an odd row count refused on every rank)."""
from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_ranks
from dpo_utils import collate, labels_of, pairs, row_logps, trl_loss, trl_models
from helpers import ds_config, tiny_gpt2

V, T, STEPS, MICROS, PAIRS, LR, MAXLEN = 61, 24, 3, 4, 2, 2.0, 24


def model(family: str = "gpt2") -> torch.nn.Module:
    """A tiny GPT-2, or a tiny Qwen2 (q/k/v biases, grouped KV heads, untied head)."""
    if family == "gpt2":
        return tiny_gpt2(n_layer=4, n_embd=32, vocab=V, seed=5)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-5)
    return Qwen2ForCausalLM(cfg).eval()


def stream() -> list[list[dict[str, torch.Tensor]]]:
    """STEPS steps of MICROS micro-batches of PAIRS pairs, padded to T columns; one pair truncated."""
    ex = pairs(STEPS * MICROS * PAIRS, V, seed=2)
    ex[3]["chosen_ids"] = list(range(1, 40))  # cut at MAXLEN (keep_start)
    mbs = [collate(ex[k:k + PAIRS], max_length=MAXLEN, pad_to=T) for k in range(0, len(ex), PAIRS)]
    return [mbs[s * MICROS:(s + 1) * MICROS] for s in range(STEPS)]


def oracle(family: str) -> tuple[list[float], list[dict[str, float]]]:
    """Plain TRL on one process: per step, the mean over the micro-batches of TRL's loss (its
    gradient accumulation), SGD; the metrics TRL logs (the mean over the micro-batches)."""
    policy, ref = trl_models(model(family), model(family))
    opt = torch.optim.SGD(policy.parameters(), lr=LR)
    losses, metrics = [], []
    for step in stream():
        opt.zero_grad()
        outs = [trl_loss(policy, ref, mb, patched=True) for mb in step]
        loss = sum(o[0] for o in outs) / len(outs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        metrics.append({k: sum(o[1][k] for o in outs) / len(outs) for k in outs[0][1]})
    return losses, metrics


def _train(rank: int, layout: dict, family: str) -> tuple[list[float], list[dict[str, float]], float]:
    import ds_mp
    from ds_mp.engine.reference import ref_log_probs
    from ds_mp.losses.dpo import dpo_metrics

    dp = 2 // (layout.get("pp", 1) * layout.get("tp", 1))
    gas = MICROS // dp
    cfg = ds_config(micro=2 * PAIRS, gas=gas, lr=LR, seq=T, loss={"type": "dpo"}, **layout)
    engine, *_ = ds_mp.initialize(model=model(family), config=cfg)
    d = engine.topology.dp_rank
    mine = [[{"input_ids": mb["input_ids"], "labels": labels_of(mb)} for mb in step[d * gas:(d + 1) * gas]]
            for step in stream()]
    refs = [ref_log_probs(engine, step).cpu() for step in mine]  # the initial weights: the reference
    hf = model(family)
    ref_err = max(float((r - torch.cat([row_logps(hf, mb) for mb in step[d * gas:(d + 1) * gas]])).abs().max())
                  for r, step in zip(refs, stream()))
    losses, metrics = [], []
    for step, ref in zip(mine, refs):
        rows = ref.split(2 * PAIRS)
        losses.append(float(engine.train_batch(iter([{**mb, "ref_logps": r} for mb, r in zip(step, rows)]))))
        metrics.append(dpo_metrics(engine.step_rows(), 0.1))
    return losses, metrics, ref_err


@pytest.mark.parametrize("layout,family", [({"pp": 2, "schedule": "zb-v"}, "gpt2"), ({"tp": 2}, "qwen2"),
                                           ({}, "gpt2")], ids=["gpt2-pp2-zbv", "qwen2-tp2", "gpt2-dp2-gas2"])
def test_dpo_through_the_engine_is_trls(layout: dict, family: str) -> None:
    want, want_metrics = oracle(family)
    assert want[0] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy at step 1
    assert abs(want[-1] - want[0]) > 1e-3  # the steps moved the policy
    for losses, metrics, ref_err in run_ranks(_train, 2, layout, family, timeout=300):
        assert ref_err < 1e-5
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
        assert losses == pytest.approx(want, rel=1e-5)
        for got, exp in zip(metrics, want_metrics):
            for key, value in got.items():
                assert value == pytest.approx(exp[key], abs=1e-5), key


def _lora(rank: int) -> tuple[float, float, bool]:
    import ds_mp
    from ds_mp.engine.reference import lora_disabled, ref_log_probs

    cfg = ds_config(pp=2, micro=2 * PAIRS, gas=2, lr=LR, seq=T, loss={"type": "dpo"}, lora={"r": 4})
    engine, *_ = ds_mp.initialize(model=model(), config=cfg)
    step = stream()[0][:2]
    mbs = [{"input_ids": mb["input_ids"], "labels": labels_of(mb)} for mb in step]
    with lora_disabled(engine):
        precomputed = ref_log_probs(engine, mbs).cpu()
    engine.train_batch(iter([{**mb, "ref_logps": torch.zeros(2 * PAIRS)} for mb in mbs]))  # adapters move
    with lora_disabled(engine):
        base = ref_log_probs(engine, mbs).cpu()  # on the fly, after a step
    adapted = ref_log_probs(engine, mbs).cpu()
    want = torch.cat([row_logps(model(), mb) for mb in step])
    odd = {k: v[:3] for k, v in mbs[0].items()}
    with pytest.raises(ValueError, match=r"\[chosen; rejected\] rows, an even number per micro-batch; got 3"):
        engine.train_batch(iter([{**odd, "ref_logps": torch.zeros(3)}] * 2))  # refused on every rank, no hang
    return float((base - want).abs().max()), float((adapted - want).abs().max()), torch.equal(base, precomputed)


def test_the_reference_pass_with_lora_disabled_is_the_base_model() -> None:
    for base_err, adapted_err, same in run_ranks(_lora, 2, timeout=300):
        assert same  # precomputed before training = on the fly after a step (the base is frozen)
        assert base_err < 1e-5
        assert adapted_err > 1e-3  # the adapters trained, and lora_disabled really switched them off


@pytest.mark.parametrize("layout", [{"bf16": True, "zero": 1}, {"pp": 2, "bf16": True}], ids=["bf16-zero1-dp2", "bf16-pp2"])
def test_dpo_in_bf16_follows_trl_fp32(layout: dict) -> None:
    """bf16 (with ZeRO-1 over DP2, and across two stages): step 1 is ln 2 (the reference is the policy's own
    bf16 pass) and the losses follow plain TRL's fp32 run within bf16's rounding (2e-3)."""
    want, _ = oracle("gpt2")
    for losses, _, ref_err in run_ranks(_train, 2, layout, "gpt2", timeout=300):
        assert ref_err < 2e-2  # bf16 log-prob sums over ~40 tokens against HF's fp32
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
        assert losses == pytest.approx(want, abs=2e-3)
