"""Ouroboros (K=3 modules on 2 ranks) vs synchronous model parallelism on the same 2 ranks.

Configurations (same GPT-2 init, same batches in the same order, same AdamW + warm-up LR
and gradient clipping, so the same token budget; 2 ranks × 1 thread each):

    sync_m1      ds_mp 1F1B, PP=2, one micro-batch of R rows per step: plain synchronous model
                 parallelism, the ranks take turns                          (the baseline)
    sync_m4      ds_mp 1F1B, PP=2, 4 micro-batches of R/4 rows per step (same R rows, pipelined;
                 the same update as sync_m1 up to fp32 rounding)
    ouroboros    ds_mp Ouroboros, K=3 (rank 0: G_0 + G_2 with the tied embedding, rank 1: G_1),
                 R rows per step: delayed gradients, the ranks backprop in parallel
    ouroboros_m4 the same, the R rows read as 4 micro-batches: the locked forward is pipelined
                 over them (rank 0's head works on micro-batch j while rank 1 forwards j+1; the
                 same update as ``ouroboros`` up to fp32 rounding)
    ouroboros_kept  Ouroboros K=3 with ``recompute: "none"``: each delayed module keeps its
                 forward's graph (against a snapshot of its weights) until its delayed backward
                 instead of replaying the forward: weight stashing's maths without the replay
    ouroboros_kept_m4  the same with the R rows read as 4 pipelined micro-batches

Every step is a real training step on the embedded stdlib corpus
(``ds_mp.data.ensure_default_dataset``); the groups take turns round-robin, so a step's
time and the loss curve come from the same run.  After every round each group computes
the validation loss on the same held-out sequences (not timed).  Reported: tokens/s ratios
(median step time, each with a 90% bootstrap interval, judged by ``Ratio.verdict``: "met"
only when the interval clears the target), training loss vs tokens for all configurations in
one plot, the final validation loss ratio, and where the time goes per rank (the engines'
instruction traces).  Every configuration trains with the paper's optimizer and schedule:
Adam(W) at lr 2.5e-4 (the paper's §5), linear warm-up then cosine decay (DeepSpeed's
WarmupCosineLR), clipping 1.0.
Targets (issue #15): Ouroboros K=3 ≥ 1.5× the tokens/s of ``sync_m1`` (1.6× kept as a stretch
line); final validation loss within 3% of synchronous backprop at equal tokens.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.common import Config, Group, Ratio, summarize, table, tokens_ratio
from benchmarks.workloads import Bench, Shape, hf_model

DESCRIPTION = "Ouroboros K=3 on 2 ranks vs synchronous PP=2 (1 and 4 micro-batches): tokens/s, loss vs tokens"
SPEEDUP_TARGET, SPEEDUP_STRETCH, LOSS_TARGET = 1.5, 1.6, 1.03  # tokens/s vs sync_m1; final val loss vs sync_m1
LR, WARMUP, CLIP, MICRO_BATCHES = 2.5e-4, 10, 1.0, 4  # LR: the paper's (Adam, 2.5e-4, cosine)
FULL = {"shape": Shape(n_layer=6, n_embd=256, n_head=8, vocab=8192, seq=128, n_positions=128),
        "rows": 8, "rounds": 6, "steps": 12, "val_batches": 4}
QUICK = {"shape": Shape(n_layer=4, n_embd=128, n_head=4, vocab=8192, seq=64, n_positions=64),
         "rows": 8, "rounds": 2, "steps": 6, "val_batches": 2}


def dataset_path() -> str:
    from ds_mp.data import ensure_default_dataset

    return ensure_default_dataset()  # built once under ~/.cache/ds_mp, vocab 8192


def engine_config(shape: Shape, rows: int, schedule: str, micro_batches: int, total_steps: int = 100,
                  recompute: str = "current") -> dict:
    """DeepSpeed JSON for one configuration: AdamW (torch), the paper's linear warm-up then cosine
    decay to 0.1·lr over ``total_steps``, clipping 1.0, fp32."""
    block: dict[str, Any] = {"pipeline": {"stages": 2, "schedule": schedule}, "data": {"seq_len": shape.seq}}
    if schedule == "ouroboros":
        block["ouroboros"] = {"modules": 3, "recompute": recompute}
    return {"train_micro_batch_size_per_gpu": rows // micro_batches, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "scheduler": {"type": "WarmupCosineLR", "params": {
                "total_num_steps": total_steps, "warmup_num_steps": min(WARMUP, total_steps // 4),
                "warmup_min_ratio": 0.0, "warmup_type": "linear", "cos_min_ratio": 0.1}},
            "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False, "ds_mp": block}


class TrainBench(Bench):
    """One rank of a configuration; ``step()`` trains on the next R rows of the corpus (the same
    rows for every configuration: one sampler stream of R-row steps, cut into micro-batches)."""

    def __init__(self, rank: int, world: int, shape: dict, rows: int, schedule: str, micro_batches: int,
                 data: str, val_batches: int, total_steps: int = 100, recompute: str = "current") -> None:
        import ds_mp
        from ds_mp.data import ChunkSampler, TokenDataset, ValidationBatches

        s = Shape(**shape)
        self.engine, _, _, _ = ds_mp.initialize(model=hf_model(shape),
                                                config=engine_config(s, rows, schedule, micro_batches, total_steps,
                                                                     recompute))
        self.engine.trace_enabled = True  # a few perf_counter calls per instruction
        self.ouroboros = schedule == "ouroboros"
        self.micro_batches = micro_batches
        self.sampler = ChunkSampler(TokenDataset(data, "train"), s.seq, rows, seed=0)
        self.val = ValidationBatches(TokenDataset(data, "val"), s.seq, rows, val_batches)
        self.losses: list[float] = []

    def _split(self, batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(*(t.chunk(self.micro_batches) for t in batch)))

    def step(self) -> float:
        (batch,) = self.sampler.next_step()
        loss = float(self.engine.train_batch(iter(self._split(batch))))
        self.losses.append(loss)
        return loss

    def validate(self) -> float:
        """Mean loss over the validation batches with the current weights (every rank)."""
        losses = []
        self.engine.trace_enabled = False  # the breakdown is of training steps only
        for batch in self.val:  # the mean of equal-sized micro-batch means: the batch's mean loss
            losses.append(float(self.engine.eval_batch(iter(self._split(batch)))))
        self.engine.trace_enabled = True
        return sum(losses) / len(losses)

    def history(self) -> dict:
        """Training losses so far and this rank's seconds per instruction (whole run)."""
        return {"losses": self.losses, "instruction_s": self.engine.instruction_times()}


def setup_train(rank: int, world: int, **kwargs: Any) -> TrainBench:
    return TrainBench(rank, world, **kwargs)


def configs(quick: bool, data: str) -> list[Config]:
    p = QUICK if quick else FULL
    common = {"shape": asdict(p["shape"]), "rows": p["rows"], "data": data, "val_batches": p["val_batches"],
              "total_steps": p["rounds"] * p["steps"]}
    setup = "benchmarks.ouroboros:setup_train"
    return [*(Config(f"{name}_m{m}" if m > 1 or name == "sync" else name, setup, 2, 1,
                     {**common, "schedule": schedule, "micro_batches": m})
              for name, schedule in (("sync", "1f1b"), ("ouroboros", "ouroboros")) for m in (1, MICRO_BATCHES)),
            *(Config(f"ouroboros_kept{'' if m == 1 else f'_m{m}'}", setup, 2, 1,
                     {**common, "schedule": "ouroboros", "micro_batches": m, "recompute": "none"})
              for m in (1, MICRO_BATCHES))]


def train_side_by_side(cfgs: list[Config], rounds: int, steps: int) -> tuple[dict, dict, dict]:
    """Round-robin training (order rotates per round); validation after every round.
    Returns (step times per config, validation losses per config, histories per config)."""
    groups: list[Group] = []
    try:
        groups = [Group(c) for c in cfgs]
        for g in groups:
            g.wait_ready()
        times: dict[str, list] = {g.cfg.name: [] for g in groups}
        val: dict[str, list] = {g.cfg.name: [] for g in groups}
        for r in range(rounds):
            for g in groups[r % len(groups):] + groups[:r % len(groups)]:
                times[g.cfg.name] += g.steps(steps)
                val[g.cfg.name].append(g.call("validate")[0])
            print(f"  round {r + 1}/{rounds}: " + "  ".join(
                f"{n} {statistics.median(w for w, _ in t):.2f}s/step val {val[n][-1]:.3f}"
                for n, t in times.items()), flush=True)
        hist = {g.cfg.name: g.call("history") for g in groups}
    finally:
        for g in groups:
            g.close()
    return times, val, hist


def loss_plot(path: str, tokens_per_step: int, steps_per_round: int, hist: dict, val: dict,
              speed: dict[str, Ratio]) -> str:
    """Left: training loss (and validation points) vs tokens; right: tokens/s vs sync_m1 with
    90% intervals and the target lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    m4 = f"_m{MICRO_BATCHES}"
    colors = {"sync_m1": "#4C72B0", f"sync{m4}": "#55A868", "ouroboros": "#C44E52", f"ouroboros{m4}": "#DD8452",
              "ouroboros_kept": "#8172B3", f"ouroboros_kept{m4}": "#937860"}
    for name, h in hist.items():  # the _m4 runs dashed on top of their m1 twin: the same maths
        losses, wide, style = h[0]["losses"], 1.2 if name.endswith(m4) else 3.0, "--" if name.endswith(m4) else "-"
        x = [(i + 1) * tokens_per_step for i in range(len(losses))]
        ax.plot(x, losses, color=colors[name], alpha=0.3, linewidth=wide / 2, linestyle=style)
        ax.plot([(r + 1) * steps_per_round * tokens_per_step for r in range(len(val[name]))], val[name], "o",
                color=colors[name], label=f"{name} (validation)", markersize=5, linewidth=wide, linestyle=style)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (faint: training, dots: validation)")
    ax.set_title("loss vs tokens (same batches, same budget)")
    ax.legend()
    names = list(speed)
    values = [speed[n].value for n in names]
    errs = [[speed[n].value - speed[n].lo for n in names], [speed[n].hi - speed[n].value for n in names]]
    bars = bx.bar(range(len(names)), values, yerr=errs, capsize=4, color=[colors[n] for n in names])
    bx.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2)
    bx.axhline(SPEEDUP_TARGET, color="#C44E52", linestyle=":", label=f"target {SPEEDUP_TARGET:g}")
    bx.axhline(SPEEDUP_STRETCH, color="grey", linestyle=":", label=f"stretch {SPEEDUP_STRETCH:g}")
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels(names, fontsize=8)
    bx.set_ylim(0, max([*(speed[n].hi for n in names), SPEEDUP_STRETCH]) * 1.2)
    bx.set_title("tokens/s vs sync_m1 (90% interval)")
    bx.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


KINDS = {"forward": "forward", "backward": "backward", "p2p (incl. waiting)": "comm", "optimizer": "optimizer"}


def breakdown(hist: dict, total_steps: int) -> dict[str, list[dict[str, float]]]:
    """Per config, per rank: milliseconds per training step spent in each of KINDS (classified by
    ``ds_mp.training.metrics.instruction_kind``, the same for every schedule)."""
    from ds_mp.training.metrics import instruction_kind

    return {name: [{label: 1e3 * sum(t for n, t in h["instruction_s"].items() if instruction_kind(n) == kind)
                    / total_steps for label, kind in KINDS.items()} for h in per_rank]
            for name, per_rank in hist.items()}


def run(quick: bool, out_dir: str) -> dict:
    p = QUICK if quick else FULL
    shape, rows, rounds, steps = p["shape"], p["rows"], p["rounds"], p["steps"]
    cfgs = configs(quick, dataset_path())
    tokens, total_steps = rows * shape.seq, rounds * steps
    times, val, hist = train_side_by_side(cfgs, rounds, steps)
    res = summarize(times, {c.name: tokens for c in cfgs})
    m4 = f"_m{MICRO_BATCHES}"
    speed = {c.name: tokens_ratio(res, c.name, "sync_m1") for c in cfgs}
    final = {n: v[-1] for n, v in val.items()}
    loss = {n: final[n] / final["sync_m1"] for n in final}
    vs_m4 = tokens_ratio(res, f"ouroboros{m4}", f"sync{m4}")
    ratios = {f"{n}_tokens_per_s_vs_sync_m1": r.value for n, r in speed.items() if n != "sync_m1"}
    ratios.update({f"ouroboros{m4}_tokens_per_s_vs_sync{m4}": vs_m4.value,
                   **{f"{n}_final_val_loss_vs_sync_m1": loss[n] for n in loss if n != "sync_m1"}})
    intervals = {f"{n}_tokens_per_s_vs_sync_m1": r.as_dict() for n, r in speed.items() if n != "sync_m1"}
    intervals[f"ouroboros{m4}_tokens_per_s_vs_sync{m4}"] = vs_m4.as_dict()
    summary = []
    variants = ("ouroboros", f"ouroboros{m4}", "ouroboros_kept", f"ouroboros_kept{m4}")
    for n in variants:
        r, batches = speed[n], {"ouroboros": "one micro-batch", "ouroboros_kept": "one micro-batch, recompute none",
                                f"ouroboros_kept{m4}": f"{MICRO_BATCHES} pipelined micro-batches, recompute none"
                                }.get(n, f"{MICRO_BATCHES} pipelined micro-batches")
        summary.append(f"Ouroboros K=3 ({batches}) tokens/s vs synchronous PP=2, one micro-batch: {r} "
                       f"(target ≥ {SPEEDUP_TARGET}×: {r.verdict(SPEEDUP_TARGET)}; stretch ≥ {SPEEDUP_STRETCH}×: "
                       f"{r.verdict(SPEEDUP_STRETCH)})")
    summary.append(f"Ouroboros K=3 vs 1F1B, both with {MICRO_BATCHES} micro-batches: {vs_m4}")
    for n in variants:
        summary.append(f"final validation loss (warm-up + cosine), {n} / sync_m1: {loss[n]:.3f} ({final[n]:.3f} vs "
                       f"{final['sync_m1']:.3f}; target ≤ {LOSS_TARGET}: {'met' if loss[n] <= LOSS_TARGET else 'NOT met'})")
    summary.append(f"sync{m4} / sync_m1 final validation loss: {loss[f'sync{m4}']:.4f} (same maths, fp32 rounding)")
    busy = breakdown(hist, total_steps)
    for n in variants:
        compute = [ms["forward"] + ms["backward"] + ms["optimizer"] for ms in busy[n]]
        summary.append(f"{n} compute per step: rank 0 (embedding, G_0, G_2, LM head) {compute[0]:.0f} ms, rank 1 "
                       f"(G_1) {compute[1]:.0f} ms, step {1e3 * res[n]['median_s']:.0f} ms"
                       + ("; delayed modules replay their forward (features replay), synchronous backprop does not"
                          if not n.startswith("ouroboros_kept")
                          else "; delayed modules keep their forward's graph (no replay)"))
    for line in summary:
        print("  " + line)
    plot = loss_plot(os.path.join(out_dir, "ouroboros.png"), tokens, steps, hist, val, speed)
    throughput = [[c.name, str(speed[c.name]), f"±{res[c.name]['iqr_rel']:.0%}",
                   f"{res[c.name]['cpu_s'] / res['sync_m1']['cpu_s']:.2f}×", f"{final[c.name]:.4f}",
                   f"{loss[c.name]:.3f}×"] for c in cfgs]
    for c in cfgs:
        res[c.name].update(val_losses=val[c.name], train_losses=hist[c.name][0]["losses"],
                           instruction_s=[h["instruction_s"] for h in hist[c.name]])
    from benchmarks.ouroboros_paper import experiments

    paper = experiments(quick, out_dir, dataset_path())
    summary += paper["summary"]
    return {"paper_experiments": paper["raw"],
            "workload": shape.describe().replace("SGD", "AdamW") + f", {rows} rows × {shape.seq} tokens per step, "
            f"{total_steps} steps ({total_steps * tokens:,} tokens) per configuration, embedded stdlib corpus",
            "configs": res, "ratios": ratios, "intervals": intervals, "summary": summary, "repeats": rounds,
            "steps_per_repeat": steps,
            "plots": [os.path.basename(plot), *paper["plots"]],
            "tables": [table("throughput and final validation loss (same tokens)",
                             ["config", "tokens/s vs sync_m1 [90% interval]", "step-time IQR", "CPU s/step vs sync_m1",
                              "final val loss", "val loss vs sync_m1"], throughput),
                       table("where the time goes (ms per step, per rank; p2p includes waiting for the peer; "
                             "Ouroboros runs G_2's forward inside its backward)",
                             ["config", "rank", *KINDS], [[n, str(r), *(f"{v:.0f}" for v in ms.values())]
                                                          for n, ranks in busy.items() for r, ms in enumerate(ranks)]),
                       *paper["tables"]]}
