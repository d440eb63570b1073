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

import sys
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, fmt_ratio, load_span, run_side_by_side, summarize, table, tokens_ratio
from benchmarks.workloads import LR, Bench, Shape, batch, hf_model

DESCRIPTION = "Llama-shaped model: ds_mp TP=2 and PP=2 vs one process (1 and 2 threads) and DeepSpeed AutoTP=2"
ROWS = 4
SHAPE = Shape(n_layer=8, n_embd=512, n_head=8, vocab=8192, seq=256, n_positions=1024, model_type="llama",
              n_kv_head=2, intermediate_size=1408, tie_word_embeddings=False)
QUICK = Shape(**{**asdict(SHAPE), "n_layer": 4, "n_embd": 256, "intermediate_size": 704})


class AutoTPBench(Bench):
    """DeepSpeed's own engine with AutoTP=2 on the HF model (it knows Llama's linears); a step is
    forward, ``engine.backward``, ``engine.step``."""

    def __init__(self, rank: int, world: int, shape: dict) -> None:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 1-min JIT build
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        model = hf_model(shape)
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


def setup_autotp(rank: int, world: int, **kw: Any) -> Bench:
    return AutoTPBench(rank, world, **kw)


def run(quick: bool, out_dir: str) -> dict:
    shape = asdict(QUICK if quick else SHAPE)
    cfgs = [Config("hf_1x1", "benchmarks.workloads:setup_hf", 1, 1, {"shape": shape, "rows": ROWS}),
            Config("hf_1x2", "benchmarks.workloads:setup_hf", 1, 2, {"shape": shape, "rows": ROWS}),
            Config("ds_mp_tp2", "benchmarks.workloads:setup_ds_mp", 2, 1, {"shape": shape, "tp": 2, "micro": ROWS}),
            Config("ds_mp_pp2", "benchmarks.workloads:setup_ds_mp", 2, 1,
                   {"shape": shape, "pp": 2, "micro": 1, "gas": ROWS}),
            Config("autotp_tp2", "benchmarks.llama_tp:setup_autotp", 2, 1, {"shape": shape})]
    repeats, steps = (2, 1) if quick else (6, 2)
    times, _ = run_side_by_side(cfgs, repeats, steps)
    tokens = ROWS * shape["seq"]
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
    return {"workload": f"{Shape(**shape).describe()}, batch {ROWS} per step", "configs": res,
            "ratios": {f"{n}_vs_1x1": res[n]["tokens_per_s"] / res["hf_1x1"]["tokens_per_s"] for n in res},
            "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "tables": [table("tokens/s (Llama-shaped model)", ["config", "ranks × threads", "vs 1×1 [90%]",
                                                               "vs 1×2 [90%]", "step-time IQR",
                                                               "CPU s/step vs 1×1", "load before → after"], rows)]}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "llama_tp", *sys.argv[1:]]))
