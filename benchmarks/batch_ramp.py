"""Batch-size ramps against fixed batches, in small: does the noise-scale ramp save tokens and steps?

    .venv/bin/python -m benchmarks.batch_ramp            # results/batch_ramp.{json,png} (~10 min on 2 idle cores)
    .venv/bin/python -m benchmarks.batch_ramp --quick    # a smoke run (results/quick/)
    options: --max N (large batch / ramp max, default 128), --cap N, --beta2 B (Adam), --seeds N,
             --only "noise-scale ramp,..." (ramp runs to keep; fixed runs always run), --out DIR

A small GPT-2 (2 × 64, vocab 8192) on the embedded corpus (the stdlib sources), 32-token samples,
2 gloo ranks (DP = 2, micro-batch 2), AdamW at a constant LR, trained with the training loop's own
batch-ramp wiring (``BatchRamp``, ``LrScaling``, DeepSpeed's ``set_train_batch_size``):

* fixed small batch (``start`` = 4 samples) and fixed large batch (``max``), the large one at the
  base LR and at the base LR × max/start (linear LR scaling);
* the linear ramp (start -> max over a third of the budget) and the noise-scale ramp (B_simple,
  measured every step, decided every 5), each with ``lr_scaling`` "none" and "linear";

each over 2 seeds (model init and data order).  Every run trains the ``budget`` (3072 samples);
per seed, the target is the best validation loss of a fixed-batch run at the budget, and every
run goes on (up to ``cap`` samples) until its validation loss reaches it.  Reported, with the
mean and [min, max] over seeds: tokens and optimizer steps to the target (linear interpolation
between validation passes every 256 samples; null = not within the cap), the issue's two ratios
(noise-scale ramp vs the fixed large batch in tokens, target <= 0.8; vs the fixed small batch in
steps, target <= 0.7), and the write-up's two observations: a ramp's early gain at constant LR
(validation loss at a quarter and half of the budget) and linear LR scaling's instability (the
largest rise of the training loss above its running minimum; divergence).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 8192, "n_positions": 64, "dropout": 0.0}
# budget: samples every run trains; cap: samples a run may go on for to reach the target
FULL = {"seq_len": 32, "micro": 2, "start": 4, "max": 128, "budget": 3072, "cap": 9216, "lr": 2e-3, "eval_every": 256,
        "seeds": 2, "beta2": 0.95}
QUICK = {"seq_len": 32, "micro": 2, "start": 4, "max": 16, "budget": 512, "cap": 1024, "lr": 2e-3, "eval_every": 128,
         "seeds": 1, "beta2": 0.95}


def runs(p: dict) -> dict[str, dict]:
    """name -> {"batch": fixed size or None, "ramp": batch_ramp block or None, "lr": base LR}."""
    lr, s, m = p["lr"], p["start"], p["max"]
    linear = {"policy": "linear", "start": s, "max": m, "ramp_samples": p["budget"] // 3, "interval": 1}
    noise = {"policy": "noise_scale", "start": s, "max": m, "interval": 5}
    return {
        "fixed small": {"batch": s, "ramp": None, "lr": lr},
        "fixed large": {"batch": m, "ramp": None, "lr": lr},
        "fixed large, linear LR": {"batch": m, "ramp": None, "lr": lr * m / s},
        "linear ramp": {"batch": None, "ramp": {**linear, "lr_scaling": "none"}, "lr": lr},
        "linear ramp, linear LR": {"batch": None, "ramp": {**linear, "lr_scaling": "linear"}, "lr": lr},
        "noise-scale ramp": {"batch": None, "ramp": {**noise, "lr_scaling": "none"}, "lr": lr},
        "noise-scale ramp, linear LR": {"batch": None, "ramp": {**noise, "lr_scaling": "linear"}, "lr": lr},
    }


def ds_json(p: dict, run: dict, seed: int) -> dict:
    """The DeepSpeed JSON of one run (the batch ramp block as a user writes it)."""
    micro, batch = p["micro"], run["batch"] or run["ramp"]["start"]
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": batch // (micro * 2),
           "optimizer": {"type": "AdamW", "params": {"lr": run["lr"], "betas": [0.9, p["beta2"]], "weight_decay": 0.0,
                                                     "torch_adam": True}},
           "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "ds_mp": {"model": dict(MODEL), "data": {"seq_len": p["seq_len"], "seed": 1000 + seed},
                     "training": {"seed": seed, "noise_scale_interval": 1}}}
    if run["ramp"]:
        cfg["ds_mp"]["batch_ramp"] = dict(run["ramp"])
    return cfg


def train_one(cfg: dict, p: dict, target: float | None) -> list[dict]:
    """One run on this rank (collective): the training loop's batch-ramp wiring, validated every
    ``eval_every`` samples; trains the ``budget``, then goes on until its validation loss reaches
    ``target`` (None: stop at the budget) or ``cap`` samples.  Rows: step, samples, batch, lr,
    loss, noise_scale, val_loss (on validation rows)."""
    import math

    import ds_mp
    from ds_mp.config import load_config
    from ds_mp.data import ChunkSampler, ValidationBatches, datasets_for
    from ds_mp.training.batch_ramp import BatchRamp, LrScaling
    from ds_mp.training.loop import evaluate
    from ds_mp.training.metrics import NoiseScaleProbe

    dcfg, raw = load_config(cfg, 2)
    _, train_ds, val_ds = datasets_for(dcfg)
    engine, *_ = ds_mp.initialize(config=raw)
    topo, micro, gas = engine.topology, p["micro"], engine.gradient_accumulation_steps()
    engine.noise_scale = probe = NoiseScaleProbe.from_config(dcfg, topo)
    ramp, scaling = BatchRamp.from_config(dcfg.batch_ramp, micro, topo.dp), LrScaling()
    sampler = ChunkSampler(train_ds, dcfg.data.seq_len, micro, gas, topo.dp_rank, topo.dp, dcfg.data.seed)
    val = ValidationBatches(val_ds, dcfg.data.seq_len, micro, 16, topo.dp_rank, topo.dp)
    rows, samples, step, next_eval = [], 0, 0, p["eval_every"]
    rows.append({"step": 0, "samples": 0, "val_loss": evaluate(engine, val, 16)})
    while samples < p["budget"] or (target is not None and rows[-1].get("val_loss", math.inf) > target
                                     and samples < p["cap"]):
        step += 1
        lr = engine.get_lr()[0]
        if ramp is not None:
            batch = ramp.before_step(step, probe.estimator)
            if batch != engine.train_batch_size():
                engine.set_train_batch_size(batch)
                sampler.set_grad_accum(engine.gradient_accumulation_steps())
            lr = scaling.apply(engine.optimizer.param_groups, ramp.lr_factor)[0]
        batch = engine.train_batch_size()
        loss = float(engine.train_batch(sampler))
        if ramp is not None:
            ramp.after_step()
        samples += batch
        row = {"step": step, "samples": samples, "batch": batch, "lr": lr, "loss": loss, "noise_scale": probe.value}
        if samples >= next_eval:
            row["val_loss"] = evaluate(engine, val, 16)
            next_eval += p["eval_every"]
        rows.append(row)
        if not math.isfinite(loss):
            row["diverged"] = True
            break
    return rows


def _worker(rank: int, port: int, jobs: list[tuple[str, int, dict]], p: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_MP_TIMEOUT="600")
    import torch

    torch.set_num_threads(1)
    results, targets = [], {}
    for name, seed, cfg in jobs:  # per seed the fixed runs first: the best one's final loss is the target
        t0 = time.time()
        rows = train_one(cfg, p, targets.get(seed))
        if name.startswith("fixed"):
            final = val_at(rows, p["budget"])
            targets[seed] = min(final, targets.get(seed, final))
        results.append({"name": name, "seed": seed, "rows": rows, "wall_s": round(time.time() - t0, 1)})
        if rank == 0:
            print(f"batch_ramp: {name} seed {seed}: {rows[-1]['step']} steps, final val "
                  f"{rows[-1].get('val_loss', float('nan')):.4f} ({time.time() - t0:.0f} s)", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    from ds_mp.engine.initialize import shutdown_distributed

    shutdown_distributed(clean=True)


def run_all(p: dict) -> list[dict]:
    """Every (run, seed) on one pair of gloo ranks, one after the other."""
    import torch.multiprocessing as mp

    from benchmarks.common import _free_port

    jobs = [(name, seed, ds_json(p, run, seed)) for seed in range(p["seeds"]) for name, run in runs(p).items()
            if not p.get("only") or name.startswith("fixed") or name in p["only"]]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        ctx, port = mp.get_context("spawn"), _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, jobs, p, out)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise RuntimeError(f"benchmark ranks failed: exit codes {[proc.exitcode for proc in procs]}")
        with open(out) as f:
            return json.load(f)




# ------------------------------------------------------------------ analysis
def reach(rows: list[dict], target: float) -> tuple[float, float] | None:
    """(samples, steps) at which the validation loss first reaches ``target``: linear interpolation
    between the two validation passes around the crossing; None if it never does."""
    evals = [r for r in rows if r.get("val_loss") is not None]
    for a, b in zip(evals, evals[1:]):
        if b["val_loss"] <= target:
            f = 1.0 if a["val_loss"] == b["val_loss"] else (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            f = min(1.0, max(0.0, f))
            return a["samples"] + f * (b["samples"] - a["samples"]), a["step"] + f * (b["step"] - a["step"])
    return None


def val_at(rows: list[dict], samples: float) -> float:
    """Validation loss at ``samples`` (linear interpolation between passes)."""
    evals = [r for r in rows if r.get("val_loss") is not None]
    for a, b in zip(evals, evals[1:]):
        if b["samples"] >= samples:
            f = (samples - a["samples"]) / (b["samples"] - a["samples"])
            return a["val_loss"] + f * (b["val_loss"] - a["val_loss"])
    return evals[-1]["val_loss"]


def max_rise(rows: list[dict]) -> float:
    """Largest rise of the validation loss above its running minimum (the same validation set for
    every run, so comparable across batch sizes, unlike the training loss of one small batch)."""
    lo, rise = float("inf"), 0.0
    for r in rows:
        if r.get("val_loss") is not None:
            rise, lo = max(rise, r["val_loss"] - lo), min(lo, r["val_loss"])
    return rise


def spread(xs: list[float | None]) -> dict:
    """Mean and [min, max] over seeds; None entries (never reached) make the mean None."""
    if not xs or any(x is None for x in xs):
        return {"mean": None, "min": None, "max": None, "values": xs}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "values": xs}


def analyse(results: list[dict], p: dict) -> dict:
    by = {}
    for r in results:
        by.setdefault(r["name"], {})[r["seed"]] = r["rows"]
    seeds = sorted({r["seed"] for r in results})
    fixed = [n for n in by if n.startswith("fixed")]
    final = {n: {s: val_at(by[n][s], p["budget"]) for s in seeds} for n in by}
    targets = {s: min(final[n][s] for n in fixed) for s in seeds}
    best = {s: min(fixed, key=lambda n: final[n][s]) for s in seeds}
    tokens, steps, rows = {}, {}, []
    for n in by:
        hit = [reach(by[n][s], targets[s]) for s in seeds]
        tokens[n] = spread([None if h is None else h[0] * p["seq_len"] for h in hit])
        steps[n] = spread([None if h is None else h[1] for h in hit])
        rows.append({"run": n, "final_val_loss": spread([final[n][s] for s in seeds]),
                     "tokens_to_target": tokens[n], "steps_to_target": steps[n],
                     "val_at_quarter": spread([val_at(by[n][s], p["budget"] / 4) for s in seeds]),
                     "val_at_half": spread([val_at(by[n][s], p["budget"] / 2) for s in seeds]),
                     "max_loss_rise": spread([max_rise(by[n][s]) for s in seeds]),
                     "diverged": [bool(by[n][s][-1].get("diverged")) for s in seeds],
                     "final_batch": [by[n][s][-1].get("batch") for s in seeds]})

    def ratio(a: str, b: str, what: dict) -> dict:
        """Per seed a / b; where b never reached the target, a / (b's whole run) is an upper bound
        (b would have needed more than it trained); None where a never reached it."""
        if a not in what or b not in what:
            return spread([])
        xs, bounds = [], []
        for s, x, y in zip(seeds, what[a]["values"], what[b]["values"]):
            last = by[b][s][-1]
            whole = last["samples"] * p["seq_len"] if what is tokens else last["step"]
            xs.append(None if x is None else x / (y if y is not None else whole))
            bounds.append(x is not None and y is None)
        return {**spread(xs), "upper_bound": bounds}

    checks = {
        "noise_tokens_vs_fixed_large": {**ratio("noise-scale ramp", "fixed large", tokens), "target": "<= 0.8"},
        "noise_steps_vs_fixed_small": {**ratio("noise-scale ramp", "fixed small", steps), "target": "<= 0.7"},
        "noise_linear_lr_tokens_vs_fixed_large": ratio("noise-scale ramp, linear LR", "fixed large", tokens),
        "noise_linear_lr_steps_vs_fixed_small": ratio("noise-scale ramp, linear LR", "fixed small", steps),
    }
    for key in ("noise_tokens_vs_fixed_large", "noise_steps_vs_fixed_small"):
        c, bound = checks[key], float(checks[key]["target"].split()[-1])
        c["met"] = None if c["max"] is None else c["max"] <= bound  # every seed within the target
    return {"targets": targets, "best_fixed": best, "rows": rows, "checks": checks}


# ------------------------------------------------------------------ plot
def plot(results: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    seed0 = [r for r in results if r["seed"] == 0]
    for r in seed0:
        ev = [x for x in r["rows"] if x.get("val_loss") is not None]
        tok = [x["samples"] * r["seq_len"] / 1e3 for x in ev]
        style = "--" if "linear LR" in r["name"] else "-"
        ax0.plot(tok, [x["val_loss"] for x in ev], style, label=r["name"])
        tr = [x for x in r["rows"] if "batch" in x]
        ax1.plot([x["samples"] * r["seq_len"] / 1e3 for x in tr], [x["batch"] for x in tr], style, label=r["name"])
        ns = [x for x in tr if x.get("noise_scale")]
        if r["name"] in ("noise-scale ramp", "fixed small", "fixed large"):
            ax2.plot([x["samples"] * r["seq_len"] / 1e3 for x in ns], [x["noise_scale"] for x in ns], label=r["name"])
    ax0.set_ylabel("validation loss")
    ax0.set_ylim(top=min(ax0.get_ylim()[1], 8.0))
    ax0.legend(fontsize=7)
    ax1.set_ylabel("global batch (samples)")
    ax2.set_ylabel("B_simple (samples, EMA)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    ax2.set_xlabel("tokens (thousands)")
    ax0.set_title("batch ramps vs fixed batches (seed 0; dashed: linear LR scaling)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(report: dict) -> str:
    """The results table (mean [min, max] over seeds) as Markdown."""
    def cell(d: dict, fmt: str, scale: float = 1.0) -> str:
        if d["mean"] is None:
            got = [v for v in d["values"] if v is not None]
            return f"not reached ({len(got)}/{len(d['values'])} seeds)" if got else "not reached"
        return f"{fmt.format(d['mean'] * scale)} [{fmt.format(d['min'] * scale)}, {fmt.format(d['max'] * scale)}]"

    lines = ["| run | val loss at the budget | tokens to target (k) | steps to target | val loss at ¼ / ½ budget "
             "| largest val-loss rise |", "|---|---|---|---|---|---|"]
    for r in report["analysis"]["rows"]:
        lines.append(f"| {r['run']} | {cell(r['final_val_loss'], '{:.3f}')} | "
                     f"{cell(r['tokens_to_target'], '{:.0f}', 1e-3)} | {cell(r['steps_to_target'], '{:.0f}')} | "
                     f"{r['val_at_quarter']['mean']:.2f} / {r['val_at_half']['mean']:.2f} | "
                     f"{r['max_loss_rise']['mean']:.2f} |")
    return "\n".join(lines)


def _rounded(x: Any) -> Any:
    """``x`` with every float to 6 significant digits (the per-step rows stay readable and small)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (small budget, one seed)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--max", type=int, default=None, help="the large batch and the ramps' max (default 128)")
    ap.add_argument("--cap", type=int, default=None, help="samples a run may train to reach the target")
    ap.add_argument("--beta2", type=float, default=None, help="Adam's beta2 (default 0.95)")
    ap.add_argument("--only", default="", help="comma-separated ramp runs (the fixed runs always run)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    ap.add_argument("--analyse", metavar="DIR", default=None,
                    help="recompute the analysis, table and plot of DIR/batch_ramp.json (no training)")
    args = ap.parse_args(argv)
    if args.analyse:
        with open(os.path.join(args.analyse, "batch_ramp.json")) as f:
            report = json.load(f)
        report["analysis"] = analyse(report["runs"], report["params"])
        return _write(report, args.analyse)
    p = dict(QUICK if args.quick else FULL)
    if args.seeds:
        p["seeds"] = args.seeds
    if args.beta2:
        p["beta2"] = args.beta2
    if args.max:
        p["max"] = args.max
    if args.cap:
        p["cap"] = args.cap
    p["only"] = [x.strip() for x in args.only.split(",") if x.strip()]
    from benchmarks.common import machine

    out_dir = args.out or os.path.join(HERE, "results", "quick" if args.quick else "")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    results = run_all(p)
    for r in results:
        r["seq_len"] = p["seq_len"]
    report = {"params": p, "model": MODEL, "machine": machine(), "wall_s": round(time.time() - t0, 1),
              "command": " ".join(["python -m benchmarks.batch_ramp", *(sys.argv[1:] if argv is None else argv)]),
              "analysis": analyse(results, p), "runs": results}
    return _write(report, out_dir)


def _write(report: dict, out_dir: str) -> int:
    """results JSON, plot and the printed table of ``report``."""
    results = report["runs"]
    with open(os.path.join(out_dir, "batch_ramp.json"), "w") as f:  # the analysis readable, one line per run
        body = json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1)
        f.write(body[:-2] + ',\n "runs": [\n' + ",\n".join(json.dumps(_rounded(r), separators=(",", ":")) for r in results)
                + "\n ]\n}\n")
    plot(results, os.path.join(out_dir, "batch_ramp.png"))
    print(json.dumps({k: report["analysis"][k] for k in ("targets", "checks")}, indent=1))
    print(markdown(report))
    print(f"batch_ramp: {report['wall_s']} s of training; results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
