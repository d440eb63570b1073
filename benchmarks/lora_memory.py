"""Per-rank optimizer-state memory of LoRA vs full fine-tuning at TP=2 (Adam, fp32).

    python -m benchmarks.lora_memory [--n-layer 12 --n-embd 768 --n-head 12 --vocab 50257]

Two spawned CPU ranks build the GPT-2 shape with ``ds_mp.initialize`` (TP=2), take one Adam
step, and sum the bytes of every tensor in ``engine.optimizer.state`` (exp_avg, exp_avg_sq, step)
plus the trainable parameters' gradients, with and without ``ds_mp.lora`` (r=8, c_attn/c_proj/c_fc).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _rank(rank: int, shape: dict, lora: dict | None) -> dict:
    import torch

    import ds_mp
    from helpers import batches

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "ds_mp": {"model": shape, "tensor_parallel": {"size": 2}, "data": {"seq_len": 32}}}
    if lora:
        cfg["ds_mp"]["lora"] = lora
    engine, *_ = ds_mp.initialize(config=cfg)
    engine.train_batch(iter(batches(1, 1, 32, shape["vocab_size"])))
    state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.module.parameters())
    return {"state_bytes": state, "trainable": trainable, "params": total}


def main() -> None:
    from dist_utils import run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    a = p.parse_args()
    shape = {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "vocab_size": a.vocab,
             "n_positions": 1024, "dropout": 0.0}
    full = run_ranks(_rank, 2, shape, None, timeout=600)
    lora = run_ranks(_rank, 2, shape, {"r": 8, "alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"]},
                     timeout=600)
    for r in range(2):
        f, lo = full[r], lora[r]
        print(f"rank {r}: params {f['params'] / 1e6:.2f} M; trainable full {f['trainable'] / 1e6:.2f} M, "
              f"LoRA {lo['trainable'] / 1e6:.3f} M; Adam state full {f['state_bytes'] / 2**20:.1f} MiB, "
              f"LoRA {lo['state_bytes'] / 2**20:.2f} MiB ({lo['state_bytes'] / f['state_bytes']:.4f}x)")


if __name__ == "__main__":
    main()
