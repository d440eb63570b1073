"""Mixture of experts: ds_mp TP=2 with whole vs split experts, and PP=2, against HF on one process.

    python -m benchmarks.run --only moe_tp        (or python -m benchmarks.moe_tp [--quick])

A Qwen3-MoE-shaped model (``Qwen3MoeForCausalLM``: :data:`SHAPE`, every layer sparse, 16 experts
of width 128, top-4 renormalised, as Qwen3-30B-A3B's 128 experts / top-8 scaled down), the same
``ROWS × seq`` tokens per step, SGD, configurations interleaved
(``benchmarks.common.run_side_by_side``):

    hf_1x1           1 process × 1 thread, plain HF + torch SGD        (baseline)
    hf_1x2           1 process × 2 threads
    ds_mp_tp2_whole  TP=2, each rank 8 whole experts, 2 ranks × 1 thread
    ds_mp_tp2_split  TP=2, every expert's width cut in 2, 2 ranks × 1 thread
    ds_mp_pp2        PP=2 (1F1B over 4 micro-batches of 1 row), 2 ranks × 1 thread
    hf_1x1_aux       hf_1x1 with HF's aux loss on (output_router_logits, coefficient 0.001)
    ds_mp_pp2_aux    ds_mp_pp2 with the aux loss: its router sums travel between the stages (the carry)
    ds_mp_tp2pp2_whole  TP=2 × PP=2 (1F1B, 4 micro-batches of 1 row), whole experts, 4 ranks × 1 thread
    ds_mp_tp2pp2_split  the same with split experts

Reported: tokens/s ratios with 90% bootstrap intervals, and per-rank parameter + gradient bytes and
peak RSS.  Rows without ``_aux`` run without the aux loss.  On a 2-core machine the TP2 × PP2 rows put
4 ranks on 2 cores (each rank gets half a core, and TP's all-reduces wait on descheduled peers), so
their tokens/s is a lower bound there and their per-rank memory is the point.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks.common import Config, fmt_ratio, load_span, run_side_by_side, summarize, table, tokens_ratio
from benchmarks.workloads import LR, Bench, HFBench, max_rss_mib, state_bytes

DESCRIPTION = ("Qwen3-MoE-shaped model: ds_mp TP=2 whole vs split experts, PP=2, TP=2 × PP=2, vs one process "
               "(1 and 2 threads)")
ROWS = 4
SHAPE = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
         "intermediate_size": 512, "vocab_size": 4096, "seq": 256}
QUICK = {**SHAPE, "num_hidden_layers": 2, "seq": 128}


def moe_model(shape: dict, aux: bool = False) -> Any:
    """The fresh HF model of ``shape`` (seed 0: the same on every rank); ``aux``: HF's load-balancing loss on
    (``output_router_logits``, coefficient 0.001)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{k: v for k, v in shape.items() if k != "seq"}, norm_topk_prob=True,
                         output_router_logits=aux, router_aux_loss_coef=0.001,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return Qwen3MoeForCausalLM(cfg).train()


def _batch(shape: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, shape["vocab_size"], (rows, shape["seq"]), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


class HFMoE(HFBench):
    """One process: the MoE-shaped HF model (:func:`moe_model`) + SGD, one full batch per step."""

    def __init__(self, rank: int, world: int, shape: dict, aux: bool = False) -> None:
        self.model = moe_model(shape, aux)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.ids, self.labels = _batch(shape, ROWS)


class DsMpMoE(Bench):
    def __init__(self, rank: int, world: int, shape: dict, tp: int = 1, pp: int = 1, layout: str = "whole",
                 aux: bool = False) -> None:
        import ds_mp

        micro, gas = (ROWS, 1) if pp == 1 else (1, ROWS)
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
               "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp}, "moe": {"expert_layout": layout},
                         "data": {"seq_len": shape["seq"]}}}
        self.engine, self.opt, _, _ = ds_mp.initialize(model=moe_model(shape, aux), config=cfg)
        ids, labels = _batch(shape, ROWS)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, ROWS, micro)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self.micro)))

    def memory(self) -> dict:
        return {"state_bytes": state_bytes(self.engine.module.parameters(), self.opt), "max_rss_mib": max_rss_mib()}


def setup_hf(rank: int, world: int, **kw: Any) -> Bench:
    return HFMoE(rank, world, **kw)


def setup_ds_mp(rank: int, world: int, **kw: Any) -> Bench:
    return DsMpMoE(rank, world, **kw)


def run(quick: bool, out_dir: str) -> dict:
    shape = QUICK if quick else SHAPE
    here = "benchmarks.moe_tp"
    cfgs = [Config("hf_1x1", f"{here}:setup_hf", 1, 1, {"shape": shape}),
            Config("hf_1x2", f"{here}:setup_hf", 1, 2, {"shape": shape}),
            Config("ds_mp_tp2_whole", f"{here}:setup_ds_mp", 2, 1, {"shape": shape, "tp": 2, "layout": "whole"}),
            Config("ds_mp_tp2_split", f"{here}:setup_ds_mp", 2, 1, {"shape": shape, "tp": 2, "layout": "split"}),
            Config("ds_mp_pp2", f"{here}:setup_ds_mp", 2, 1, {"shape": shape, "pp": 2}),
            Config("hf_1x1_aux", f"{here}:setup_hf", 1, 1, {"shape": shape, "aux": True}),
            Config("ds_mp_pp2_aux", f"{here}:setup_ds_mp", 2, 1, {"shape": shape, "pp": 2, "aux": True}),
            Config("ds_mp_tp2pp2_whole", f"{here}:setup_ds_mp", 4, 1, {"shape": shape, "tp": 2, "pp": 2}),
            Config("ds_mp_tp2pp2_split", f"{here}:setup_ds_mp", 4, 1,
                   {"shape": shape, "tp": 2, "pp": 2, "layout": "split"})]
    repeats, steps = (2, 1) if quick else (8, 2)
    mem: dict[str, Any] = {}
    times, _ = run_side_by_side(cfgs, repeats, steps, extra=lambda groups: mem.update(
        {n: g.call("memory") for n, g in groups.items()}))
    tokens = ROWS * shape["seq"]
    res = summarize(times, {c.name: tokens for c in cfgs})
    single = mem["hf_1x1"][0]["state_bytes"]
    rows = []
    for c in cfgs:
        r = res[c.name]
        r["memory"] = mem[c.name]
        rows.append([c.name, f"{c.ranks} × {c.threads}", str(tokens_ratio(res, c.name, "hf_1x1")),
                     str(tokens_ratio(res, c.name, "hf_1x2")), f"±{r['iqr_rel']:.0%}",
                     fmt_ratio(r["cpu_s"] / res["hf_1x1"]["cpu_s"]),
                     fmt_ratio(max(m["state_bytes"] for m in mem[c.name]) / single),
                     f"{max(m['max_rss_mib'] for m in mem[c.name]):.0f}", load_span(r)])
    summary = [f"{n} tokens/s vs 1 × 1: {tokens_ratio(res, n, 'hf_1x1')}, vs 1 × 2 threads: "
               f"{tokens_ratio(res, n, 'hf_1x2')}" for n in ("ds_mp_tp2_whole", "ds_mp_tp2_split", "ds_mp_pp2",
                                                   "ds_mp_tp2pp2_whole", "ds_mp_tp2pp2_split")]
    summary.append(f"TP=2 whole vs split experts: {tokens_ratio(res, 'ds_mp_tp2_whole', 'ds_mp_tp2_split')}; "
                   f"at TP=2 × PP=2: {tokens_ratio(res, 'ds_mp_tp2pp2_whole', 'ds_mp_tp2pp2_split')}")
    summary.append(f"PP=2 with the aux loss (the carry) vs without: {tokens_ratio(res, 'ds_mp_pp2_aux', 'ds_mp_pp2')}; "
                   f"HF 1 × 1 with vs without: {tokens_ratio(res, 'hf_1x1_aux', 'hf_1x1')}")
    summary.append("intervals are 90% bootstrap intervals over the timed steps; 2-core machine shared with other jobs")
    for line in summary:
        print("  " + line)
    describe = ", ".join(f"{k} {v}" for k, v in shape.items())
    return {"workload": f"Qwen3-MoE {describe}, batch {ROWS} rows per step, fp32, SGD", "configs": res,
            "ratios": {f"{n}_vs_1x1": res[n]["tokens_per_s"] / res["hf_1x1"]["tokens_per_s"] for n in res},
            "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "tables": [table("tokens/s and memory (Qwen3-MoE-shaped model)",
                             ["config", "ranks × threads", "vs 1×1 [90%]", "vs 1×2 [90%]", "step-time IQR",
                              "CPU s/step vs 1×1", "param+grad bytes/rank vs 1×1", "peak RSS MiB/rank",
                              "load before → after"], rows)]}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "moe_tp", *sys.argv[1:]]))
