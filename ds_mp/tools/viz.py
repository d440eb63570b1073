"""Pictures of a run: pipeline timelines (Chrome trace + Gantt PNG) and training curves.

    ds-mp timeline TRACE.json --out timeline.png [--title T]   Gantt chart, bubble fractions
    ds-mp plot RUN_DIR [--out curves.png]                      loss / val loss / tokens/s / LR

A trace is what :class:`ds_mp.engine.pipeline_engine.DsMpPipelineEngine` records with
``engine.record_trace()``: per rank a list of ``(instruction, buffer_id, start, end)``
in ``time.perf_counter()`` seconds.  :func:`gather_trace` (from :mod:`ds_mp.training.trace`, re-exported here) collects every rank's list on
rank 0, :func:`write_chrome_trace` writes it as Chrome-trace JSON (open it in
https://ui.perfetto.dev or chrome://tracing), :func:`timeline_png` draws it.

Bubble accounting (the simulator's definition, :mod:`ds_mp.schedules.simulate`): with
makespan T = last end − first start over all ranks and compute_r = Σ forward + backward
time on rank r,

    busy_r = compute_r / T,   bubble_r = 1 − busy_r,   bubble = 1 − Σ_r compute_r / (K · T).

Sends, receives (which block while waiting), loads and the optimizer step count as bubble.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from ds_mp.training.metrics import COMPUTE_KINDS, instruction_kind
from ds_mp.training.trace import Trace, chrome_trace, event_label, gather_trace, write_chrome_trace

# instruction kind -> colour of its bars
KIND_COLOURS: dict[str, str] = {"forward": "#4C72B0", "backward": "#DD8452", "comm": "#B0B0B0",
                                "optimizer": "#55A868", "other": "#8172B3"}


# ------------------------------------------------------------------ reading

def load_trace(trace: str | dict) -> dict[int, Trace]:
    """``{rank: trace}`` (seconds) from a Chrome-trace path/dict or an already-raw dict."""
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    if "traceEvents" not in trace:
        return {int(r): list(tr) for r, tr in trace.items()}
    out: dict[int, Trace] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        args = ev.get("args", {})
        start = ev["ts"] / 1e6
        out.setdefault(int(ev["pid"]), []).append(
            (args.get("instruction", ev["name"]), int(args.get("buffer_id", -1)), start, start + ev["dur"] / 1e6))
    return out


# ------------------------------------------------------------------ bubble accounting

def bubble_stats(traces: dict[int, Trace]) -> dict:
    """Makespan, per-rank compute / busy / bubble and the overall bubble (module docstring)."""
    spans = [(s, e) for tr in traces.values() for _, _, s, e in tr]
    if not spans:
        raise ValueError("empty trace: call engine.record_trace() before the step you want to record")
    makespan = max(e for _, e in spans) - min(s for s, _ in spans)
    ranks = {}
    for rank, tr in sorted(traces.items()):
        compute = sum(e - s for n, _, s, e in tr if instruction_kind(n) in COMPUTE_KINDS)
        busy = compute / makespan if makespan > 0 else 0.0
        ranks[rank] = {"compute_s": compute, "busy": busy, "bubble": 1.0 - busy}
    total = sum(r["compute_s"] for r in ranks.values())
    bubble = 1.0 - total / (len(ranks) * makespan) if makespan > 0 else 0.0
    return {"makespan_s": makespan, "ranks": ranks, "bubble": bubble}


# ------------------------------------------------------------------ Gantt chart

def timeline_png(trace: str | dict, out_png: str, title: str = "pipeline timeline") -> dict:
    """Gantt chart of a trace: one row per rank (rank 0 on top), a colour per instruction
    kind, gaps are bubbles.  Prints and returns :func:`bubble_stats`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traces = load_trace(trace)
    stats = bubble_stats(traces)
    t0 = min(s for tr in traces.values() for _, _, s, _ in tr)
    ranks = sorted(traces)
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.6))
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for name, buf, start, end in traces[rank]:
            kind = instruction_kind(name)
            x, w = (start - t0) * 1e3, (end - start) * 1e3
            chunk = name.partition("@")[2].rpartition(".")[2]  # interleaved: odd local chunks lighter
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=KIND_COLOURS[kind], edgecolor="white",
                           linewidth=0.3, alpha=0.6 if chunk and int(chunk) % 2 else 1.0)
            if kind in COMPUTE_KINDS and w > 0.025 * stats["makespan_s"] * 1e3:
                ax.text(x + w / 2, y, event_label(name, buf), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}\nbubble {stats['ranks'][r]['bubble']:.0%}" for r in reversed(ranks)])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, stats["makespan_s"] * 1e3)
    ax.set_title(f"{title} — bubble {stats['bubble']:.1%}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12), ncol=len(KIND_COLOURS), frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    for rank in ranks:
        r = stats["ranks"][rank]
        print(f"rank {rank}: busy {r['busy']:.1%}  bubble {r['bubble']:.1%}")
    print(f"makespan {stats['makespan_s'] * 1e3:.1f} ms  bubble fraction {stats['bubble']:.1%}  -> {out_png}")
    return stats


def timeline_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ds-mp timeline", description="Gantt chart of a recorded pipeline trace.")
    p.add_argument("trace", help="Chrome-trace JSON (training.trace_steps writes <output_dir>/trace.json)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="pipeline timeline")
    args = p.parse_args(argv)
    if not os.path.isfile(args.trace):
        print(f"ds-mp timeline: {args.trace!r} not found; record one with "
              "'\"training\": {\"trace_steps\": [first, last]}' in the run's JSON",
              file=sys.stderr)
        return 2
    timeline_png(args.trace, args.out, args.title)
    return 0


# ------------------------------------------------------------------ training curves

def read_log(path: str) -> dict[str, list[tuple[int, float]]]:
    """``{column: [(step, value), ...]}`` from a ``log.csv``, skipping empty cells."""
    cols: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row["step"]))
            for key, val in row.items():
                if key != "step" and val not in ("", None):
                    cols.setdefault(key, []).append((step, float(val)))
    return cols


def plot_run(run_dir: str, out_png: str | None = None) -> str:
    """2×2 PNG from ``<run_dir>/log.csv``: loss + val loss, tokens/s, LR, gradient norm
    (each vs step).  Returns the PNG path (default ``<run_dir>/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = os.path.join(run_dir, "log.csv")
    if not os.path.isfile(log):
        raise FileNotFoundError(f"{log} not found; pass the training.output_dir of a ds_mp run")
    cols = read_log(log)
    out_png = out_png or os.path.join(run_dir, "curves.png")
    panels = [("loss", [("loss", "train"), ("val_loss", "validation")]),
              ("tokens/s", [("tokens_per_s", None)]), ("learning rate", [("lr", None)]),
              ("gradient norm", [("grad_norm", None)])]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, series) in zip(axes.flat, panels):
        for key, label in series:
            pts = cols.get(key, [])
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=label)
        if not any(cols.get(k) for k, _ in series):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if any(label for _, label in series):
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.abspath(run_dir))
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def plot_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ds-mp plot", description="Plot loss, val loss, tokens/s and LR of a run.")
    p.add_argument("run_dir", help="training.output_dir of a run (holds log.csv)")
    p.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/curves.png)")
    args = p.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except FileNotFoundError as e:
        print(f"ds-mp plot: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["gather_trace", "chrome_trace", "write_chrome_trace", "load_trace", "bubble_stats", "timeline_png",
           "timeline_cli", "plot_run", "plot_cli", "instruction_kind", "event_label"]
