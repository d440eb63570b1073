"""DPO through ``ds_mp.hf.DPOTrainer`` at TP = 2 and PP = 2 against plain ``trl.DPOTrainer`` under DDP at
the same world (2 CPU ranks, gloo, 1 thread each): step time and peak memory per rank.

    python -m benchmarks.dpo_trainer            (--quick: fewer steps)
    python -m benchmarks.run --only dpo_trainer (writes results/dpo_trainer.json and RESULTS.md)

The same script for the three: a GPT-2 shape (``SHAPE``) saved to a directory, TRL's preference pairs
(prompt 5-20 words, completions 20-60 words, ``max_length`` ``SEQ``), ``PAIRS`` pairs per micro-batch,
``GA`` micro-batches per step, AdamW, full fine-tune.  The reference is TRL's: under DDP a second full
model on every rank, one forward of it per micro-batch; under ds_mp the initial weights precomputed by
the engine when the trainer is built (its time is reported apart, ``precompute s``) and read with the
batch.  The global batch differs: DDP reads ``2 × PAIRS × GA`` pairs per step (two replicas), ds_mp at
TP2 or PP2 ``PAIRS × GA`` (one replica), so the figure compared is seconds per pair.  Step time = the
interval between successive ``on_step_end`` callbacks (the first step dropped).  Peak memory = each
rank's ``ru_maxrss`` at the end and its growth from just before the trainer was built (imports, the
interpreter and torch excluded).  The configurations run one after the other, in ``rounds`` rounds of
alternating order; the load average is recorded.
"""
from __future__ import annotations

import json
import os
import random
import resource
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import load_avg, machine, spawn_once, speedup, table

DESCRIPTION = "DPO step time and peak RSS per rank: ds_mp.hf.DPOTrainer TP2 / PP2 vs plain trl.DPOTrainer DDP, 2 ranks"
SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 2048}
PAIRS, GA, SEQ = 2, 2, 128
CONFIGS = {"trl_ddp": None, "ds_mp_tp2": {"tensor_parallel": {"size": 2}},
           "ds_mp_pp2": {"pipeline": {"stages": 2, "schedule": "1f1b"}}}


def _records(n: int) -> list[dict]:
    from launch.trl_sft import sentence

    rng = random.Random(0)
    return [{"prompt": sentence(rng, rng.randint(5, 20)), "chosen": " " + sentence(rng, rng.randint(20, 60)),
             "rejected": " " + sentence(rng, rng.randint(20, 60))} for _ in range(n)]


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, steps: int, name: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig

    if CONFIGS[name] is None:
        from trl import DPOTrainer
    else:
        from ds_mp.hf import DPOTrainer
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    ds = None if CONFIGS[name] is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0}, "ds_mp": CONFIGS[name]}
    replicas = world if ds is None else 1
    data = Dataset.from_list(_records(PAIRS * GA * replicas * steps))
    args = DPOConfig(output_dir=out, per_device_train_batch_size=PAIRS, gradient_accumulation_steps=GA,
                     max_steps=steps, learning_rate=1e-5, optim="adamw_torch", max_length=SEQ, logging_steps=1,
                     save_strategy="no", report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, deepspeed=ds)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    trainer = DPOTrainer(model=model_dir, args=args, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    built = time.perf_counter() - t0
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if trainer.args.world_size != world or not torch.distributed.is_initialized():  # DDP really ran on 2 ranks
        raise RuntimeError(f"{name}: world {trainer.args.world_size}, expected {world}")
    got = {"steps": [b - a for a, b in zip(ends, ends[1:])], "peak_mb": peak, "growth_mb": peak - base,
           "build_s": built, "pairs_per_step": PAIRS * GA * replicas, "world": trainer.args.world_size}
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump(got, f)


def run(quick: bool, out_dir: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from launch.trl_sft import tiny_tokenizer

    steps, rounds = (4, 1) if quick else (8, 2)
    got: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    loads = [load_avg()]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=SHAPE["n_layer"], n_embd=SHAPE["n_embd"], n_head=SHAPE["n_head"],
                                   vocab_size=SHAPE["vocab"], n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)).save_pretrained(model_dir)
        tiny_tokenizer().save_pretrained(model_dir)
        for r in range(rounds):
            for name in (list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]):
                out = os.path.join(tmp, f"{name}{r}")
                os.makedirs(out)
                spawn_once(_rank, 2, model_dir, out, steps, name, what=f"dpo_trainer {name}", timeout=1800)
                for rank in range(2):
                    with open(os.path.join(out, f"{name}-{rank}.json")) as f:
                        got[name].append({**json.load(f), "rank": rank})
        loads.append(load_avg())
    per_pair = {name: [t / g["pairs_per_step"] for g in runs if g["rank"] == 0 for t in g["steps"]]
                for name, runs in got.items()}
    median = {name: sorted(v)[len(v) // 2] for name, v in per_pair.items()}
    ratios = {name: speedup(per_pair[name], per_pair["trl_ddp"]) for name in CONFIGS if name != "trl_ddp"}
    rows = []
    for name, runs in got.items():
        peak = max(g["peak_mb"] for g in runs)
        growth = max(g["growth_mb"] for g in runs)
        build = max(g["build_s"] for g in runs)
        rows.append([name, runs[0]["pairs_per_step"], f"{median[name] * runs[0]['pairs_per_step']:.3f}",
                     f"{median[name]:.4f}", str(ratios.get(name, "1 (baseline)")), f"{peak:.0f}", f"{growth:.0f}",
                     f"{build:.1f}"])
    return {"tables": [table("DPO per step, 2 CPU ranks (full fine-tune; ds_mp's reference precomputed at build)",
                             ["configuration", "pairs per step", "median step s", "median s per pair",
                              "s per pair vs TRL DDP", "peak RSS MB (max rank)", "growth MB (max rank)",
                              "build s (incl. ds_mp precompute)"], rows)],
            "summary": [f"{name}: seconds per pair vs plain TRL DDP {r}" for name, r in ratios.items()] +
                       [f"1-min load {loads[0]:.1f} -> {loads[-1]:.1f}"],
            "ratios": {f"{name}_s_per_pair_over_trl_ddp": r.as_dict() for name, r in ratios.items()},
            "runs": got,
            "workload": f"GPT-2 {SHAPE['n_layer']} x {SHAPE['n_embd']}, vocab {SHAPE['vocab']}, {PAIRS} pairs x "
                        f"<= {SEQ} tokens per micro-batch, GA {GA}, AdamW, full fine-tune; 2 CPU ranks",
            "repeats": rounds, "steps_per_repeat": steps, "shape": {**SHAPE, "pairs": PAIRS, "ga": GA, "seq": SEQ},
            "machine": machine()}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "dpo_trainer", *sys.argv[1:]]))
