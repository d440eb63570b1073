"""Validate ``ds_mp.pipeline.simulate`` against measured runs, and project TeraPipe to GPT-3.

Measured (GPT-2 6 × 256, vocab 4096, seq 256; M = 4 micro-batches × 2 rows; PP = 2 and 3,
one thread per rank, so PP = 3 oversubscribes the 2 cores): 1F1B, GPipe, and TeraPipe with
the fixed slicing ``SLICES`` of every micro-batch.  One group of processes per PP degree
runs the three schedules (``ScheduleBench.use``), interleaved round-robin with the other
group's; a configuration's time is its median step.

Two predictions per configuration, both from ``simulate`` on the configuration's timetable
(1F1B: ``one_f_one_b_timetable``; GPipe: forwards then backwards in the engine's order;
TeraPipe: ``terapipe_timetable``):

* **trace**: per-op costs = mean traced forward / backward seconds per (stage, op kind,
  token slice) over ``TRACED`` recorded steps of that configuration, the p2p latency =
  the shortest traced receive, plus the traced epilogue (tied-gradient all-reduce, gradient
  reduction, optimizer step: the slowest stage's local work);
* **profile**: a-priori, from each stage's fitted cost model t_s(l, c) (``profile_engine_stage``
  at the micro-batch size), forward = 1/3 of it, no latency, no epilogue.

The projection applies ``project_gpt3`` to a measured stage cost model (the ``terapipe``
benchmark's saved 8 × 512 profile when present in the same results folder, else this
benchmark's own PP = 2 profile): compute-bound scaling by FLOPs to the paper's GPT-3 shapes,
one layer per stage, one 2048-token sequence.  It is a projection, not a measurement.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, interleave, summarize, table
from benchmarks.terapipe import GRANULARITY, Variant, fit_stages, started
from benchmarks.workloads import Shape

DESCRIPTION = "simulator vs measured PP=2/3 runs (1F1B, GPipe M=4, TeraPipe fixed slicing); GPT-3 projection"
TARGET = 0.10  # |predicted / measured − 1|
FULL = Shape(n_layer=6, n_embd=256, n_head=8, vocab=4096, seq=256, n_positions=256)
QUICK = Shape(n_layer=6, n_embd=128, n_head=4, vocab=2048, seq=128, n_positions=128)
ROWS, MICRO_BATCHES, DEGREES = 2, 4, (2, 3)
SLICE_SHARES = (6, 4, 3, 3)  # the fixed TeraPipe slicing, in sixteenths of the sequence
SCHEDULES = ("1f1b", "gpipe", "terapipe")


def fixed_slices(L: int) -> list[int]:
    out = [L * k // 16 for k in SLICE_SHARES[:-1]]
    return out + [L - sum(out)]


def planner_timetable(schedule: str, K: int, slices: list[int]) -> list:
    """The simulator's own timetables (asynchronous p2p, as the planner assumes)."""
    from ds_mp.pipeline.simulate import Op, one_f_one_b_timetable, terapipe_timetable

    if schedule == "1f1b":
        return one_f_one_b_timetable(K, MICRO_BATCHES)
    if schedule == "gpipe":  # ds_mp's GPipe backwards micro-batch 0 first
        return [[Op(k, m) for k in "FB" for m in range(MICRO_BATCHES)] for _ in range(K)]
    return terapipe_timetable(K, len(slices), MICRO_BATCHES)


def engine_timetable(schedule: str, K: int, slices: list[int]) -> tuple[list, Any]:
    """The engine's instruction streams unrolled into ops, with blocking (rendezvous) p2p.

    Per stage, in schedule order: F/B ops (``Op(kind, micro, slice)``) and one op per
    p2p instruction, ``Op("S" | "R", step, peer)``.  A send at step t from s to n and the
    matching receive on n both end when both sides have reached them (gloo send blocks
    until the receive is posted):  S(s→n, t) waits for the op before R(n←s, t) on n and
    vice versa, plus the latency; F/B keep ``pipeline_deps``.
    """
    from deepspeed.runtime.pipe import schedule as ds

    from ds_mp.pipeline.instructions import BackwardSlice, ForwardSlice
    from ds_mp.pipeline.schedules import SCHEDULES
    from ds_mp.pipeline.simulate import Op, pipeline_deps
    from ds_mp.pipeline.terapipe import TeraPipeSchedule

    table, before = [], {}
    for s in range(K):
        sch = (TeraPipeSchedule(MICRO_BATCHES, K, s, [(ROWS, slices)]) if schedule == "terapipe"
               else SCHEDULES[schedule](micro_batches=MICRO_BATCHES, stages=K, stage_id=s))
        ops, count = [], {"F": 0, "B": 0}
        for t, cmds in enumerate(sch.steps()):
            for c in cmds:
                if isinstance(c, (ForwardSlice, BackwardSlice)):
                    op = Op("F" if isinstance(c, ForwardSlice) else "B", c.micro, c.buffer_id % len(slices))
                elif isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                    kind = "F" if isinstance(c, ds.ForwardPass) else "B"
                    op, count[kind] = Op(kind, count[kind]), count[kind] + 1  # micro-batches in order
                elif isinstance(c, (ds.SendActivation, ds.SendGrad, ds.RecvActivation, ds.RecvGrad)):
                    up = isinstance(c, (ds.SendActivation, ds.RecvGrad))
                    op = Op("S" if type(c).__name__.startswith("Send") else "R", t, s + 1 if up else s - 1)
                else:
                    continue
                before[s, op] = (s, ops[-1]) if ops else None
                ops.append(op)
        table.append(ops)

    def deps(stage: int, op: Any, K: int) -> list:
        if op.kind in "FB":
            return pipeline_deps(stage, op, K)
        mate = (op.slice, Op("R" if op.kind == "S" else "S", op.micro, stage))
        if mate not in before:
            raise ValueError(f"{schedule}: stage {stage} {op} has no matching p2p on stage {mate[0]}")
        return [before[mate]] if before[mate] else []
    return table, deps


def trace_costs(traces: list[dict], n_slices: int) -> tuple[dict, float, float]:
    """(mean seconds per (stage, kind, slice), p2p latency, epilogue) from traced steps."""
    from ds_mp.viz import instruction_kind

    ops: dict[tuple, list[float]] = {}
    recv, tail = [], []
    for tr in traces:
        for s, events in tr.items():
            for name, buf, a, b in events:
                kind = instruction_kind(name)
                if kind in ("forward", "backward"):
                    sl = buf % n_slices if "Slice" in name else 0
                    ops.setdefault((s, kind[0].upper(), sl), []).append(b - a)
                elif name.startswith("Recv"):
                    recv.append(b - a)
        tied = [sum(b - a for n, _, a, b in ev if n == "ReduceTiedGrads") for ev in tr.values()]
        local = [sum(b - a for n, _, a, b in ev if n in ("ReduceGrads", "OptimizerStep")) for ev in tr.values()]
        tail.append(max(local) + min(t for t in tied if t > 0))
    return {k: statistics.mean(v) for k, v in ops.items()}, min(recv), statistics.mean(tail)


def predictions(schedule: str, K: int, slices: list[int], traces: list[dict], stage_costs: list) -> dict:
    """Iteration time from trace op costs (asynchronous and blocking p2p) and from the profile."""
    from ds_mp.pipeline.simulate import simulate
    from ds_mp.pipeline.slicing import slice_costs

    sl = slices if schedule == "terapipe" else [sum(slices)]
    cost, lat, tail = trace_costs(traces, len(sl))
    t = [slice_costs(sl, c) for c in stage_costs]

    def traced(s: int, op: Any) -> float:
        return cost[s, op.kind, op.slice] if op.kind in "FB" else 0.0

    def profiled(s: int, op: Any) -> float:
        return t[s][op.slice] * {"F": 1 / 3, "B": 2 / 3}.get(op.kind, 0.0)

    table, deps = engine_timetable(schedule, K, slices)
    async_ = simulate(planner_timetable(schedule, K, slices), traced, latency=lat)
    blocking = simulate(table, traced, latency=lat, deps=deps)
    prof = simulate(table, profiled, deps=deps)
    return {"async_s": async_.iteration_time + tail, "blocking_s": blocking.iteration_time + tail,
            "blocking_makespan_s": blocking.iteration_time, "latency_s": lat, "epilogue_s": tail,
            "profile_s": prof.iteration_time}


def projection(out_dir: str, own: tuple) -> tuple[dict, str]:
    """``project_gpt3`` from stage 0's cost model (terapipe's 8 × 512 profile if saved here)."""
    from ds_mp.pipeline.simulate import GPT3_SHAPES, ModelShape, project_gpt3
    from ds_mp.pipeline.slicing import fit_cost_model

    saved = sorted(glob.glob(os.path.join(out_dir, "terapipe_profile_*_samples.json")))
    if saved:
        with open(saved[-1]) as f:
            data = json.load(f)
        samples, shape = data["per_rank"][0], data["shape"]
        layers, hidden, L = shape["n_layer"], shape["n_embd"], shape["seq"]
        source = f"{os.path.basename(saved[-1])} (stage 0 of GPT-2 {layers} × {hidden}, PP=2, seq {L})"
    else:
        samples, (layers, hidden, L) = own
        source = f"this benchmark's PP=2 profile (stage 0 of GPT-2 {layers} × {hidden}, seq {L})"
    cost, err = fit_cost_model([tuple(x) for x in samples])
    measured = ModelShape(layers=layers, hidden=hidden, seq_len=L)
    out = {}
    for name, tgt in GPT3_SHAPES.items():
        K = tgt.layers
        slices, sim = project_gpt3(cost, measured, 2, name, K)
        _, base = project_gpt3(cost, measured, 2, name, K, slices=[tgt.seq_len])
        out[name] = {"stages": K, "slices": slices, "time_s": sim.iteration_time,
                     "no_slicing_s": base.iteration_time, "speedup": base.iteration_time / sim.iteration_time}
    return out, f"{source}, fit error {err:.1%}"


def run(quick: bool, out_dir: str) -> dict:
    s = QUICK if quick else FULL
    shape, L = asdict(s), s.seq
    slices = fixed_slices(L)
    repeats, steps, traced = (2, 1, 1) if quick else (4, 2, 2)
    kw = {"shape": shape, "micro": ROWS, "gas": MICRO_BATCHES, "slices": slices}
    configs = [Config(f"pp{K}", "benchmarks.terapipe:setup_schedule_bench", K, 1, kw) for K in DEGREES]
    traces: dict[str, list] = {}
    with started(configs) as groups:
        per_stage = {K: groups[f"pp{K}"].call("profile", GRANULARITY) for K in DEGREES}
        runs = [Variant(groups[f"pp{K}"], f"pp{K}_{sch}", sch, [(ROWS, slices)] if sch == "terapipe" else None)
                for sch in SCHEDULES for K in DEGREES]
        times = interleave(runs, repeats, steps)
        for v in runs:
            v.group.call("use", v.schedule, v.plan)
            traces[v.cfg.name] = [v.group.call("trace")[0] for _ in range(traced)]
    res = summarize(times, {v.cfg.name: ROWS * MICRO_BATCHES * L for v in runs})
    rows, errors = [], {}
    for v in runs:
        K = v.cfg.ranks
        stage_costs = fit_stages(per_stage[K])[0]
        p = predictions(v.schedule, K, slices, traces[v.cfg.name], stage_costs)
        m = res[v.cfg.name]["median_s"]
        errors[v.cfg.name] = p["blocking_s"] / m - 1
        res[v.cfg.name].update(p)
        rows.append([v.cfg.name, f"{m:.3f}", f"±{res[v.cfg.name]['iqr_rel']:.0%}", f"{p['async_s']:.3f}",
                     f"{p['async_s'] / m - 1:+.1%}", f"{p['blocking_s']:.3f}", f"{errors[v.cfg.name]:+.1%}",
                     f"{p['epilogue_s']:.3f}", f"{p['profile_s']:.3f}", f"{p['profile_s'] / m - 1:+.1%}"])
    worst = max(errors, key=lambda n: abs(errors[n]))
    proj, source = projection(out_dir, (per_stage[2][0], (s.n_layer, s.n_embd, L)))
    prow = [[n, p["stages"], f"{len(p['slices'])}", f"{p['time_s']:.2f}", f"{p['no_slicing_s']:.2f}",
             f"{p['speedup']:.2f}×"] for n, p in proj.items()]
    within = sum(abs(e) <= TARGET for e in errors.values())
    async_err = {n: res[n]["async_s"] / res[n]["median_s"] - 1 for n in errors}
    summary = [f"simulator with traced op costs and the engine's blocking p2p: within ±{TARGET:.0%} of the measured "
               f"median for {within}/{len(errors)} configurations, worst {worst} {errors[worst]:+.1%}, mean |error| "
               f"{statistics.mean(abs(e) for e in errors.values()):.1%} (asynchronous p2p, the planner's view: mean "
               f"|error| {statistics.mean(abs(e) for e in async_err.values()):.1%})",
               "PP=3 runs 3 single-thread ranks on 2 cores: the simulator assumes one processor per stage",
               f"GPT-3 projection (NOT measured; compute-bound FLOP scaling of {source}): TeraPipe DP slicing "
               "vs no slicing " + ", ".join(f"{n} {p['speedup']:.2f}×" for n, p in proj.items())]
    for line in summary:
        print("  " + line)
    return {"workload": s.describe() + f", M={MICRO_BATCHES} micro-batches × {ROWS} rows, PP=2 and 3, "
                        f"TeraPipe slices {slices}", "configs": res, "errors": errors, "projection": proj,
            "projection_source": source, "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "ratios": {f"{n}_predicted_vs_measured": 1 + e for n, e in errors.items()}, "plots": [],
            "tables": [table("simulated vs measured iteration time (seconds)", [
                "config", "measured (median)", "IQR", "sim: trace costs, async p2p", "error",
                "sim: trace costs, blocking p2p", "error", "of which epilogue", "sim: profile, blocking, a priori",
                "error"], rows),
                table("PROJECTION (not measured): TeraPipe on GPT-3 shapes, one layer per stage, 1 × 2048 tokens",
                      ["model", "stages", "DP slices", "projected s/iteration", "no slicing", "speed-up"], prow)]}
