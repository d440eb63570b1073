"""The noise-scale batch ramp against fixed batches, each at its best LR, through the training loop.

    nice -n 5 .venv/bin/python -m benchmarks.batch_ramp      # results/batch_ramp.{json,png} (~25 min, 2 cores)
    .venv/bin/python -m benchmarks.batch_ramp --quick         # a smoke run (results/quick/)
    .venv/bin/python -m benchmarks.batch_ramp --analyse benchmarks/results [--targets 6.5,6.2]   # table, plot again

Every run is ``ds_mp.training.loop.main`` (what ``launch/train.py`` runs) on a DeepSpeed JSON, on
2 gloo ranks spawned in-process (DP = 2, micro-batch 2): a fixed batch, or the JSON's
``ds_mp.batch_ramp`` block, so the ramp is the loop's own wiring (``BatchRamp``, ``LrScaling``,
DeepSpeed's ``set_train_batch_size``, the noise-scale probe), not a re-implementation.  A small
GPT-2 (2 × 64, vocabulary 8192) on the embedded corpus, 32-token samples, AdamW (β2 = 0.95) at
a constant LR, no dropout.  Protocol:

1. seed 0, LR sweeps: the fixed small batch (the ramp's ``start``) at ``lrs["small"]``; the
   noise-scale ramp (start -> at most ``max``, decided every 5 steps, ``lr_scaling`` "none") at
   the small batch's best LR × ``lrs["ramp"]``; B_simple := the median of the best ramp's logged
   noise scale over the last quarter of its samples, rounded to a size the layout takes; a fixed
   batch in between (``mid``), the fixed batch at B_simple and the fixed large batch (``max``),
   each at its own LR grid.  Best = lowest validation loss at the budget.
2. seeds 1 .. n−1 (model init and data order): every fixed batch at its best LR, and the ramp.

Every run trains the same ``budget`` of samples, up to its first validation pass at or past it
(a ramp in chunks through ``--resume``: its batch is known only as it goes; the resume is exact,
``tests/test_batch_ramp.py``); the loss at the budget interpolates between passes; validation
every ~``eval_every`` samples on the same 384 held-out sequences (``val_micro`` micro-batches per
rank).  Reported, mean [min, max] over seeds: the validation loss at the budget, and the tokens
and optimizer steps to reach each target validation loss (linear interpolation between passes;
"not reached" within the budget).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 8192, "n_positions": 64, "dropout": 0.0}
UNIT = 4  # micro-batch 2 × DP 2: the sizes a step can take
COLORS = {"fixed small": "C0", "fixed mid": "C4", "fixed B_simple": "C2", "fixed large": "C3"}
FULL = {"seq_len": 32, "micro": 2, "start": 4, "max": 128, "budget": 3072, "eval_every": 256, "val_micro": 96,
        "seeds": 3, "beta2": 0.95, "interval": 5, "first_chunk": 40, "targets": [7.0, 6.8, 6.6, 6.4, 6.2],
        "mid": 16,
        "lrs": {"small": [5e-4, 1e-3, 2e-3], "ramp": [1, 2], "mid": [1e-3, 2e-3, 4e-3],
                "bsimple": [1e-3, 2e-3, 4e-3, 8e-3],
                "large": [2e-3, 4e-3, 8e-3, 1.6e-2]}}
QUICK = {**FULL, "max": 32, "budget": 512, "eval_every": 128, "val_micro": 24, "seeds": 2, "first_chunk": 24,
         "mid": 8,
         "lrs": {"small": [2e-3], "ramp": [1], "mid": [2e-3], "bsimple": [2e-3, 4e-3], "large": [4e-3]}}


def ds_json(p: dict, seed: int, lr: float, batch: int, ramp: dict | None, out: str) -> dict:
    """The DeepSpeed JSON of one run: ``batch`` fixed, or the ramp's start with its block."""
    gas = batch // UNIT
    return {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, p["beta2"]], "weight_decay": 0.0,
                                                      "torch_adam": True}},
            "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "ds_mp": {"model": dict(MODEL), "data": {"seq_len": p["seq_len"], "seed": 1000 + seed},
                      "training": {"seed": seed, "output_dir": out, "log_interval": 1, "checkpoint_interval": 0,
                                   "export_hf": False, "eval_batches": p["val_micro"] // gas,  # the same val set
                                   "eval_interval": max(1, p["eval_every"] // batch) if ramp is None else 8},
                      **({"batch_ramp": ramp} if ramp else {})}}


def read_rows(out: str) -> list[dict]:
    """``log.csv`` of a run as rows with the samples consumed by the end of each step."""
    rows, samples = [], 0
    with open(os.path.join(out, "log.csv")) as f:
        for r in csv.DictReader(f):
            samples += int(r["batch_size"])
            rows.append({"step": int(r["step"]), "samples": samples, "batch": int(r["batch_size"]),
                         "lr": float(r["lr"]), "loss": float(r["loss"]),
                         "val_loss": float(r["val_loss"]) if r["val_loss"] else None,
                         "noise_scale": float(r["noise_scale"]) if r["noise_scale"] else None})
    return rows


def train(p: dict, work: str, rank: int, name: str, seed: int, lr: float, batch: int,
          ramp: dict | None = None) -> dict:
    """One run through ``loop.main`` on this rank (collective); a ramp in chunks until the budget."""
    import torch.distributed as dist

    from ds_mp.training import loop

    out = os.path.join(work, f"{name.replace(' ', '_')}-s{seed}-lr{lr:g}")
    path = f"{out}.rank{rank}.json"
    with open(path, "w") as f:
        json.dump(ds_json(p, seed, lr, batch, ramp, out), f)
    every = ds_json(p, seed, lr, batch, ramp, out)["ds_mp"]["training"]["eval_interval"]

    def passes(n: int) -> int:  # steps up to the next validation pass
        return every * math.ceil(n / every)

    t0, resume = time.time(), False
    steps = passes(math.ceil(p["budget"] / batch) if ramp is None else p["first_chunk"])
    while True:  # until a validation pass at or past the budget (val_at interpolates to the budget)
        if loop.main(["--deepspeed_config", path, "--steps", str(steps)] + ["--resume"] * resume):
            raise RuntimeError(f"batch_ramp: {name} seed {seed} lr {lr:g} failed")
        dist.barrier()  # rank 0's log is complete
        rows = read_rows(out)
        left = p["budget"] - rows[-1]["samples"]
        if left <= 0:
            break
        more = left / rows[-1]["batch"]  # steps at the current batch; it may still grow: at most 48 of them
        steps, resume = passes(steps + min(48, math.ceil(more))), True
    run = {"name": name, "seed": seed, "lr": lr, "batch": batch, "ramp": ramp, "rows": rows,
           "wall_s": round(time.time() - t0, 1)}
    if rank == 0:
        print(f"batch_ramp: {name} seed {seed} lr {lr:g}: {rows[-1]['step']} steps, val at budget "
              f"{val_at(rows, p['budget']):.4f} ({run['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return run


def measured_b_simple(rows: list[dict], p: dict) -> int:
    """The median logged B_simple over the last quarter of the budget, rounded to the nearest size
    whose micro-batches per rank divide ``val_micro`` (so every run validates on the same set)."""
    late = [r["noise_scale"] for r in rows if r["noise_scale"] and r["samples"] > 0.75 * p["budget"]]
    sizes = [UNIT * d for d in range(1, p["val_micro"] + 1) if p["val_micro"] % d == 0
             and p["start"] <= UNIT * d <= p["max"]]
    return min(sizes, key=lambda b: abs(b - statistics.median(late)))


def protocol(p: dict, work: str, rank: int) -> tuple[list[dict], dict]:
    """Every run of the experiment on this rank (see the module docstring); (runs, choices)."""
    def best(runs: list[dict]) -> dict:
        return min(runs, key=lambda r: val_at(r["rows"], p["budget"]))

    ramp = {"policy": "noise_scale", "start": p["start"], "max": p["max"], "interval": p["interval"],
            "lr_scaling": "none"}
    runs = [train(p, work, rank, "fixed small", 0, lr, p["start"]) for lr in p["lrs"]["small"]]
    lr_small = best(runs)["lr"]
    sweep = [train(p, work, rank, "noise-scale ramp", 0, lr_small * f, p["start"], ramp) for f in p["lrs"]["ramp"]]
    runs += sweep
    b_simple = measured_b_simple(best(sweep)["rows"], p)
    chosen = {"fixed small": (p["start"], lr_small), "noise-scale ramp": (p["start"], best(sweep)["lr"])}
    for name, batch, lrs in (("fixed mid", p["mid"], p["lrs"]["mid"]),
                             ("fixed B_simple", b_simple, p["lrs"]["bsimple"]),
                             ("fixed large", p["max"], p["lrs"]["large"])):
        sweep = [train(p, work, rank, name, 0, lr, batch) for lr in lrs]
        runs += sweep
        chosen[name] = (batch, best(sweep)["lr"])
    for seed in range(1, p["seeds"]):
        for name, (batch, lr) in chosen.items():
            runs.append(train(p, work, rank, name, seed, lr, batch, ramp if "ramp" in name else None))
    return runs, {"b_simple": b_simple, "chosen": {k: {"batch": b, "lr": lr} for k, (b, lr) in chosen.items()}}


def _worker(rank: int, world: int, port: int, p: dict, work: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_MP_TIMEOUT="900")
    import torch

    torch.set_num_threads(1)
    sys.stdout = open(os.path.join(work, f"rank{rank}.out"), "w")  # the loop's progress bars and lines
    runs, choices = protocol(p, work, rank)
    if rank == 0:
        with open(os.path.join(work, "runs.json"), "w") as f:
            json.dump({"runs": runs, **choices}, f)
    from ds_mp.engine.initialize import shutdown_distributed

    shutdown_distributed(clean=True)


# ------------------------------------------------------------------ analysis
def evals(rows: list[dict], budget: float = math.inf) -> list[dict]:
    """The validation passes up to the first at or past ``budget`` samples."""
    ev = []
    for r in rows:
        if r.get("val_loss") is not None and (not ev or ev[-1]["samples"] < budget):
            ev.append(r)
    return ev


def reach(rows: list[dict], target: float, budget: float = math.inf) -> tuple[float, float] | None:
    """(samples, steps) at which the validation loss first reaches ``target``: linear interpolation
    between the two validation passes around the crossing (the first pass itself if it is already
    there: an upper bound); None if it does not within ``budget``."""
    ev = evals(rows, budget)
    if ev and ev[0]["val_loss"] <= target:
        return ev[0]["samples"], ev[0]["step"]
    for a, b in zip(ev, ev[1:]):
        if b["val_loss"] <= target:
            f = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            got = a["samples"] + f * (b["samples"] - a["samples"]), a["step"] + f * (b["step"] - a["step"])
            return got if got[0] <= budget else None
    return None


def val_at(rows: list[dict], samples: float) -> float:
    """Validation loss at ``samples`` (linear interpolation between passes)."""
    ev = evals(rows)
    for a, b in zip(ev, ev[1:]):
        if b["samples"] >= samples:
            f = (samples - a["samples"]) / (b["samples"] - a["samples"])
            return a["val_loss"] + f * (b["val_loss"] - a["val_loss"])
    return ev[-1]["val_loss"]


def spread(xs: list[float | None]) -> dict:
    """Mean and [min, max] over seeds; any None (not reached) makes them None."""
    if not xs or any(x is None for x in xs):
        return {"mean": None, "min": None, "max": None, "values": xs}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "values": xs}


def analyse(report: dict, targets: list[float]) -> dict:
    """Per tuned configuration (its chosen LR, every seed): val loss at the budget, tokens and
    steps to each target; and the ramp's ratios to each fixed batch per seed (None: one of the
    two did not reach the target)."""
    p, chosen = report["params"], report["chosen"]
    final = {n: sorted((r for r in report["runs"] if r["name"] == n and r["lr"] == c["lr"]), key=lambda r: r["seed"])
             for n, c in chosen.items()}
    table = []
    for n, runs in final.items():
        row = {"run": n, "batch": chosen[n]["batch"], "lr": chosen[n]["lr"], "seeds": [r["seed"] for r in runs],
               "val_at_budget": spread([val_at(r["rows"], p["budget"]) for r in runs]), "to_target": {}}
        for t in targets:
            hit = [reach(r["rows"], t, p["budget"]) for r in runs]
            row["to_target"][str(t)] = {"tokens": spread([None if h is None else h[0] * p["seq_len"] for h in hit]),
                                        "steps": spread([None if h is None else h[1] for h in hit])}
        table.append(row)
    by = {r["run"]: r for r in table}
    ratios = {}
    for n in by:
        if n == "noise-scale ramp":
            continue
        for t in targets:
            for what in ("tokens", "steps"):
                a, b = by["noise-scale ramp"]["to_target"][str(t)][what], by[n]["to_target"][str(t)][what]
                ratios[f"ramp/{n} {what} to {t}"] = spread([None if x is None or y is None else x / y
                                                            for x, y in zip(a["values"], b["values"])])
    sweeps = {n: {f"{r['lr']:g}": val_at(r["rows"], p["budget"]) for r in report["runs"]
                  if r["name"] == n and r["seed"] == 0} for n in chosen}
    return {"targets": targets, "table": table, "ratios": ratios, "sweeps_val_at_budget": sweeps}


def markdown(report: dict) -> str:
    a = report["analysis"]

    def cell(d: dict, fmt: str, scale: float = 1.0) -> str:
        if d["mean"] is None:
            n = sum(v is not None for v in d["values"])
            return f"not reached ({n}/{len(d['values'])} seeds)" if n else "not reached"
        return f"{fmt.format(d['mean'] * scale)} [{fmt.format(d['min'] * scale)}, {fmt.format(d['max'] * scale)}]"

    head = " | ".join(f"tokens (k) / steps to {t}" for t in a["targets"])
    lines = [f"| run | batch | LR | val loss at the budget | {head} |", "|---" * (4 + len(a["targets"])) + "|"]
    for r in a["table"]:
        to = " | ".join(f"{cell(r['to_target'][str(t)]['tokens'], '{:.0f}', 1e-3)} / "
                        f"{cell(r['to_target'][str(t)]['steps'], '{:.0f}')}" for t in a["targets"])
        batch = f"{r['batch']} → ≤ {report['params']['max']}" if "ramp" in r["run"] else str(r["batch"])
        lines.append(f"| {r['run']} | {batch} | {r['lr']:g} | {cell(r['val_at_budget'], '{:.3f}')} | {to} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, a = report["params"], report["analysis"]
    fig, ((ax0, ax1), (ax2, ax3)) = plt.subplots(2, 2, figsize=(11, 8))
    for row in a["table"]:
        for r in report["runs"]:
            if r["name"] != row["run"] or r["lr"] != row["lr"]:
                continue
            ev = evals(r["rows"], p["budget"])
            kw = {"label": f"{row['run']} ({row['batch']})" if r["seed"] == 0 else None}
            color = COLORS.get(row["run"], "C1")
            ax0.plot([x["samples"] * p["seq_len"] / 1e3 for x in ev], [x["val_loss"] for x in ev], color=color, **kw)
            ax1.plot([max(x["step"], 1) for x in ev], [x["val_loss"] for x in ev], color=color, **kw)
            tr = [x for x in r["rows"] if x["samples"] - x["batch"] < p["budget"]]
            ax2.plot([x["samples"] * p["seq_len"] / 1e3 for x in tr], [x["batch"] for x in tr],
                     color=color, **kw)
        for t, mark in zip(a["targets"], "os^Dv"):
            d = row["to_target"][str(t)]
            if d["tokens"]["mean"] is not None:
                color = COLORS.get(row["run"], "C1")
                ax3.errorbar(d["tokens"]["mean"] / 1e3, d["steps"]["mean"], color=color, marker=mark,
                             xerr=[[(d["tokens"]["mean"] - d["tokens"]["min"]) / 1e3],
                                   [(d["tokens"]["max"] - d["tokens"]["mean"]) / 1e3]],
                             yerr=[[d["steps"]["mean"] - d["steps"]["min"]], [d["steps"]["max"] - d["steps"]["mean"]]])
    for t, mark in zip(a["targets"], "os^Dv"):
        ax3.plot([], [], "k" + mark, linestyle="none", label=f"val loss {t}")
    for ax in (ax0, ax1):
        ax.set_ylabel("validation loss")
        ax.set_ylim(top=min(ax.get_ylim()[1], 8.0))
    ax0.set_xlabel("tokens (thousands)")
    ax1.set_xlabel("optimizer steps")
    ax1.set_xscale("log")
    ax0.legend(fontsize=7)
    ax2.set_xlabel("tokens (thousands)")
    ax2.set_ylabel("global batch (samples)")
    ax2.set_yscale("log")
    ax3.set_xlabel("tokens to target (thousands)")
    ax3.set_ylabel("optimizer steps to target")
    ax3.set_yscale("log")
    ax3.legend(fontsize=7)
    fig.suptitle(f"noise-scale ramp vs fixed batches at their best LR ({len(a['table'][0]['seeds'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _write(report: dict, out_dir: str, targets: list[float]) -> int:
    report["analysis"] = analyse(report, targets)
    with open(os.path.join(out_dir, "batch_ramp.json"), "w") as f:  # the analysis readable, one line per run
        body = json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1)
        f.write(body[:-2] + ',\n "runs": [\n' + ",\n".join(json.dumps(r, separators=(",", ":"))
                                                          for r in report["runs"]) + "\n ]\n}\n")
    plot(report, os.path.join(out_dir, "batch_ramp.png"))
    print(json.dumps({k: report["analysis"][k] for k in ("ratios", "sweeps_val_at_budget")}, indent=1))
    print(f"B_simple measured: {report['b_simple']}")
    print(markdown(report))
    print(f"batch_ramp: {report.get('wall_s')} s; results in {out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (small budget and sweeps)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None, help="samples every run trains")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    ap.add_argument("--targets", default=None, help="comma-separated target validation losses")
    ap.add_argument("--analyse", metavar="DIR", default=None, help="redo the analysis of DIR/batch_ramp.json")
    args = ap.parse_args(argv)
    targets = None if args.targets is None else [float(x) for x in args.targets.split(",")]
    if args.analyse:
        with open(os.path.join(args.analyse, "batch_ramp.json")) as f:
            report = json.load(f)
        return _write(report, args.analyse, targets or report["params"]["targets"])
    import tempfile

    from benchmarks.common import machine, spawn_once

    p = dict(QUICK if args.quick else FULL)
    p.update({k: v for k, v in (("seeds", args.seeds), ("budget", args.budget)) if v})
    out_dir = args.out or os.path.join(HERE, "results", "quick" if args.quick else "")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        spawn_once(_worker, 2, p, work, what="batch_ramp ranks", timeout=4 * 3600)
        with open(os.path.join(work, "runs.json")) as f:
            got = json.load(f)
    report = {"params": p, "model": MODEL, "machine": machine(), "wall_s": round(time.time() - t0, 1),
              "command": " ".join(["python -m benchmarks.batch_ramp", *(sys.argv[1:] if argv is None else argv)]),
              "b_simple": got["b_simple"], "chosen": got["chosen"], "runs": got["runs"]}
    return _write(report, out_dir, targets or p["targets"])


if __name__ == "__main__":
    sys.exit(main())
