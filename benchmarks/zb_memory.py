"""ZB-H1's two targets on the schedules benchmark's shape, alone: speed over DeepSpeed's 1F1B and
peak held memory over 1F1B's, for the default deferral and the paper's (PP=2, M = 4 and 8).

    deepspeed_1f1b_M{4,8}       plain DeepSpeed PipelineModule + TrainSchedule (the speed peer)
    ds_mp_1f1b_M{4,8}           ds_mp "1f1b" (the memory reference: its largest rank)
    ds_mp_zb-h1_M{4,8}          ds_mp "zb-h1", ``zb_max_pending_w`` "auto" (targets: ≥ 1.10× deepspeed_1f1b
                                with the interval clearing it, held memory ≤ 1.10× ds_mp_1f1b's largest rank)
    ds_mp_zb-h1_paper_M{4,8}    the paper's deferral (``"paper"``)

The eight groups of :mod:`benchmarks.schedules` that the targets need, so they can be measured side by
side on a busy machine without that benchmark's twenty; memory is the storage census of
:func:`ds_mp.engine.held.held_during` after every instruction of one step, per rank (deterministic:
``DS_MP_ZB_MEMORY_ONLY=1`` skips the timed rounds and measures memory alone).
"""
from __future__ import annotations

import os
from dataclasses import asdict
from benchmarks.common import Config, run_side_by_side, speedup, summarize, table
from benchmarks.schedules import FULL, QUICK, ROWS, STAGES, ZB_MEMORY, ZB_TARGET
from benchmarks.workloads import Shape

DESCRIPTION = "PP=2: ZB-H1 (default and the paper's deferral) vs DeepSpeed's and ds_mp's 1F1B: speed and held memory"
VARIANTS = {"1f1b": ("1f1b", {}), "zb-h1": ("zb-h1", {}), "zb-h1_paper": ("zb-h1", {"zb_max_pending_w": "paper"})}


def run(quick: bool, out_dir: str) -> dict:
    shape = asdict(QUICK if quick else FULL)
    repeats, steps = (2, 2) if quick else (6, 3)
    memory_only = os.environ.get("DS_MP_ZB_MEMORY_ONLY") == "1"
    configs = []
    for M in (4, 8):
        configs += [] if memory_only else [Config(f"deepspeed_1f1b_M{M}", "benchmarks.pipeline:setup_deepspeed_pipe", ranks=STAGES,
                              kwargs={"shape": shape, "partition_method": "uniform", "rows": ROWS,
                                      "micro_batches": M})]
        configs += [Config(f"ds_mp_{name}_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": sched, "pipeline": pipeline})
                    for name, (sched, pipeline) in VARIANTS.items()]
    held: dict = {}

    def extra(groups: dict) -> None:
        for name, g in groups.items():
            if name.startswith("ds_mp"):
                held[name] = [p for p, _ in g.call("held_peak")]

    times, _ = run_side_by_side(configs, 0 if memory_only else repeats, steps, extra=extra)
    res = {} if memory_only else summarize(times, {c.name: ROWS * c.kwargs.get("gas", c.kwargs.get("micro_batches", 1)) * shape["seq"]
                            for c in configs})
    rows, mem_rows, summary, ratios = [], [], [], {}
    for M in (4, 8):
        one = max(held[f"ds_mp_1f1b_M{M}"])
        for name in ("ds_mp_1f1b", "ds_mp_zb-h1", "ds_mp_zb-h1_paper"):
            fast, base = f"{name}_M{M}", f"deepspeed_1f1b_M{M}"
            r = None if memory_only else speedup(res[base]["step_times_s"], res[fast]["step_times_s"])
            mem = max(held[fast]) / one
            ratios[f"{fast}/{base}"] = {**(r.as_dict() if r else {}), "held_over_1f1b": mem}
            target = name == "ds_mp_zb-h1"
            rows.append([fast, str(r or "not timed"), f"{mem:.2f}×",
                         f"speed ≥ {ZB_TARGET}×: {r.verdict(ZB_TARGET) if r else 'not timed'}; memory ≤ {ZB_MEMORY}×: "
                         f"{'met' if mem <= ZB_MEMORY else 'NOT met'}" if target else ""])
            mem_rows.append([fast] + [f"{b / 2**20:.1f}" for b in held[fast]])
        zb = ratios[f"ds_mp_zb-h1_M{M}/deepspeed_1f1b_M{M}"]
        speed = f"{zb['value']:.2f}× [{zb['lo']:.2f}, {zb['hi']:.2f}] DeepSpeed's 1F1B" if "value" in zb else "(not timed)"
        summary.append(f"M={M}: zb-h1 {speed} at {zb['held_over_1f1b']:.2f}× ds_mp 1F1B's held memory (largest "
                       f"rank); the paper's deferral at {ratios[f'ds_mp_zb-h1_paper_M{M}/deepspeed_1f1b_M{M}']['held_over_1f1b']:.2f}×")
    return {"workload": f"{Shape(**shape).describe()}; PP=2, {ROWS} rows per micro-batch",
            "repeats": 0 if memory_only else repeats, "steps_per_repeat": steps, "results": res, "ratios": ratios,
            "held_peak_bytes": held, "summary": summary,
            "tables": [table("Speed over DeepSpeed's 1F1B (ratio of median step times, 90% interval) and peak held "
                             "memory over ds_mp 1F1B's largest rank", ["config", "speed-up", "held memory", "targets"],
                             rows),
                       table("Peak held memory per rank (MiB; storage census after every instruction)",
                             ["config", "rank 0", "rank 1"], mem_rows)]}
