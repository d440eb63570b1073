"""Per-rank peak resident memory through ``ds_mp.hf.Trainer`` at TP2 × PP2 for a GPT-2-medium-shaped
checkpoint, against one process running the plain ``transformers.Trainer`` on it.

    python -m benchmarks.hf_trainer_memory            (--quick: a GPT-2-small shape)

Both runs: a checkpoint directory written once (fp32 safetensors, 24 layers × 1024, vocab 50257),
``Trainer(model=<directory>)`` for ds_mp (each rank reads only its shard; the Trainer's model stays on
the meta device) and ``from_pretrained`` for the plain Trainer, then two AdamW steps of 1 row × 64
tokens (weights, gradients and both Adam moments exist). Peak RSS = ``ru_maxrss`` of each process at
the end. Reported: the largest rank's peak / the single process's peak (target ≤ 0.40×).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from typing import Any

from benchmarks.common import load_avg, machine, spawn_once, table

DESCRIPTION = "per-rank peak RSS through ds_mp.hf.Trainer at TP2xPP2 vs one plain-Trainer process (GPT-2 medium)"
MEDIUM = {"n_layer": 24, "n_embd": 1024, "n_head": 16}
SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12}


def _args(out: str, deepspeed: Any = None) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                             max_steps=2, learning_rate=1e-5, optim="adamw_torch", save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, deepspeed=deepspeed)


def _data() -> list[dict]:
    import torch

    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0)).tolist()
    return [{"input_ids": r, "labels": r} for r in ids]


def _collate(batch: list[dict]) -> dict:
    import torch

    return {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from ds_mp.hf import Trainer

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 0},
          "ds_mp": {"tensor_parallel": {"size": 2}, "pipeline": {"stages": 2}, "data": {"seq_len": 64}}}
    Trainer(model=model_dir, args=_args(out, ds), train_dataset=_data(), data_collator=_collate).train()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(_peak_mib(), f)


def _single(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    Trainer(model=model, args=_args(out), train_dataset=_data(), data_collator=_collate).train()
    with open(os.path.join(out, "single.json"), "w") as f:
        json.dump(_peak_mib(), f)


def run(quick: bool, out_dir: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = SMALL if quick else MEDIUM
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(**shape, vocab_size=50257, n_positions=1024)).save_pretrained(model_dir)
        load0 = load_avg()
        spawn_once(_rank, 4, model_dir, tmp, what="ds_mp.hf ranks", timeout=1800)
        spawn_once(_single, 1, model_dir, tmp, what="plain Trainer", timeout=1800)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(4)]
        single = json.load(open(os.path.join(tmp, "single.json")))
    ratio = max(ranks) / single
    verdict = "met" if ratio <= 0.40 else "NOT met"
    return {"tables": [table(f"Peak RSS, GPT-2 {'small' if quick else 'medium'} shape, two AdamW steps",
                             ["process", "peak RSS MiB"],
                             [[f"ds_mp.hf TP2×PP2 rank {r}", f"{m:.0f}"] for r, m in enumerate(ranks)]
                             + [["plain Trainer, one process", f"{single:.0f}"]])],
            "summary": [f"largest rank / one process: {ratio:.2f}x (target <= 0.40x: {verdict}); "
                        f"load {load0:.1f} -> {load_avg():.1f}"],
            "ratios": {"rank_over_single_rss": ratio}, "ranks_mib": ranks, "single_mib": single, "shape": shape,
            "machine": machine()}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "hf_trainer_memory", *sys.argv[1:]]))
