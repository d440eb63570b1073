"""A context-parallel run's life: train, save, resume at another layout — CP2 → DP2 (context
parallelism off: C → 1) and DP2 → CP2 (1 → C) — and continue with the uninterrupted run's losses
(fp32, 1e-5); export with ``save_hf`` at CP2 and reload with HF's ``from_pretrained`` (the weights the
engine holds).  Packed documents; AdamW with a warm-up (moments and LR state travel) or SGD with
momentum under ZeRO-2; activation checkpointing on one side.  One spawn of 2 ranks: CP2 is 1 replica
reading both micro-batches of a step, DP2 two replicas reading one each (the same global batch)."""
from __future__ import annotations

import os

import torch

from dist_utils import run_ranks
from sft_data import micro_batches
from test_packed_attention import ROWS, SEQ, V, tiny_qwen2
from helpers import ds_config, tiny_gpt2
from test_tensor_parallel import gather_weights, max_diff

K, TOL = 2, 1e-5
MODELS = {"qwen2": tiny_qwen2, "gpt2": lambda seed=0: tiny_gpt2(seed=seed, vocab=V)}


def _config(layout: str, optimizer: str, zero: int, ckpt_interval: int) -> dict:
    cp, gas = (2, 2) if layout == "cp2" else (1, 1)
    cfg = ds_config(micro=ROWS, gas=gas, lr=0.01, seq=SEQ, optimizer=optimizer, zero=zero,
                    context_parallel={"size": cp}, pipeline={"activation_checkpoint_interval": ckpt_interval})
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 3, "warmup_type": "linear"}}
    if optimizer == "SGD":
        cfg["optimizer"]["params"]["momentum"] = 0.9
    return cfg


CASES = {  # name: (model, before, after, optimizer, zero, api, activation checkpointing before)
    "qwen2_cp2_to_dp2": ("qwen2", "cp2", "dp2", "AdamW", 0, "ds_mp", 1),
    "gpt2_dp2_to_cp2_zero2": ("gpt2", "dp2", "cp2", "SGD", 2, "deepspeed", 0),
}


def _train(engine, steps: list) -> list[float]:
    dp, d = engine.topology.dp, engine.topology.dp_rank
    n = len(steps[0]) // dp
    return [float(engine.train_batch(iter(mbs[d * n:(d + 1) * n]))) for mbs in steps]


def _rank(rank: int, tmp: str) -> dict:
    import ds_mp
    from transformers import AutoModelForCausalLM

    out = {}
    for name, (model, before, after, opt, zero, api, ckpt) in CASES.items():
        steps = [micro_batches(2, ROWS, SEQ, V, seed=40 + i)[0] for i in range(2 * K)]
        path = os.path.join(tmp, name)
        engine, *_ = ds_mp.initialize(model=MODELS[model](), config=_config(before, opt, zero, ckpt))
        first = _train(engine, steps[:K])
        if api == "deepspeed":
            engine.save_checkpoint(path, tag="mid")
        else:
            ds_mp.save_checkpoint(engine, path, "mid")
        rest = _train(engine, steps[K:])
        if before == "cp2":  # the export at CP2: HF's from_pretrained reads the engine's weights
            ds_mp.save_hf(engine, os.path.join(tmp, name + "_hf"))
            held = gather_weights(engine)[0]
            torch.distributed.barrier()
            hf = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, name + "_hf"))
            out[name + "_export"] = max_diff(held, {n: p.detach() for n, p in hf.named_parameters()})
        engine, *_ = ds_mp.initialize(model=MODELS[model](seed=1), config=_config(after, opt, zero, 1 - ckpt))
        if api == "deepspeed":
            engine.load_checkpoint(path)
        else:
            ds_mp.load_checkpoint(engine, path)
        out[name] = (first, rest, _train(engine, steps[K:]), engine.global_steps)
    return out


def test_cp_resumes_at_another_layout_and_exports(tmp_path) -> None:
    for rank, res in enumerate(run_ranks(_rank, 2, str(tmp_path), timeout=600)):
        for name in CASES:
            first, rest, resumed, steps = res[name]
            assert steps == 2 * K, f"{name} rank {rank}: {steps} steps"
            assert all(abs(a - b) <= TOL for a, b in zip(rest, resumed)), f"{name} rank {rank}: {rest} vs {resumed}"
            assert first[0] != rest[0]
        assert res["qwen2_cp2_to_dp2_export"] <= 1e-7, res["qwen2_cp2_to_dp2_export"]
