"""Context parallelism end to end: engines at CP = 2 (alone, × DP, × TP with and without sequence
parallelism, × PP under each schedule that carries it) train the unmodified HF model on one process
exactly (fp32, 1e-5): packed documents against HF on each document alone, padded rows against HF
with the mask.  Both impls (allgather: zigzag shards; ulysses: contiguous), GPT-2 and the Llama
family (Qwen2's GQA and biases, Mistral's window shorter than a shard, one KV head replicated,
Qwen3's q/k norms, Gemma 3's sliding and full layers).

The data is the users': with seq_len 16 and CP = 2 a shard is 8 tokens (allgather: chunks 0-3 and
12-15 on rank 0, 4-11 on rank 1), packed documents of 2-8 tokens cross the shard borders and restart
their positions inside the second shard; left padding; a skewed step whose targets all sit in one
shard; each DP replica its own rows (rank = ((pp·DP + dp)·CP + cp)·TP + tp).  One spawn per world
size runs its cases; the parent runs the oracles (tests/sft_data.py) and compares losses (the
eval loss before any update too) and the weights after SGD steps.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from sft_data import hf_masked, hf_per_document, micro_batches, padded
from test_packed_attention import BF16, LORA, MODELS as PACKED_MODELS, ROWS, SEQ, V, LR
from helpers import ds_config
from test_tensor_parallel import gather_weights, max_diff

TOL = 1e-5


def tiny_qwen2_kv1(seed: int = 0):
    """One key/value head: ulysses at CP = 2 replicates it on both CP ranks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {**PACKED_MODELS, "qwen2_kv1": tiny_qwen2_kv1}


def skewed(n: int, seed: int) -> list[dict]:
    """Left-padded rows whose labels are -100 outside tokens 5 … 11: every shifted target (4 … 10)
    sits in allgather's shard of CP rank 1 (tokens 4 … 11), none in rank 0's."""
    mbs = padded(n, ROWS, SEQ, V, seed, "left")
    for mb in mbs:
        keep = torch.zeros(SEQ, dtype=torch.bool)
        keep[5:12] = True
        mb["labels"] = torch.where(keep & (mb["attention_mask"] == 1), mb["input_ids"], torch.full_like(mb["labels"], -100))
    return mbs


def _case(name: str, *, model: str = "gpt2", impl: str = "allgather", tp: int = 1, pp: int = 1, dp: int = 1,
          gas: int = 2, n: int = 2, schedule: str = "1f1b", data: str = "packed", zero: int = 0, bf16: bool = False,
          **ds_mp) -> dict:
    steps, docs = [], []
    for i in range(n):
        seed = len(name) * 10 + i
        if data == "packed":
            mbs, held = micro_batches(dp * gas, ROWS, SEQ, V, seed)
            docs.append(held)
        elif data == "skewed":
            mbs = skewed(dp * gas, seed)
        elif data == "full":  # every label a target: "micro_batch" normalisation is "tokens"
            mbs = [{"input_ids": ids, "labels": ids.clone()} for ids in
                   torch.randint(1, V, (dp * gas, ROWS, SEQ), generator=torch.Generator().manual_seed(seed))]
        else:
            mbs = padded(dp * gas, ROWS, SEQ, V, seed, data)
        steps.append(mbs)
    cfg = ds_config(tp=tp, pp=pp, micro=ROWS, gas=gas, lr=LR, schedule=schedule, seq=SEQ, zero=zero, bf16=bf16,
                    context_parallel={"size": 2, "impl": impl}, **ds_mp)
    return {"name": name, "model": model, "cfg": cfg, "tp": tp, "dp": dp, "gas": gas, "steps": steps, "docs": docs,
            "bf16": bf16}


def cases(world: int) -> list[dict]:
    if world == 2:
        return [_case("gpt2_cp2_allgather"), _case("qwen2_cp2_ulysses", model="qwen2", impl="ulysses"),
                _case("mistral_cp2_window", model="mistral", n=1),  # window 4 < a shard's 8 tokens
                _case("qwen2_cp2_left", model="qwen2", data="left", n=1),
                _case("gpt2_cp2_ulysses_skew", impl="ulysses", data="skewed", n=1),
                _case("qwen2_cp2_skew", model="qwen2", data="skewed", n=1),
                _case("kv1_cp2_ulysses", model="qwen2_kv1", impl="ulysses", n=1),
                _case("gpt2_lora_cp2", model="gpt2_lora", lora=LORA),  # against PEFT: losses (its names differ)
                _case("qwen2_cp2_zero1_bf16", model="qwen2", zero=1, bf16=True, n=1),
                _case("gemma3_cp2_right", model="gemma3", data="right", n=1),  # sliding (window 4) and full layers
                _case("qwen3_cp2_ulysses", model="qwen3", impl="ulysses", n=1),  # q/k norms
                _case("gpt2_cp2_micro_batch_norm", data="full", n=1, loss={"normalization": "micro_batch"})]  # bf16: runs, HF's fp32 within 1e-2
    if world == 4:
        return [_case("gpt2_cp2_dp2", dp=2), _case("qwen2_cp2_dp2_ulysses_zero1", model="qwen2", dp=2, impl="ulysses",
                                                  zero=1, n=1),
                _case("qwen2_cp2_tp2", model="qwen2", tp=2, n=1),
                _case("gpt2_cp2_tp2_sp_ulysses", tp=2, impl="ulysses", n=1, tensor_parallel={"sequence_parallel": True}),
                _case("qwen2_cp2_tp2_sp_left", model="qwen2", tp=2, data="left", n=1,
                      tensor_parallel={"sequence_parallel": True}),
                _case("gpt2_cp2_pp2_1f1b", pp=2, n=1), _case("qwen2_cp2_pp2_gpipe", model="qwen2", pp=2, n=1,
                                                             schedule="gpipe", impl="ulysses"),
                _case("gpt2_cp2_pp2_zbh1", pp=2, schedule="zb-h1", gas=4, n=1),
                _case("qwen2_cp2_pp2_interleaved", model="qwen2", pp=2, schedule="interleaved", gas=2, n=1,
                      pipeline={"virtual_stages": 2}),
                _case("gpt2_cp2_pp2_zbv", pp=2, schedule="zb-v", gas=2, n=1)]
    return []


def oracle(case: dict) -> tuple[list[float], dict]:
    model = MODELS[case["model"]]()
    if case["docs"]:
        return hf_per_document(model, case["docs"], LR)
    return hf_masked(model, case["steps"], LR)


def _rank(rank: int, world: int, names: list[str] | None = None) -> dict:
    import ds_mp

    out = {}
    for case in cases(world):
        if names is not None and case["name"] not in names:
            continue
        d, gas = (rank // (case["tp"] * 2)) % case["dp"], case["gas"]  # CP = 2 peers read the same rows
        engine, *_ = ds_mp.initialize(model=MODELS[case["model"]](), config=case["cfg"])
        evaluated = float(engine.eval_batch(iter(case["steps"][0][d * gas:(d + 1) * gas])))  # before any update
        losses = [float(engine.train_batch(iter(step[d * gas:(d + 1) * gas]))) for step in case["steps"]]
        out[case["name"]] = (losses, {} if case["cfg"]["ds_mp"].get("lora") else gather_weights(engine)[0], evaluated)
    return out


def check(cases: list[dict], results: list[dict]) -> None:
    """Each rank's eval loss, losses and weights of each case in ``results`` against the oracle's."""
    for case in cases:
        if case["name"] not in results[0]:
            continue
        ref_losses, ref_w = oracle(case)
        for rank, res in enumerate(results):
            losses, w, evaluated = res[case["name"]]
            where = f"{case['name']} rank {rank}"
            tol = [BF16 * b for b in ref_losses] if case["bf16"] else [TOL] * len(ref_losses)
            assert abs(evaluated - ref_losses[0]) <= tol[0], f"{where}: eval_batch {evaluated} vs {ref_losses[0]}"
            assert all(abs(a - b) <= t for a, b, t in zip(losses, ref_losses, tol)), f"{where}: {losses} vs {ref_losses}"
            if w and not case["bf16"]:  # LoRA: PEFT's names (its losses follow the update); bf16: losses
                assert max_diff(w, ref_w) <= TOL, f"{where}: weights differ by {max_diff(w, ref_w)}"


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_trains_hf_exactly(world: int) -> None:
    check(cases(world), run_ranks(_rank, world, world, timeout=600))


def probed(step: list, docs: list, token: int = 5) -> tuple[list, list, int]:
    """``step`` with token ``token`` of row 0 of its first micro-batch changed (allgather at CP = 2:
    a token of rank 1's shard, tokens 4 … 11), the documents with that document changed the same
    way, and the index of that document in ``docs``."""
    (ids, pos), labels = step[0]
    start = int(max(i for i in range(token + 1) if pos[0, i] == 0))
    end = next((i for i in range(token + 1, SEQ) if pos[0, i] == 0), SEQ)
    k = next(j for j, (d, _) in enumerate(docs) if len(d) == end - start and torch.equal(d, ids[0, start:end]))
    new_ids = ids.clone()
    new_ids[0, token] = (ids[0, token] + 1) % V or 1
    new_docs = list(docs)
    new_docs[k] = (new_ids[0, start:end].clone(), docs[k][1])
    return [((new_ids, pos), labels), *step[1:]], new_docs, k


def _probe_rank(rank: int) -> list[float]:
    import ds_mp

    case = _case("gpt2_cp2_probe", n=1)
    engine, *_ = ds_mp.initialize(model=MODELS["gpt2"](), config=case["cfg"])
    step = case["steps"][0]
    changed, _, _ = probed(step, case["docs"][0])
    return [float(engine.eval_batch(iter(s))) for s in (step, changed)]


def test_leak_probe_one_token_changes_only_its_document() -> None:
    """Change one token of one packed document (in CP rank 1's shard): the CP = 2 eval loss moves by
    exactly that document's loss change as HF computes it on each document alone — every other
    document's loss is unchanged, so nothing leaked across documents or shards."""
    case = _case("gpt2_cp2_probe", n=1)
    docs = case["docs"][0]
    _, new_docs, k = probed(case["steps"][0], docs)
    model, n = MODELS["gpt2"]().eval(), sum(int((lab[1:] != -100).sum()) for _, lab in docs)
    with torch.no_grad():
        per_doc = [float(model(input_ids=i[None], labels=lab[None]).loss) * int((lab[1:] != -100).sum()) / n
                   if int((lab[1:] != -100).sum()) else 0.0 for i, lab in docs]
        moved = (float(model(input_ids=new_docs[k][0][None], labels=new_docs[k][1][None]).loss)
                 * int((docs[k][1][1:] != -100).sum()) / n if int((docs[k][1][1:] != -100).sum()) else 0.0)
    for before, after in run_ranks(_probe_rank, 2, timeout=300):
        assert abs(before - sum(per_doc)) <= TOL, (before, sum(per_doc))
        assert abs((after - before) - (moved - per_doc[k])) <= TOL, (after - before, moved - per_doc[k])
        assert after != before  # the probe reached a target of the changed document
