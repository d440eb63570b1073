"""The pictures in docs/img/, each made by a command, never by hand.

    python -m ds_mp.tools.docs_plots                     every plot
    python -m ds_mp.tools.docs_plots --only timelines    a subset: quickstart, finetune, timelines, benchmarks, sft
    python -m ds_mp.tools.docs_plots --rerun             train the quick start / fine-tune again first

* ``quickstart``: loss and validation loss of ``runs/quickstart/log.csv``, the run of
  ``scripts/quickstart.sh`` (``deepspeed --num_gpus 2 launch/train.py --deepspeed_config
  ds_configs/quickstart.json``, started here when the log is missing).
* ``finetune``: the quick start's exported model (``runs/quickstart/hf``) fine-tuned at TP = 2
  with ``ds_configs/finetune_tp2.json`` for 60 steps on this Python's ``email`` package,
  tokenised with the model's own tokenizer (``runs/docs_finetune``).
* ``timelines``: ``ds-mp timeline`` of the traces the benchmarks recorded
  (``benchmarks/results/timeline_*.json``, ``python -m benchmarks.run --only pipeline,terapipe,timelines``).
* ``sft``: one packed row of a small chat dataset (docs/sft.md): its documents, which tokens
  are targets, the restarting position ids and the block-diagonal attention they imply
  (:mod:`ds_mp.tools.sft_plot`).
* ``benchmarks``: the headline ratios of ``benchmarks/results/*.json`` with their 90 % intervals
  and targets (``python -m benchmarks.run``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMG = os.path.join(REPO, "docs", "img")
PLOTS = ("quickstart", "finetune", "timelines", "benchmarks", "sft")

# benchmarks/results/timeline_<name>.json -> docs/img/timeline_<name>.png, titled with n = the
# number of forwards on rank 0 read from the trace (micro-batches, or TeraPipe's token slices)
TIMELINES = {"1f1b": "1F1B, PP=2, M={n}", "gpipe": "GPipe, PP=2, M={n}",
             "terapipe": "TeraPipe, PP=2, 1 x 1024 tokens in {n} planned slices",
             "ouroboros": "Ouroboros, K=3 modules on 2 ranks, steady state"}

# (results file, interval key, label, target, higher is better)
HEADLINES = [
    ("tp", "ds_mp_tp2_vs_1x1", "TP=2 vs 1 process (tokens/s)", 1.80, True),
    ("tp", "ds_mp_tp2_vs_autotp", "TP=2 vs DeepSpeed AutoTP=2", 1.08, True),
    ("pipeline", "ds_mp_cost_vs_1x1", "PP=2 cost split vs 1 process", 1.55, True),
    ("pipeline", "ds_mp_cost_vs_deepspeed_parameters", "PP=2 cost split vs DeepSpeed's split", 1.05, True),
    ("terapipe", "terapipe_dp_vs_deepspeed_1f1b", "TeraPipe vs DeepSpeed 1F1B, 1 x 1024", 1.50, True),
    ("terapipe", "terapipe_dp_vs_best_uniform", "TeraPipe plan vs best uniform slicing", 1.05, True),
    ("ouroboros", "ouroboros_kept_m4_tokens_per_s_vs_sync_m1", "Ouroboros (kept graphs, M=4) vs sync PP=2", 1.50, True),
    ("ouroboros", "ouroboros_tokens_per_s_vs_sync_m1", "Ouroboros (features replay) vs sync PP=2", 1.50, True),
    ("scale", "medium_load_2x2_worst_rank_peak_rise", "GPT-2 medium 2x2 memory vs 1x1 (lower wins)", 0.35, False),
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _deepspeed() -> list[str]:
    """The launcher on a free port (a fixed one would collide with other jobs on the machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(port)]


def loss_png(run_dir: str, out_png: str, title: str) -> str:
    """Training and validation loss against the step, from ``<run_dir>/log.csv``."""
    from ds_mp.tools.viz import read_log

    cols = read_log(os.path.join(run_dir, "log.csv"))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for key, label, style in (("loss", "train", "-"), ("val_loss", "validation", "o--")):
        if cols.get(key):
            ax.plot(*zip(*cols[key]), style, label=label, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def _drop_checkpoints(run: str) -> None:
    """Retraining from scratch into ``run``: its old checkpoints go first (a run without --resume
    into a directory holding checkpoints is refused)."""
    import shutil

    shutil.rmtree(os.path.join(run, "checkpoints"), ignore_errors=True)


def quickstart(rerun: bool) -> list[str]:
    run = os.path.join(REPO, "runs", "quickstart")
    if rerun or not os.path.isfile(os.path.join(run, "log.csv")):
        _drop_checkpoints(run)
        _run([*_deepspeed(), "--num_gpus", "2", "launch/train.py", "--deepspeed_config", "ds_configs/quickstart.json"])
    return [loss_png(run, os.path.join(IMG, "quickstart_loss.png"),
                     "quick start: GPT-2 4 x 128 from scratch, PP=2 (scripts/quickstart.sh)")]


def finetune(rerun: bool) -> list[str]:
    base, run = os.path.join(REPO, "runs", "quickstart", "hf"), os.path.join(REPO, "runs", "docs_finetune")
    if not os.path.isdir(base):
        quickstart(rerun=True)
    if rerun or not os.path.isfile(os.path.join(run, "log.csv")):
        from ds_mp.data import prepare_data

        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "email", "**", "*.py"), recursive=True))
        data = os.path.join(run, "data")
        if os.path.isdir(data):
            import shutil

            shutil.rmtree(data)
        prepare_data(files, data, tokenizer=base, val_fraction=0.1, show_progress=False)
        _drop_checkpoints(run)
        _run([*_deepspeed(), "--num_gpus", "2", "launch/finetune.py", "--model", base, "--data", data,
              "--deepspeed_config", "ds_configs/finetune_tp2.json", "--steps", "60", "--output_dir", run])
    return [loss_png(run, os.path.join(IMG, "finetune_loss.png"),
                     "fine-tune: the quick start's model on the email package, TP=2")]


def timelines(rerun: bool) -> list[str]:
    from ds_mp.tools.viz import load_trace, timeline_png

    out = []
    for name, title in TIMELINES.items():
        trace = load_trace(os.path.join(REPO, "benchmarks", "results", f"timeline_{name}.json"))
        n = sum(instr.startswith("Forward") for instr, *_ in trace[min(trace)])
        png = os.path.join(IMG, f"timeline_{name}.png")
        timeline_png(trace, png, title.format(n=n))
        out.append(png)
    return out


def benchmarks(rerun: bool) -> list[str]:
    """Horizontal bars: each headline ratio with its interval; a black tick marks its target."""
    plt = _pyplot()
    rows = []
    for name, key, label, target, higher in HEADLINES:
        with open(os.path.join(REPO, "benchmarks", "results", f"{name}.json")) as f:
            iv = json.load(f)["intervals"][key]
        met = iv["lo"] >= target if higher else iv["hi"] <= target
        missed = iv["hi"] < target if higher else iv["lo"] > target
        rows.append((label, iv["value"], iv["lo"], iv["hi"], target, "met" if met else "not met" if missed else "not shown"))
    colours = {"met": "#55A868", "not met": "#C44E52", "not shown": "#B0B0B0"}
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(rows) + 1.2))
    for y, (label, v, lo, hi, target, verdict) in enumerate(reversed(rows)):
        ax.barh(y, v, color=colours[verdict], xerr=[[v - lo], [hi - v]], capsize=3)
        ax.plot([target, target], [y - 0.4, y + 0.4], color="black", linewidth=2)
        ax.text(max(hi, target) + 0.03, y, f"{v:.2f}x [{lo:.2f}, {hi:.2f}]  {verdict}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in reversed(rows)], fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, max(max(r[3], r[4]) for r in rows) + 0.9)
    ax.set_xlabel("ratio (90 % bootstrap interval); black tick = target")
    ax.set_title("measured side by side on 2 CPU cores (benchmarks/results/*.json)", fontsize=9)
    fig.tight_layout()
    png = os.path.join(IMG, "benchmarks.png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [png]


def sft(rerun: bool) -> list[str]:
    from ds_mp.tools.sft_plot import packed_row_png

    return [packed_row_png(os.path.join(IMG, "sft_packed_row.png"), _pyplot())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_mp.tools.docs_plots", description="Regenerate docs/img/*.png.")
    p.add_argument("--only", default=",".join(PLOTS), help=f"comma-separated subset of {', '.join(PLOTS)}")
    p.add_argument("--rerun", action="store_true", help="train the quick start and the fine-tune again")
    args = p.parse_args(argv)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(PLOTS))
    if unknown:
        print(f"docs_plots: unknown plot(s) {', '.join(unknown)}; choose from {', '.join(PLOTS)}", file=sys.stderr)
        return 2
    os.makedirs(IMG, exist_ok=True)
    makers = {"quickstart": quickstart, "finetune": finetune, "timelines": timelines, "benchmarks": benchmarks,
              "sft": sft}
    for name in PLOTS:
        if name in chosen:
            for png in makers[name](args.rerun):
                print(f"{os.path.relpath(png, REPO)}: {os.path.getsize(png) // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
