"""The TP and pipeline rows for a Llama-shaped model: ds_mp against one process and DeepSpeed AutoTP.

    python -m benchmarks.run --only llama_tp        (or python -m benchmarks.llama_tp)

Same model (``LlamaForCausalLM``: 8 layers × 512 hidden, 8 heads with 2 key/value heads, SwiGLU
1408, vocab 8192, untied head), same ``ROWS × 256`` tokens per step, SGD, configurations
interleaved (``benchmarks.common.run_side_by_side``):

    hf_1x1       1 process × 1 thread, plain HF + torch SGD        (baseline)
    hf_1x2       1 process × 2 threads
    ds_mp_tp2    ds_mp TP=2 (KV heads split 1 + 1), 2 ranks × 1 thread
    ds_mp_pp2    ds_mp PP=2, 1F1B over 4 micro-batches of 1 row, 2 ranks × 1 thread
    autotp_tp2   DeepSpeed AutoTP=2 (``"tensor_parallel": {"autotp_size": 2}``; it knows Llama)

Reported: tokens/s ratios with 90% bootstrap intervals against hf_1x1 and hf_1x2.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from benchmarks.common import Config, fmt_ratio, load_span, run_side_by_side, summarize, table, tokens_ratio
from benchmarks.workloads import LR, Bench

DESCRIPTION = "Llama-shaped model: ds_mp TP=2 and PP=2 vs one process (1 and 2 threads) and DeepSpeed AutoTP=2"
ROWS, SEQ = 4, 256
SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 1024, "tie_word_embeddings": False}
QUICK = {**SHAPE, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4}


def llama(shape: dict, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=0, eos_token_id=0)).train()


def batch(shape: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, shape["vocab_size"], (rows, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


class HFBench(Bench):
    def __init__(self, rank: int, world: int, shape: dict) -> None:
        self.model = llama(shape)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.ids, self.labels = batch(shape, ROWS)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(input_ids=self.ids, labels=self.labels).loss
        loss.backward()
        self.opt.step()
        return float(loss.detach())


class DsMpBench(Bench):
    def __init__(self, rank: int, world: int, shape: dict, tp: int, pp: int, micro: int) -> None:
        import ds_mp

        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ROWS // micro,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 10**9,
               "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp}, "data": {"seq_len": SEQ}}}
        self.engine, *_ = ds_mp.initialize(model=llama(shape), config=cfg)
        ids, labels = batch(shape, ROWS)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, ROWS, micro)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self.micro)))


class AutoTPBench(Bench):
    def __init__(self, rank: int, world: int, shape: dict) -> None:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 1-min JIT build
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        model = llama(shape)
        cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 10**9,
               "tensor_parallel": {"autotp_size": 2}}
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.ids, self.labels = batch(shape, ROWS)

    def step(self) -> float:
        loss = self.engine(input_ids=self.ids, labels=self.labels).loss
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())


def setup(rank: int, world: int, kind: str, **kw: Any) -> Bench:
    return {"hf": HFBench, "ds_mp": DsMpBench, "autotp": AutoTPBench}[kind](rank, world, **kw)


def run(quick: bool, out_dir: str) -> dict:
    shape = QUICK if quick else SHAPE
    cfgs = [Config("hf_1x1", "benchmarks.llama_tp:setup", 1, 1, {"kind": "hf", "shape": shape}),
            Config("hf_1x2", "benchmarks.llama_tp:setup", 1, 2, {"kind": "hf", "shape": shape}),
            Config("ds_mp_tp2", "benchmarks.llama_tp:setup", 2, 1,
                   {"kind": "ds_mp", "shape": shape, "tp": 2, "pp": 1, "micro": ROWS}),
            Config("ds_mp_pp2", "benchmarks.llama_tp:setup", 2, 1,
                   {"kind": "ds_mp", "shape": shape, "tp": 1, "pp": 2, "micro": 1}),
            Config("autotp_tp2", "benchmarks.llama_tp:setup", 2, 1, {"kind": "autotp", "shape": shape})]
    repeats, steps = (2, 1) if quick else (6, 2)
    times, _ = run_side_by_side(cfgs, repeats, steps)
    tokens = ROWS * SEQ
    res = summarize(times, {c.name: tokens for c in cfgs})
    rows = [[c.name, f"{c.ranks} × {c.threads}", str(tokens_ratio(res, c.name, "hf_1x1")),
             str(tokens_ratio(res, c.name, "hf_1x2")), f"±{res[c.name]['iqr_rel']:.0%}",
             fmt_ratio(res[c.name]["cpu_s"] / res["hf_1x1"]["cpu_s"]), load_span(res[c.name])] for c in cfgs]
    summary = [f"{n} tokens/s vs 1 × 1: {tokens_ratio(res, n, 'hf_1x1')}, vs 1 × 2 threads: "
               f"{tokens_ratio(res, n, 'hf_1x2')}" for n in ("ds_mp_tp2", "ds_mp_pp2", "autotp_tp2")]
    summary.append(f"ds_mp TP=2 vs DeepSpeed AutoTP=2: {tokens_ratio(res, 'ds_mp_tp2', 'autotp_tp2')}")
    summary.append("intervals are 90% bootstrap intervals over the timed steps; 2-core machine shared with other jobs")
    for line in summary:
        print("  " + line)
    return {"workload": f"LlamaForCausalLM {shape}, batch {ROWS} × {SEQ} per step", "configs": res,
            "ratios": {f"{n}_vs_1x1": res[n]["tokens_per_s"] / res["hf_1x1"]["tokens_per_s"] for n in res},
            "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "tables": [table("tokens/s (Llama-shaped model)", ["config", "ranks × threads", "vs 1×1 [90%]",
                                                               "vs 1×2 [90%]", "step-time IQR",
                                                               "CPU s/step vs 1×1", "load before → after"], rows)]}


if __name__ == "__main__":
    import json

    import sys

    result = run(quick="--quick" in sys.argv, out_dir="benchmarks/results")
    with open(os.path.join("benchmarks/results", "llama_tp.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
