"""Per-rank memory of loading an HF checkpoint at TP × PP = 2 × 2 against the full model.

Each rank of ``ds_mp.initialize(model=<HF dir>)`` reads only its own tensors (lazily,
from safetensors) and keeps only its shards.  Measured per rank: the rise of peak
resident memory during ``initialize`` (``VmHWM`` after resetting it; Linux) and the bytes
of parameters it holds, both as ratios of the 1 × 1 run on the same directory.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

DESCRIPTION = "Loading an HF GPT-2 directory: per-rank peak memory at TP×PP = 2×2 vs 1×1"


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _rank(rank: int, world: int, port: int, tp: int, pp: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import ds_mp
    from benchmarks.workloads import ds_mp_config

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak: count only what initialize adds
    base = _peak_mib()
    cfg = ds_mp_config({"n_layer": 8, "n_embd": 768, "n_head": 8, "vocab": 16384, "seq": 256}, tp=tp, pp=pp, micro=1)
    engine, *_ = ds_mp.initialize(model=model_dir, config=cfg)
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_rise_mib": _peak_mib() - base, "params_mib": params}, f)


def _spawn(world: int, tp: int, pp: int, model_dir: str) -> list[dict]:
    from benchmarks.common import spawn_once

    with tempfile.TemporaryDirectory() as out:
        spawn_once(_rank, world, tp, pp, model_dir, out, what="memory ranks")
        return [json.load(open(os.path.join(out, f"r{r}.json"))) for r in range(world)]


def run(quick: bool, out_dir: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "gpt2")
        n_layer = 4 if quick else 8
        GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=768, n_head=8, vocab_size=16384,
                                   n_positions=256)).save_pretrained(model_dir)
        full = _spawn(1, 1, 1, model_dir)[0]
        ranks = _spawn(4, 2, 2, model_dir)
    rows: list[list[Any]] = [["1×1", 0, f"{full['params_mib']:.0f}", "1.00×", f"{full['peak_rise_mib']:.0f}", "1.00×"]]
    for r in ranks:
        rows.append(["2×2", r["rank"], f"{r['params_mib']:.0f}", f"{r['params_mib'] / full['params_mib']:.2f}×",
                     f"{r['peak_rise_mib']:.0f}", f"{r['peak_rise_mib'] / full['peak_rise_mib']:.2f}×"])
    worst = max(r["peak_rise_mib"] for r in ranks) / full["peak_rise_mib"]
    return {"tables": [{"title": "per-rank memory while loading (GPT-2 %d×768, vocab 16384, fp32)" % n_layer,
                        "columns": ["TP×PP", "rank", "params MiB", "params vs 1×1", "peak RSS rise MiB",
                                    "peak rise vs 1×1"], "rows": rows}],
            "summary": [f"worst 2×2 rank's peak RSS rise during initialize: {worst:.2f}× of loading the full model "
                        "(the last stage briefly holds the full wte to cut its vocab shard)"],
            "workload": f"GPT-2 {n_layer}×768, 8 heads, vocab 16384, fp32, loaded from a save_pretrained dir", "repeats": 1, "steps_per_repeat": 0,
            "ratios": {"peak_rise_worst_rank_vs_full": worst}, "plots": []}
