"""A Qwen2.5-0.5B-shaped model loaded per rank at TP × PP = 2 × 2 through the ``deepspeed`` launcher.

    python -m benchmarks.llama_scale            # writes benchmarks/results/llama_scale.json

A random checkpoint with Qwen2.5-0.5B's shapes (hidden 896, 14 heads, 2 key/value heads, 24
layers, intermediate 4864, vocab 151936, tied embedding; 494M parameters, 1884 MiB in fp32) is
written with ``save_pretrained`` (no download).  ``deepspeed --num_gpus 4 --module`` then runs this
module with ``--rank-run``: each rank imports what ``ds_mp.initialize`` needs, resets its peak resident
memory (``VmHWM``; Linux), builds its stage from the directory, and records the rise of its peak
during ``initialize`` against the bytes of the parameters it holds (its shard).  A ratio near 1
means the rank read and kept only its shard (safetensors ranges straight into the parameters); the
whole model would be ~4× a shard here.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.scale import _peak_mib, _reset_peak  # VmHWM read and reset, as the GPT-2 sizes measure

DESCRIPTION = "Qwen2.5-0.5B-shaped model: per-rank peak RSS rise while loading at TP×PP = 2×2 vs its shard"
SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def make_checkpoint(path: str) -> None:
    """A random Qwen2.5-0.5B-shaped ``save_pretrained`` directory at ``path`` (kept if present)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave lm_head its own storage: share the embedding again (saved once)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path)


def rank_run(model_dir: str, out: str) -> None:
    """One launcher rank: the peak RSS rise of ``ds_mp.initialize`` against the parameters kept."""
    import torch

    torch.set_num_threads(1)
    import importlib

    import ds_mp
    from ds_mp.engine.initialize import shutdown_distributed

    for module in ("deepspeed", "ds_mp.checkpoint.hf", "ds_mp.engine.pipeline_engine", "ds_mp.models.llama"):
        importlib.import_module(module)  # before the peak is reset: libraries, not the model's memory

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
           "ds_mp": {"model": model_dir, "tensor_parallel": {"size": 2}, "pipeline": {"stages": 2},
                     "data": {"seq_len": 128}}}
    base = _reset_peak()
    t0 = time.perf_counter()
    engine, *_ = ds_mp.initialize(config=cfg)
    seconds = time.perf_counter() - t0
    rise = _peak_mib() - base
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20
    rank = engine.topology.rank
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"rank": rank, "tp": engine.topology.tp_rank, "pp": engine.topology.pp_rank,
                   "peak_rise_mib": rise, "params_mib": params, "ratio": rise / params, "init_s": seconds}, f)
    shutdown_distributed(clean=True)


def run(quick: bool, out_dir: str) -> dict:
    cache = os.path.join(tempfile.gettempdir(), "ds_mp_qwen2.5-0.5b-shaped")
    make_checkpoint(cache)
    from transformers import Qwen2Config

    from ds_mp.models.llama import param_shapes

    whole = sum(math.prod(s) for s in param_shapes(Qwen2Config(**SHAPE)).values()) * 4 / 2**20  # fp32 model
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [launcher, "--num_gpus", "4", "--no_local_rank", "--master_port", "29533", "--module",
               "benchmarks.llama_scale", "--rank-run", cache, out]  # run from the repository root
        subprocess.run(cmd, check=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ranks = [json.load(open(os.path.join(out, f"r{r}.json"))) for r in range(4)]
    rows = [[r["rank"], f"tp{r['tp']} pp{r['pp']}", f"{r['params_mib']:.0f}", f"{r['peak_rise_mib']:.0f}",
             f"{r['ratio']:.2f}", f"{r['init_s']:.1f}"] for r in ranks]
    worst = max(r["ratio"] for r in ranks)
    return {"tables": [{"title": f"Qwen2.5-0.5B-shaped model ({whole:.0f} MiB of fp32 parameters), TP×PP = 2×2 "
                                 "via deepspeed",
                        "columns": ["rank", "coords", "shard MiB", "peak RSS rise MiB", "rise / shard", "init s"],
                        "rows": rows}],
            "summary": [f"worst rank's peak RSS rise while loading = {worst:.2f}× its shard "
                        f"(the whole model's {whole:.0f} MiB = {whole / max(r['params_mib'] for r in ranks):.1f}× "
                        "the largest shard; each end stage also holds half the tied 151936-row embedding)"],
            "ratios": {"worst_rise_over_shard": worst}, "ranks": ranks}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-run":
        rank_run(sys.argv[2], sys.argv[3])
    else:
        result = run(quick=False, out_dir="benchmarks/results")
        print(json.dumps(result, indent=1))
        os.makedirs("benchmarks/results", exist_ok=True)
        with open("benchmarks/results/llama_scale.json", "w") as f:
            json.dump(result, f, indent=1)
