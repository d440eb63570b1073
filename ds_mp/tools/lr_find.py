"""``ds-mp lr-find --config X.json``: LR range test on the config's model and data.

Runs on one process with the unmodified HF model (the LR does not depend on the
parallel layout): an exponential LR sweep with the config's optimizer type, smoothed
loss, stop on divergence; writes ``<output_dir>/lr_find.csv`` and ``lr_find.png`` and
prints the suggested LR.
"""
from __future__ import annotations

import argparse
import os

import torch


def lr_find_cli(argv: list[str] | None = None) -> int:
    from ds_mp.config import load_config, read_json
    from ds_mp.data import datasets_for
    from ds_mp.engine.optimizer import single_process_optimizer
    from ds_mp.models.family import inline_config
    from ds_mp.optim import lr_find

    p = argparse.ArgumentParser(prog="ds-mp lr-find", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--lr-min", type=float, default=1e-6)
    p.add_argument("--lr-max", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default=None, help="output dir (default: training.output_dir)")
    args = p.parse_args(argv)
    raw = read_json(args.config)
    cfg, raw = load_config(raw, world_size=cfg_world(raw))
    from transformers import AutoModelForCausalLM

    from ds_mp.data import ChunkSampler

    torch.manual_seed(cfg.training.seed)
    model = (AutoModelForCausalLM.from_pretrained(cfg.model) if isinstance(cfg.model, str)  # any family's directory
             else AutoModelForCausalLM.from_config(inline_config(cfg.shape))).train()
    _, train_ds, _ = datasets_for(cfg)
    micro = raw.get("train_micro_batch_size_per_gpu", 1) * raw.get("gradient_accumulation_steps", 1)
    sampler = ChunkSampler(train_ds, cfg.data.seq_len, micro, 1, 0, 1, cfg.data.seed)
    opt = single_process_optimizer(raw.get("optimizer", {}), model)

    def step(lr: float) -> float:
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = next(sampler)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    res = lr_find(step, args.lr_min, args.lr_max, args.steps)
    out = args.out or cfg.training.output_dir
    os.makedirs(out, exist_ok=True)
    res.save_csv(os.path.join(out, "lr_find.csv"))
    res.plot(os.path.join(out, "lr_find.png"))
    print(f"suggested lr {res.suggested_lr:.3g} (min-loss/10 rule: {res.min_div10_lr:.3g}); "
          f"diverged={res.diverged}; wrote {out}/lr_find.csv and lr_find.png")
    return 0


def cfg_world(raw: dict) -> int:
    """World size implied by the config (TP × PP); lr-find itself runs on one process."""
    block = raw.get("ds_mp", {})
    tp = block.get("tensor_parallel", {}).get("size", 1)
    pp = block.get("pipeline", {}).get("stages", 1)
    return tp * pp if isinstance(tp, int) and isinstance(pp, int) and tp * pp > 0 else 1
