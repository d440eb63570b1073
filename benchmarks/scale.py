"""Real GPT-2 sizes: per-rank memory and time of building or loading at TP × PP = 2 × 2 and
1 × 4 against 1 × 1, and the memory of ``ds-mp convert``.

Random checkpoints with GPT-2's real shapes (small 124M: 12 × 768, medium 355M: 24 × 1024,
vocab 50257, 1024 positions) are written with ``save_pretrained`` (no downloads).  Per
configuration and rank, in a fresh process: the rise of peak resident memory (``VmHWM``
after resetting it; Linux) during ``ds_mp.initialize`` — from the HF directory ("load") and
from the config alone ("fresh": each rank initialises only its shards) — the bytes of
parameters it holds, the seconds to initialize and to run the first training step (one
micro-batch of 1 × 128 tokens).  The libraries ``initialize`` uses (torch, DeepSpeed,
transformers' GPT-2, ds_mp's engine) are imported before the peak is reset: their resident
memory (the "imports" column, ~125 MiB per process, the same at every layout) is not building
or loading the model.  Ratios are the worst rank's rise over the 1 × 1 run's, same mode, as
medians over ``ROUNDS`` runs of each layout with a bootstrap interval.
Issue target: at 2 × 2 each rank's peak rise while loading medium ≤ 0.35× of 1 × 1.
"""
from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from typing import Any

DESCRIPTION = "Real GPT-2 sizes: per-rank peak memory and time to build/load at 2×2 and 1×4 vs 1×1; convert memory"
TARGET = 0.35
SHAPES = {"small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
          "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16}}
LAYOUTS = [(1, 1), (2, 2), (1, 4)]
# what ds_mp.initialize imports: resident before any model is built, the same at every layout
IMPORTS = ("deepspeed", "transformers.models.gpt2", "ds_mp.engine.initialize", "ds_mp.engine.pipeline_engine",
           "ds_mp.checkpoint.hf", "ds_mp.optim.init")
ROUNDS = 2  # runs of each layout (quick: 1): the ratios' medians and intervals
VOCAB, POSITIONS, SEQ = 50257, 1024, 128


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_mib()


def _config(shape: dict, tp: int, pp: int, fresh: bool) -> dict:
    block: dict[str, Any] = {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp}, "data": {"seq_len": SEQ}}
    if fresh:
        block["model"] = {**shape, "vocab_size": VOCAB, "n_positions": POSITIONS, "dropout": 0.0}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}, "ds_mp": block}


def _rank(rank: int, world: int, port: int, shape: dict, tp: int, pp: int, model_dir: str | None, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    base = _reset_peak()
    import ds_mp
    from ds_mp.engine.initialize import shutdown_distributed

    for module in IMPORTS:
        importlib.import_module(module)
    imports = _peak_mib() - base
    base = _reset_peak()  # count only what initialize adds
    t0 = time.perf_counter()
    engine, *_ = ds_mp.initialize(model=model_dir, config=_config(shape, tp, pp, model_dir is None))
    t_init = time.perf_counter() - t0
    rise = _peak_mib() - base
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20
    ids = torch.randint(0, VOCAB, (1, SEQ))
    t0 = time.perf_counter()
    engine.train_batch(iter([(ids, ids)]))
    t_step = time.perf_counter() - t0
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_rise_mib": rise, "params_mib": params, "imports_mib": imports,
                   "init_s": t_init, "first_step_s": t_step}, f)
    shutdown_distributed(clean=True)  # a gloo group left to exit-time destructors can abort a finished rank


def _spawn(shape: dict, tp: int, pp: int, model_dir: str | None) -> list[dict]:
    from benchmarks.common import spawn_once

    with tempfile.TemporaryDirectory() as out:
        spawn_once(_rank, tp * pp, shape, tp, pp, model_dir, out, what="scale ranks", timeout=1800)
        return [json.load(open(os.path.join(out, f"r{r}.json"))) for r in range(tp * pp)]


def _convert_peak(model_dir: str, out: str) -> dict:
    """Peak RSS rise (``VmHWM`` reset after the imports) of ``ds-mp convert hf-to-ds --tp 2 --pp 2``
    then ``ds-to-hf``, in a child process."""
    import subprocess
    import sys

    code = ("import json, time; from ds_mp.tools.cli import main; from ds_mp.checkpoint.hf import HFReader; "
            "from benchmarks.scale import _reset_peak, _peak_mib; "
            f"HFReader({model_dir!r}); base = _reset_peak(); t = time.perf_counter(); "  # imports done: the baseline
            f"assert main(['convert', 'hf-to-ds', {model_dir!r}, {out + '/ds'!r}, '--tp', '2', '--pp', '2']) == 0; "
            f"assert main(['convert', 'ds-to-hf', {out + '/ds'!r}, {out + '/back'!r}]) == 0; "
            "print(json.dumps({'rise_mib': _peak_mib() - base, 'seconds': time.perf_counter() - t}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(run.stdout.strip().splitlines()[-1])


def run(quick: bool, out_dir: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.common import speedup

    rows, ratios, intervals, summary = [], {}, {}, []
    rounds = 1 if quick else ROUNDS
    for name in (["small"] if quick else ["small", "medium"]):
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = os.path.join(tmp, "hf")
            model = GPT2LMHeadModel(GPT2Config(**shape, vocab_size=VOCAB, n_positions=POSITIONS))
            model.save_pretrained(model_dir)
            size_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
            del model
            conv = _convert_peak(model_dir, tmp)
            ratios[f"{name}_convert_rise_vs_model"] = conv["rise_mib"] / size_mib
            summary.append(f"{name} ({size_mib:.0f} MiB fp32): ds-mp convert hf→2×2→hf peak rise {conv['rise_mib']:.0f} "
                           f"MiB = {conv['rise_mib'] / size_mib:.2f}× the model, {conv['seconds']:.0f} s")
            for mode, src in (("load", model_dir), ("fresh", None)):
                worst: dict[tuple[int, int], list[float]] = {}
                for i in range(rounds):
                    for tp, pp in LAYOUTS:
                        res = _spawn(shape, tp, pp, src)
                        worst.setdefault((tp, pp), []).append(max(r["peak_rise_mib"] for r in res))
                        ref = worst[(1, 1)][i]
                        for r in res:
                            rows.append([name, mode, f"{tp}×{pp}", i + 1, r["rank"], f"{r['params_mib']:.0f}",
                                         f"{r['imports_mib']:.0f}", f"{r['peak_rise_mib']:.0f}",
                                         f"{r['peak_rise_mib'] / ref:.2f}×", f"{r['init_s']:.1f}",
                                         f"{r['first_step_s']:.1f}"])
                        print(f"  {name} {mode} {tp}×{pp} run {i + 1}: worst rank peak rise {worst[(tp, pp)][-1]:.0f} "
                              f"MiB ({worst[(tp, pp)][-1] / ref:.2f}× of 1×1)", flush=True)
                for tp, pp in LAYOUTS[1:]:
                    key = f"{name}_{mode}_{tp}x{pp}_worst_rank_peak_rise"
                    ratio = speedup(worst[(tp, pp)], worst[(1, 1)])  # median(worst at tp×pp) / median(1×1)
                    ratios[key], intervals[key] = ratio.value, ratio.as_dict()
                    if (tp, pp) == (2, 2):
                        summary.append(f"{name} {mode} 2×2: worst rank's peak rise {ratio} of 1×1 "
                                       f"(target ≤ {TARGET}: {ratio.verdict(TARGET, at_least=False)})")
    for line in summary:
        print("  " + line)
    return {"workload": f"GPT-2 {'small' if quick else 'small, medium'} shapes, vocab {VOCAB}, fp32, "
                        f"random weights via save_pretrained; first step 1×{SEQ} tokens; peak rise after imports",
            "repeats": rounds, "steps_per_repeat": 1, "ratios": ratios, "intervals": intervals, "summary": summary,
            "plots": [],
            "tables": [{"title": "per-rank memory and time to build/load (peak RSS rise during initialize, "
                                 "after the imports)",
                        "columns": ["model", "mode", "TP×PP", "run", "rank", "params MiB", "imports MiB",
                                    "peak rise MiB", "rise vs 1×1", "initialize s", "first step s"],
                        "rows": rows}]}
