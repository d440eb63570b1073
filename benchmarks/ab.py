"""Before/after: one configuration built from a base revision and from the working tree, side by side.

    python -m benchmarks.ab --base ae4dac5 --config tp [--rounds 8] [--quick] [--vocab 50257]

The base revision is checked out into a temporary ``git worktree``; two worker groups run the
same configuration, one importing ``ds_mp`` (and the benchmark's setup module) from that
checkout, the other from this tree, interleaved round-robin by :func:`benchmarks.common.interleave`
so drifts of a shared machine hit both alike.  Reported: the working tree's tokens/s and CPU
seconds per step over the base's, each a ratio of medians with its 90 % bootstrap interval (an
optimisation is shown only when the interval clears 1).  Results go to
``results/ab_<config>[_v<vocab>].json`` (``results/quick/`` with ``--quick``).

Configurations (the benchmark shapes of ``tp``, ``pipeline`` and ``terapipe``, fixed layouts so
both sides run the same split):

    tp         ds_mp TP=2, 4 × 256 tokens, GPT-2 8 × 512 (vocab 8192)
    pipeline   ds_mp 1F1B PP=2, blocks [5, 3], M=8 micro-batches of 2 × 256
    zb-h1      the same with ``"schedule": "zb-h1"``
    terapipe   ds_mp TeraPipe PP=2, blocks [5, 3], 1 × 1024 in 8 slices of 128
    interleaved  ds_mp interleaved 1F1B, v = 2, on ``benchmarks.schedules``' shape (GPT-2 6 × 256,
               vocab 4096, uniform split), M=8 micro-batches of 2 × 256
    ouroboros  ds_mp Ouroboros K = 3 on 2 ranks (rank 0: G_0 + G_2 with the tied embedding, rank 1:
               G_1; ``split`` "balanced", from the shape alone), ``benchmarks.ouroboros``' shape
               (GPT-2 6 × 256, vocab 8192), one micro-batch of 8 × 128 rows of the embedded corpus per
               step, AdamW + warm-up/cosine LR, clipping 1.0 (``benchmarks.ouroboros.engine_config``)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, machine, run_side_by_side, speedup, summarize, tokens_ratio

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_tree(rank: int, world: int, root: str, target: str, **kwargs: Any) -> Any:
    """Worker setup: import ``ds_mp`` and ``target``'s module from ``root``, then call ``target``.

    The harness itself (``benchmarks.common``, this module) stays the working tree's; every
    other ``ds_mp`` / ``benchmarks`` module is dropped first so nothing of the other tree leaks in."""
    sys.path.insert(0, root)
    keep = {"benchmarks", "benchmarks.common", __name__}
    for name in [m for m in sys.modules if m == "ds_mp" or m.startswith(("ds_mp.", "benchmarks.")) and m not in keep]:
        del sys.modules[name]
    # the kept package must look for its other modules (the setups, workloads) in ``root`` too:
    # otherwise they came from the working tree and ran against the base's ds_mp
    sys.modules["benchmarks"].__path__ = [os.path.join(root, "benchmarks")]
    module, fn = target.split(":")
    setup = getattr(importlib.import_module(module), fn)
    import ds_mp

    if not os.path.abspath(ds_mp.__file__).startswith(os.path.abspath(root) + os.sep):
        raise RuntimeError(f"ds_mp imported from {ds_mp.__file__}, not from {root}")
    return setup(rank, world, **kwargs)


def workload(name: str, quick: bool, vocab: int | None = None) -> tuple[Config, int]:
    """The configuration ``name`` (run by both sides) and its tokens per step; ``vocab``
    replaces the shape's vocabulary (8192; GPT-2's own is 50257)."""
    from benchmarks import terapipe
    from benchmarks.workloads import shape_dict

    shape = {**shape_dict(quick), **({"vocab": vocab} if vocab else {})}
    defaults = {"model_type": "gpt2", "n_kv_head": 0, "intermediate_size": 0, "tie_word_embeddings": True}
    shape = {k: v for k, v in shape.items() if k not in defaults or defaults[k] != v}  # GPT-2 as older revisions spell it
    if name == "tp":
        rows = 4
        return Config(name, "benchmarks.workloads:setup_ds_mp", 2, 1, {"shape": shape, "micro": rows, "tp": 2}), \
            rows * shape["seq"]
    if name in ("pipeline", "zb-h1"):
        micro, gas = 2, 8
        return Config(name, "benchmarks.pipeline:setup_ds_mp_pipe", 2, 1,
                      {"shape": shape, "micro": micro, "gas": gas, "pp": 2, "partition": [5, 3] if not quick else [2, 2],
                       "schedule": "1f1b" if name == "pipeline" else name}), \
            micro * gas * shape["seq"]
    if name == "terapipe":
        tshape = {**asdict(terapipe.QUICK if quick else terapipe.FULL), **({"vocab": vocab} if vocab else {})}
        n = 8
        return Config(name, "benchmarks.terapipe:setup_schedule_bench", 2, 1,
                      {"shape": tshape, "micro": 1, "slices": [tshape["seq"] // n] * n,
                       "partition": [5, 3] if not quick else [2, 2]}), tshape["seq"]
    if name == "interleaved":
        from benchmarks import schedules

        sshape, micro, gas = asdict(schedules.QUICK if quick else schedules.FULL), 2, 8
        return Config(name, "benchmarks.schedules:setup_sched", 2, 1,
                      {"shape": sshape, "micro": micro, "gas": gas, "schedule": "interleaved",
                       "pipeline": {"virtual_stages": 2}}), micro * gas * sshape["seq"]
    if name == "ouroboros":
        from benchmarks import ouroboros

        p = ouroboros.QUICK if quick else ouroboros.FULL
        oshape = {k: v for k, v in {**asdict(p["shape"]), **({"vocab": vocab} if vocab else {})}.items()
                  if k not in defaults or defaults[k] != v}
        return Config(name, "benchmarks.ouroboros:setup_train", 2, 1,
                      {"shape": oshape, "rows": p["rows"], "schedule": "ouroboros", "micro_batches": 1,
                       "data": ouroboros.dataset_path(), "val_batches": 1, "total_steps": 100}), p["rows"] * oshape["seq"]
    raise SystemExit(f"unknown --config {name!r}: tp, pipeline, zb-h1, terapipe, interleaved or ouroboros")


def compare(base: str, name: str, rounds: int, steps: int, quick: bool, vocab: int | None = None) -> dict:
    cfg, tokens = workload(name, quick, vocab)
    tree = tempfile.mkdtemp(prefix="ds_mp_ab_")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", tree, base], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
        sides = [Config(f"base_{rev}", f"{__name__}:in_tree", cfg.ranks, cfg.threads,
                        {"root": tree, "target": cfg.setup, **cfg.kwargs}),
                 Config("working_tree", f"{__name__}:in_tree", cfg.ranks, cfg.threads,
                        {"root": HERE, "target": cfg.setup, **cfg.kwargs})]
        times, _ = run_side_by_side(sides, rounds, steps)
    finally:
        subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(tree, ignore_errors=True)
    res = summarize(times, {s.name: tokens for s in sides})
    b, w = (res[s.name] for s in sides)
    speed = tokens_ratio(res, "working_tree", sides[0].name)
    cpu_ratio = speedup([c for _, c in times["working_tree"]], [c for _, c in times[sides[0].name]])  # tree / base
    summary = [f"{name}: working tree vs {base} ({rev}): tokens/s {speed} ({'faster' if speed.lo > 1 else 'slower' if speed.hi < 1 else 'no difference shown'}); "
               f"CPU s/step (all ranks) {cpu_ratio} ({'less' if cpu_ratio.hi < 1 else 'more' if cpu_ratio.lo > 1 else 'no difference shown'})",
               f"medians: step {b['median_s']:.3f} s -> {w['median_s']:.3f} s, CPU {b['cpu_s']:.3f} s -> {w['cpu_s']:.3f} s "
               f"(IQR ±{b['iqr_rel']:.0%} / ±{w['iqr_rel']:.0%}); {rounds} rounds × {steps} steps"]
    return {"config": name, "base": base, "base_commit": rev, "workload": cfg.kwargs, "configs": res,
            "tokens_per_s_ratio": speed.as_dict(), "cpu_s_ratio": cpu_ratio.as_dict(), "summary": summary,
            "machine": machine(), "command": " ".join(["python -m benchmarks.ab", *sys.argv[1:]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (e.g. HEAD~1, a commit)")
    ap.add_argument("--config", default="tp", help="tp, pipeline, zb-h1, terapipe, interleaved or ouroboros")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per group per round")
    ap.add_argument("--quick", action="store_true", help="the benchmarks' small shapes")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size instead of the shape's 8192")
    args = ap.parse_args()
    out = compare(args.base, args.config, args.rounds, args.steps, args.quick, args.vocab)
    for line in out["summary"]:
        print("  " + line)
    folder = os.path.join(HERE, "benchmarks", "results", *(["quick"] if args.quick else []))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"ab_{args.config}{f'_v{args.vocab}' if args.vocab else ''}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
