"""Packed documents and padding masks against the unmodified HF model: ds_mp trains on packed rows
(``((input_ids, position_ids), labels)``, dicts with HF's keys) exactly as HF trains on each document
alone; with ``attention_mask`` exactly as HF with that mask.  Loss = the global batch's per-token mean.

One spawn per world size runs its cases (pairwise over layout × schedule × family); the parent runs
the oracle (tests/sft_data.py) and compares losses and the weights after SGD steps (fp32, 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config, randomise_lora_b, tiny_gemma3, tiny_gpt2, tiny_qwen3
from sft_data import hf_masked, hf_per_document, micro_batches, padded
from test_tensor_parallel import gather_weights, max_diff

V, SEQ, ROWS, LR, TOL = 203, 16, 2, 0.1, 1e-5


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_mistral(seed: int = 0, window: int = 4):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=V, max_position_embeddings=64, sliding_window=window,
                        bos_token_id=0, eos_token_id=0)
    return MistralForCausalLM(cfg).eval()


def peft_gpt2():
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=LORA["target_modules"],
                     fan_in_fan_out=True, task_type="CAUSAL_LM")
    return randomise_lora_b(get_peft_model(tiny_gpt2(vocab=V), cfg), 7)


LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["c_attn", "c_proj", "c_fc"]}
MODELS = {"gpt2": lambda: tiny_gpt2(vocab=V), "qwen2": tiny_qwen2, "mistral": tiny_mistral, "gpt2_lora": peft_gpt2,
          "qwen3": lambda: tiny_qwen3(vocab=V), "gemma3": lambda: tiny_gemma3(vocab=V, window=4, n_layer=4)}
BF16 = 1e-2  # bf16 losses against HF's fp32 (relative)


def _case(name: str, *, model: str = "gpt2", tp: int = 1, pp: int = 1, dp: int = 1, gas: int = 3, n: int = 2,
          schedule: str = "1f1b", padding: str = "", bf16: bool = False, zero: int = 0, clip: float = 0.0,
          first_labels: bool = False, **ds_mp) -> dict:
    """Packed documents (``padding=""``) or one padded document per row (``"left"``/``"right"``).
    ``first_labels``: each document's first token keeps its label.  Packed: a target only for the
    token before it, of another document: ds_mp must not count it, as HF per document cannot.
    Left padding: a target for the last padding position, as in HF with the mask (its attention
    sees no key: output 0, HF's sdpa and torch's convention for a fully masked row)."""
    steps, docs = [], []
    for i in range(n):
        seed = len(name) * 10 + i
        if padding:
            mbs = padded(dp * gas, ROWS, SEQ, V, seed, padding)
            for mb in mbs if first_labels else []:
                rows, first = torch.arange(ROWS), mb["attention_mask"].argmax(1)
                mb["labels"][rows, first] = mb["input_ids"][rows, first]
            steps.append(mbs)
        else:
            mbs, held = micro_batches(dp * gas, ROWS, SEQ, V, seed)
            if first_labels:
                mbs = [((ids, pos), torch.where(pos == 0, ids, labels)) for (ids, pos), labels in mbs]
            steps.append(mbs)
            docs.append(held)
    cfg = ds_config(tp=tp, pp=pp, micro=ROWS, gas=gas, lr=LR, schedule=schedule, seq=SEQ, bf16=bf16, zero=zero,
                    clip=clip, **ds_mp)
    return {"name": name, "model": model, "cfg": cfg, "tp": tp, "dp": dp, "gas": gas, "steps": steps, "docs": docs,
            "bf16": bf16, "clip": clip}


def oracle(case: dict) -> tuple[list[float], dict]:
    model = MODELS[case["model"]]()
    if case["docs"]:
        return hf_per_document(model, case["docs"], LR, case["clip"])
    return hf_masked(model, case["steps"], LR)


def cases(world: int) -> list[dict]:
    if world == 1:
        return [_case("gpt2_pp1"), _case("qwen2_pp1", model="qwen2", gas=2, first_labels=True),
                _case("gpt2_left", padding="left"), _case("qwen2_right", model="qwen2", padding="right"),
                _case("qwen2_left", model="qwen2", padding="left", gas=1),
                _case("gpt2_left_first", padding="left", first_labels=True),  # issue 43 item 13
                _case("qwen2_left_first", model="qwen2", padding="left", gas=2, first_labels=True),
                _case("mistral_window4", model="mistral", gas=2),  # documents up to 8 tokens: the window cuts
                _case("gemma3_right", model="gemma3", padding="right", gas=2)]  # sliding and full layers
    if world == 2:
        return [_case("gpt2_pp2_1f1b", pp=2), _case("qwen2_tp2", model="qwen2", tp=2),
                _case("gpt2_dp2", dp=2, gas=2), _case("qwen3_tp2", model="qwen3", tp=2, gas=2),
                _case("gemma3_pp2_zbh1", model="gemma3", pp=2, schedule="zb-h1", gas=4),  # window 4 cuts documents
                _case("qwen2_pp2_zbh1", model="qwen2", pp=2, schedule="zb-h1", gas=4),
                _case("gpt2_pp2_interleaved", pp=2, schedule="interleaved", gas=4, pipeline={"virtual_stages": 2}),
                # a document boundary inside a slice, a slice boundary inside a document, the KV cache across slices
                _case("gpt2_pp2_terapipe", pp=2, schedule="terapipe", terapipe={"slices": [5, 11]}),
                _case("qwen2_pp2_terapipe_1f1b", model="qwen2", pp=2, schedule="terapipe", gas=2,
                      terapipe={"slices": [7, 4, 5], "order": "1f1b"}),
                _case("qwen2_pp2_gpipe_ckpt", model="qwen2", pp=2, schedule="gpipe", padding="left",
                      first_labels=True, pipeline={"activation_checkpoint_interval": 1}),
                _case("gpt2_pp2_zbh1_ckpt_right", pp=2, schedule="zb-h1", padding="right",
                      pipeline={"activation_checkpoint_interval": 1}),
                _case("gpt2_lora_pp2", model="gpt2_lora", pp=2, lora=LORA),  # against PEFT
                _case("qwen2_dp2_zero1_bf16", model="qwen2", dp=2, gas=2, zero=1, bf16=True),
                _case("gpt2_pp2_zero1_clip", pp=2, zero=1, clip=0.5),
                # Ouroboros without delay is backprop: its replays attend with the layouts their forwards had
                _case("gpt2_ouroboros_sync", pp=2, schedule="ouroboros", ouroboros={"delay": False}),
                _case("qwen2_ouroboros_sync_left", model="qwen2", pp=2, schedule="ouroboros", padding="left",
                      ouroboros={"delay": False, "recompute": "stashed"})]
    if world == 3:  # a middle stage reads no data: the layouts reach it from stage 0
        return [_case("qwen2_pp3_1f1b", model="qwen2", pp=3, gas=4), _case("gpt2_pp3_zbh1", pp=3, schedule="zb-h1"),
                _case("mistral_pp3_gpipe", model="mistral", pp=3, schedule="gpipe", padding="right")]
    if world == 4:
        return [_case("qwen2_tp2_pp2_sp", model="qwen2", tp=2, pp=2, tensor_parallel={"sequence_parallel": True}),
                _case("gpt2_tp2_pp2_sp_terapipe", tp=2, pp=2, schedule="terapipe", terapipe={"slices": [8, 8]},
                      tensor_parallel={"sequence_parallel": False}),
                _case("gpt2_tp2_dp2_sp", tp=2, dp=2, gas=2, tensor_parallel={"sequence_parallel": True}),
                _case("qwen2_pp2_dp2_interleaved", model="qwen2", pp=2, dp=2, gas=2, schedule="interleaved",
                      pipeline={"virtual_stages": 2}),
                _case("gpt2_pp2_dp2_zero2_clip", pp=2, dp=2, gas=2, zero=2, clip=0.5),
                _case("gemma3_tp2_pp2_sp", model="gemma3", tp=2, pp=2, gas=2,
                      tensor_parallel={"sequence_parallel": True})]
    return []


def _rank(rank: int, world: int) -> dict:
    import ds_mp

    out = {}
    for case in cases(world):
        d, gas = (rank // case["tp"]) % case["dp"], case["gas"]
        engine, *_ = ds_mp.initialize(model=MODELS[case["model"]](), config=case["cfg"])
        evaluated = float(engine.eval_batch(iter(case["steps"][0][d * gas:(d + 1) * gas])))  # before any update
        losses = [float(engine.train_batch(iter(step[d * gas:(d + 1) * gas]))) for step in case["steps"]]
        out[case["name"]] = (losses, {} if case["cfg"]["ds_mp"].get("lora") else gather_weights(engine)[0], evaluated)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_documents_equal_hf_per_document(world: int) -> None:
    results = run_ranks(_rank, world, world, timeout=300)
    for case in cases(world):
        ref_losses, ref_w = oracle(case)
        for rank, res in enumerate(results):
            losses, w, evaluated = res[case["name"]]
            where = f"{case['name']} rank {rank}"
            tol = [BF16 * b for b in ref_losses] if case["bf16"] else [TOL] * len(ref_losses)
            assert abs(evaluated - ref_losses[0]) <= tol[0], f"{where}: eval_batch {evaluated} vs {ref_losses[0]}"
            assert all(abs(a - b) <= t for a, b, t in zip(losses, ref_losses, tol)), f"{where}: {losses} vs {ref_losses}"
            if not case["bf16"] and case["model"] != "gpt2_lora":  # LoRA: PEFT's names; its losses follow the update
                assert max_diff(w, ref_w) <= TOL, f"{where}: weights differ by {max_diff(w, ref_w)}"


# --- refusals: one line naming the input -------------------------------------------------
@pytest.mark.parametrize("batch, words", [
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
      "token_type_ids": torch.zeros(2, 4, dtype=torch.long)}, "'token_type_ids' is not used"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, "without 'labels'"),
    (((torch.zeros(2, 4, dtype=torch.long),) * 3, torch.zeros(2, 4, dtype=torch.long)), "inputs tuple of 3"),
    ((torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4)), "3 elements"),
    (((torch.zeros(2, 4, dtype=torch.long), torch.tensor([[1, 1, 0, 0]] * 2)), torch.zeros(2, 4, dtype=torch.long)),
     "position_ids must count up by 1"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
      "attention_mask": torch.ones(2, 4)}, "attention_mask must be an integer tensor"),
    ((torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long)), "input_ids must be an integer tensor"),
])
def test_inputs_ds_mp_would_not_use_are_refused(batch, words) -> None:
    from ds_mp.models.batch import parse_micro_batch

    with pytest.raises(ValueError, match=words) as err:
        parse_micro_batch(batch)
    assert "\n" not in str(err.value)


def test_forms_of_one_batch_parse_alike() -> None:
    """(ids, labels), ((ids,), labels), ((ids, positions), labels) and the dict are one batch."""
    from ds_mp.models.batch import parse_micro_batch

    ((ids, pos), labels), _ = micro_batches(1, ROWS, SEQ, V, seed=3)[0][0], None
    a = parse_micro_batch(((ids, pos), labels))
    b = parse_micro_batch({"input_ids": ids, "position_ids": pos, "labels": labels})
    assert torch.equal(a.layout().docs, b.layout().docs) and torch.equal(a.layout().positions, pos)
    assert parse_micro_batch((ids, labels)).layout() is None and parse_micro_batch(((ids,), labels)).layout() is None
    arange = torch.arange(SEQ).expand(ROWS, SEQ)
    assert parse_micro_batch(((ids, arange), labels)).layout() is None  # one document per row: plain causal


def _engine_rank(rank: int) -> dict:
    """A Mistral engine (window 4, seq_len 8) given 16-token batches; a step without targets; a
    dict with an unknown key; "tokens" vs "micro_batch" on full rows."""
    import warnings

    import ds_mp
    from helpers import batches

    out: dict = {}
    engine, *_ = ds_mp.initialize(model=tiny_mistral(), config=ds_config(gas=2, seq=8))
    long = batches(2, ROWS, 16, V)
    for name, step in (("too_long", long), ("unknown_key", [{**mb, "token_type_ids": mb["input_ids"]} for mb in
                                                            padded(2, ROWS, 8, V, seed=1, side="left")])):
        try:
            engine.train_batch(iter(step))
            out[name] = "trained"
        except ValueError as err:
            out[name] = str(err)
    before = [p.detach().clone() for p in engine.module.parameters()]
    empty = [(ids, torch.full_like(ids, -100)) for ids, _ in batches(2, ROWS, 8, V)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["empty_loss"] = float(engine.train_batch(iter(empty)))
    out["empty_warned"] = any("no target token" in str(w.message) for w in caught)
    out["empty_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    out["empty_steps"] = engine.global_steps
    for norm in ("tokens", "micro_batch"):
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=V), config=ds_config(gas=3, seq=8, loss={"normalization": norm}))
        out[norm] = [float(engine.train_batch(iter(batches(3, ROWS, 8, V, seed=s)))) for s in range(3)]
    return out


def test_engine_refuses_long_and_unknown_batches_and_skips_empty_steps() -> None:
    (out,) = run_ranks(_engine_rank, 1, timeout=200)
    assert "sequence length 16 exceeds ds_mp.data.seq_len=8" in out["too_long"], out["too_long"]
    assert "'token_type_ids' is not used" in out["unknown_key"], out["unknown_key"]
    assert out["empty_loss"] == 0.0 and out["empty_warned"] and out["empty_unchanged"] and out["empty_steps"] == 0, out
    assert out["tokens"] == out["micro_batch"], (out["tokens"], out["micro_batch"])  # full rows: the same division
