"""The Ouroboros paper's experiments in small (Yang et al., NeurIPS 2019, Figs. 3-5), on the
embedded stdlib corpus with a tiny GPT-2; part of ``python -m benchmarks.run --only ouroboros``.

    curves      K = 2, 3, 4 modules on K − 1 ranks next to synchronous backprop on the same
                ranks (1F1B, PP = K − 1, one micro-batch): training loss vs tokens and vs wall
                time (paper Figs. 3/4)
    warm-up     K = 3 with {0, 50, 500} linear warm-up steps before cosine decay, at a high
                learning rate (paper Fig. 5a: without warm-up Ouroboros may diverge)
    dropout     K = 3 with dropout 0.1, the replay repeating its forward's masks or drawing
                fresh ones (``ouroboros.repeat_dropout``; paper Fig. 5b)
    lr          K = 3 at the paper's lr (2.5e-4) and at 4× it, synchronous vs Ouroboros with
                features replay (``recompute: "current"``) and with the forward's weights kept
                (``"none"``): how the delayed gradients' lag grows with the step size (not in the paper)

The paper's optimizer (§5): Adam, lr 2.5e-4, cosine decay; clipping 1 here.

Every run starts from the same weights and reads the same batches in the same order.  Wall
time on this 2-core machine is only indicative for K = 4 (3 ranks share 2 cores).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import spawn_once, table
from benchmarks.workloads import hf_model

SHAPE = {"n_layer": 6, "n_embd": 128, "n_head": 4, "vocab": 8192, "seq": 64, "n_positions": 64}
ROWS = 8
FULL = {"curve_steps": 300, "warmup_steps": 600, "dropout_steps": 300}
QUICK = {"curve_steps": 60, "warmup_steps": 120, "dropout_steps": 60}


def run_config(schedule: str, stages: int, steps: int, lr: float, warmup: int,
               ouroboros: dict | None = None) -> dict:
    """DeepSpeed JSON: AdamW, linear warm-up then cosine decay (the paper's schedule), clipping 1."""
    block: dict[str, Any] = {"pipeline": {"stages": stages, "schedule": schedule}, "data": {"seq_len": SHAPE["seq"]}}
    if schedule == "ouroboros":
        block["ouroboros"] = ouroboros or {}
    return {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupCosineLR", "params": {  # warm-up 0: start at the full rate
                "total_num_steps": steps, "warmup_num_steps": max(1, warmup), "warmup_min_ratio": 0.0 if warmup else 1.0,
                "warmup_type": "linear", "cos_min_ratio": 0.1}},
            "gradient_clipping": 1.0, "steps_per_print": 10**9, "ds_mp": block}


def _rank(rank: int, world: int, port: int, cfg: dict, steps: int, dropout: float, data: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import ds_mp
    from ds_mp.data import ChunkSampler, TokenDataset

    shape = {**SHAPE}
    model = hf_model(shape)
    if dropout:
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = dropout
        model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = dropout
    engine, *_ = ds_mp.initialize(model=model, config=cfg)
    sampler = ChunkSampler(TokenDataset(data, "train"), SHAPE["seq"], ROWS, seed=0)
    losses, clock, start = [], [], time.perf_counter()
    for _ in range(steps):
        (batch,) = sampler.next_step()
        losses.append(float(engine.train_batch(iter([batch]))))
        clock.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "seconds": clock}, f)
    from ds_mp.engine.initialize import shutdown_distributed

    shutdown_distributed(clean=True)  # a gloo group left to exit-time destructors can abort a finished rank


def train_curve(name: str, cfg: dict, world: int, steps: int, data: str, dropout: float = 0.0) -> dict:
    """Losses and elapsed seconds of one run (``world`` spawned ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curve.json")
        spawn_once(_rank, world, cfg, steps, dropout, data, out, what=name, timeout=1800)
        with open(out) as f:
            result = json.load(f)
    print(f"  {name}: final loss {_tail(result['losses']):.3f} in {result['seconds'][-1]:.0f} s", flush=True)
    return result


def _tail(losses: list[float], n: int = 10) -> float:
    """Mean of the last ``n`` training losses (NaN-safe: a diverged run reports inf)."""
    tail = losses[-n:]
    return float("inf") if any(x != x or x == float("inf") for x in tail) else sum(tail) / len(tail)


PAPER_LR, HIGH_LR = 2.5e-4, 1e-3


def delayed_adam(data: str, steps: int, lr: float, delays: tuple[int, ...] = (0, 1, 2)) -> dict[int, float]:
    """Plain delayed-gradient Adam without Ouroboros, one process: HF GPT-2 (``SHAPE``), the same
    batches, constant ``lr``; the update of step t uses the gradient computed at step t − d (the
    weights and batch of then); d = 0 is ordinary training.  Returns d -> the mean of the last 10
    losses.  Separates what delayed gradients cost under Adam from anything Ouroboros-specific."""
    from ds_mp.data import ChunkSampler, TokenDataset

    sampler = ChunkSampler(TokenDataset(data, "train"), SHAPE["seq"], ROWS, seed=0)
    batches = [sampler.next_step()[0] for _ in range(steps)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for d in delays:
            model = hf_model(SHAPE)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            queue: list[list[torch.Tensor]] = []
            losses = []
            for ids, labels in batches:
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                losses.append(loss.item())
                queue.append([p.grad for p in model.parameters()])
                if len(queue) > d:  # the first d steps have no gradient old enough: no update
                    for p, g in zip(model.parameters(), queue.pop(0)):
                        p.grad = g
                    opt.step()
            out[d] = _tail(losses)
    finally:
        torch.set_num_threads(threads)
    return out


def plot(path: str, curves: dict, warm: dict, drop: dict, lrs: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = ROWS * SHAPE["seq"]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    colors = {2: "#4C72B0", 3: "#C44E52", 4: "#55A868"}
    for (kind, K), r in curves.items():
        style = "-" if kind == "ouroboros" else ":"
        x = [(i + 1) * tokens for i in range(len(r["losses"]))]
        axes[0].plot(x, r["losses"], style, color=colors[K], linewidth=1, label=f"{kind} K={K}")
        axes[1].plot(r["seconds"], r["losses"], style, color=colors[K], linewidth=1, label=f"{kind} K={K}")
    axes[0].set(title="(Fig. 3) loss vs tokens", xlabel="training tokens", ylabel="training loss")
    axes[1].set(title="(Fig. 4) loss vs wall time", xlabel="seconds", ylabel="training loss")
    for w, r in warm.items():
        axes[2].plot(r["losses"], linewidth=1, label=f"warm-up {w} steps")
    axes[2].set(title="(Fig. 5a) K=3, warm-up ablation", xlabel="step", ylabel="training loss")
    for rep, r in drop.items():
        axes[3].plot(r["losses"], linewidth=1, label="repeated masks" if rep else "fresh masks")
    axes[3].set(title="(Fig. 5b) K=3, dropout 0.1", xlabel="step", ylabel="training loss")
    for (kind, lr), r in lrs.items():
        axes[4].plot(r["losses"], {"sync": ":", "current": "-", "none": "--"}[kind], linewidth=1,
                     color="#C44E52" if lr == HIGH_LR else "#4C72B0", label=f"{kind}, lr {lr:g}")
    axes[4].set(title="K=3: lr vs delayed gradients", xlabel="step", ylabel="training loss")
    for ax in axes:
        ax.legend(fontsize=7)
        top = min(12.0, max((max(l.get_ydata()) for l in ax.get_lines()), default=10.0))
        ax.set_ylim(None, top)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def experiments(quick: bool, out_dir: str, data: str) -> dict:
    """Run the three experiments; return a section for the ouroboros benchmark's result."""
    p = QUICK if quick else FULL
    n, lr = p["curve_steps"], PAPER_LR
    curves: dict[tuple[str, int], dict] = {}
    for K in (2, 3, 4):
        curves[("sync", K)] = train_curve(f"sync PP={K - 1}", run_config("1f1b", K - 1, n, lr, n // 10), K - 1, n, data)
        curves[("ouroboros", K)] = train_curve(f"ouroboros K={K}", run_config("ouroboros", K - 1, n, lr, n // 10),
                                               K - 1, n, data)
    nw, hot = p["warmup_steps"], 3e-3
    warm = {w: train_curve(f"ouroboros K=3 warm-up {w}", run_config("ouroboros", 2, nw, hot, w), 2, nw, data)
            for w in (0, nw // 12, 5 * nw // 6)}
    nd = p["dropout_steps"]
    drop = {rep: train_curve(f"ouroboros K=3 dropout, repeat={rep}",
                             run_config("ouroboros", 2, nd, lr, nd // 10, {"repeat_dropout": rep}), 2, nd, data,
                             dropout=0.1)
            for rep in (True, False)}
    lrs = {("sync", lr): curves[("sync", 3)], ("current", lr): curves[("ouroboros", 3)]}
    for rate in (lr, HIGH_LR):
        if rate != lr:
            lrs[("sync", rate)] = train_curve(f"sync PP=2 lr {rate:g}", run_config("1f1b", 2, n, rate, n // 10), 2, n, data)
            lrs[("current", rate)] = train_curve(f"ouroboros K=3 lr {rate:g}", run_config("ouroboros", 2, n, rate, n // 10),
                                                 2, n, data)
        lrs[("none", rate)] = train_curve(f"ouroboros K=3 recompute none lr {rate:g}",
                                          run_config("ouroboros", 2, n, rate, n // 10, {"recompute": "none"}), 2, n, data)
    path = plot(os.path.join(out_dir, "ouroboros_paper.png"), curves, warm, drop, lrs)
    delayed = {rate: delayed_adam(data, n // 2, rate) for rate in (lr, HIGH_LR)}
    rows = [[f"K={K}", f"{_tail(curves[('sync', K)]['losses']):.3f}", f"{_tail(curves[('ouroboros', K)]['losses']):.3f}",
             f"{_tail(curves[('ouroboros', K)]['losses']) / _tail(curves[('sync', K)]['losses']):.3f}",
             f"{curves[('sync', K)]['seconds'][-1] / curves[('ouroboros', K)]['seconds'][-1]:.2f}×"] for K in (2, 3, 4)]
    summary = [f"paper Fig. 3/4 in small ({n} steps): final loss Ouroboros/sync "
               + ", ".join(f"K={K} {r[3]}" for K, r in zip((2, 3, 4), rows)),
               "paper Fig. 5a in small (K=3, lr 3e-3): final loss by warm-up steps "
               + ", ".join(f"{w}: {_tail(r['losses']):.3f}" for w, r in warm.items()),
               "paper Fig. 5b in small (K=3, dropout 0.1): final loss repeated masks "
               f"{_tail(drop[True]['losses']):.3f}, fresh masks {_tail(drop[False]['losses']):.3f}",
               "K=3, final loss Ouroboros/sync by lr: " + "; ".join(
                   f"lr {rate:g}: current {_tail(lrs[('current', rate)]['losses']) / _tail(lrs[('sync', rate)]['losses']):.3f}, "
                   f"none {_tail(lrs[('none', rate)]['losses']) / _tail(lrs[('sync', rate)]['losses']):.3f} "
                   f"(sync {_tail(lrs[('sync', rate)]['losses']):.3f})" for rate in (lr, HIGH_LR)),
               f"plain Adam with d-step-old gradients (one process, constant lr, {n // 2} steps), final loss by d: "
               + "; ".join(f"lr {rate:g}: " + ", ".join(f"d={d} {v:.3f}" for d, v in r.items())
                           for rate, r in delayed.items())]
    for line in summary:
        print("  " + line)
    return {"summary": summary, "plots": [os.path.basename(path)],
            "raw": {"curves": {f"{k}_K{K}": v for (k, K), v in curves.items()}, "warmup": warm,
                    "dropout": {str(k): v for k, v in drop.items()},
                    "lr": {f"{kind}_lr{rate:g}": v for (kind, rate), v in lrs.items()},
                    "delayed_adam": {f"lr{rate:g}": {str(d): v for d, v in r.items()} for rate, r in delayed.items()}},
            "tables": [table(f"paper experiments in small: GPT-2 {SHAPE['n_layer']}×{SHAPE['n_embd']}, "
                             f"{ROWS}×{SHAPE['seq']} tokens per step, AdamW + warm-up + cosine",
                             ["modules", "sync final loss", "Ouroboros final loss", "Ouroboros / sync",
                              "wall time sync / Ouroboros"], rows)]}
