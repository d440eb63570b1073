"""Validate ``ds_mp.schedules.simulate`` against measured runs, and project TeraPipe to GPT-3.

Measured (GPT-2 6 × 256, vocab 4096, seq 256; M = 4 micro-batches × 2 rows; PP = 2 and 3,
one thread per rank, so PP = 3 oversubscribes the 2 cores): 1F1B, GPipe, and TeraPipe with
the fixed slicing ``SLICE_SHARES`` of every micro-batch.  One group of processes per PP degree
runs the three schedules (``ScheduleBench.use``), interleaved round-robin.  Every timed step
is traced (:class:`TracedVariant`): a configuration's measured time is the median traced
makespan, and the same steps give the op costs.

Three predictions per configuration, each ``simulate`` on a timetable with per-op costs:

* **blocking p2p, trace costs** (the validation): every traced step replayed through the
  engine's own instruction streams (:func:`engine_timetable`: F/B, loads, sends/receives
  that rendezvous as gloo's do, the tied-gradient all-reduce, reduce + optimizer step), each
  op costing its traced time in that step (mean over micro-batches per (stage, kind, slice);
  a transfer: min of the send and its matching receive); the median over steps is compared
  with the median measured;
* **asynchronous p2p, trace costs** (the planner's view): ``one_f_one_b_timetable`` /
  GPipe / ``terapipe_timetable`` with ``pipeline_deps`` and the same F/B costs, plus the
  traced epilogue (tied all-reduce + slowest stage's reduce and optimizer step);
* **profile, a priori**: blocking timetable, F/B from each stage's fitted cost model
  t_s(l, c) (``profile_engine_stage`` at the micro-batch size, forward = 1/3), nothing else.

The projection applies ``project_gpt3`` to a measured stage cost model (the ``terapipe``
benchmark's saved 8 × 512 profile when present in the same results folder, else this
benchmark's own PP = 2 profile): compute-bound scaling by FLOPs to the paper's GPT-3 shapes,
one layer per stage, one 2048-token sequence.  It is a projection, not a measurement.

The second projection (:func:`table1_projection`) takes the ten settings of the TeraPipe paper's
Table 1 (model, batch, data-parallel shards, pipeline stages, Megatron op partitioning) and a
cost table shaped like the paper's V100 measurements — flat while a layer does not saturate the
GPU (below 256 tokens × rows), then linear at an achieved rate, attention slower, all-reduces
and p2p at the cluster's bandwidths (constants below, each with its source) — and simulates the
joint DP plan, the best uniform slicing and GPipe with micro-batches.  No measurement feeds it.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import Config, interleave, summarize, table
from benchmarks.terapipe import GRANULARITY, Variant, fit_stages, started
from benchmarks.workloads import Shape

DESCRIPTION = ("simulator vs measured PP=2/3 runs (1F1B, GPipe M=4, TeraPipe fixed slicing); GPT-3 and the "
               "paper's Table 1 projected")
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
    from ds_mp.schedules.simulate import Op, one_f_one_b_timetable, terapipe_timetable

    if schedule == "1f1b":
        return one_f_one_b_timetable(K, MICRO_BATCHES)
    if schedule == "gpipe":  # ds_mp's GPipe backwards micro-batch 0 first
        return [[Op(k, m) for k in "FB" for m in range(MICRO_BATCHES)] for _ in range(K)]
    return terapipe_timetable(K, len(slices), MICRO_BATCHES)


def engine_timetable(schedule: str, K: int, slices: list[int]) -> tuple[list, Any]:
    """The engine's instruction streams unrolled into simulator ops, with blocking p2p.

    Per stage, in schedule order: ``Op("F"|"B", micro, slice)``, loads ``Op("L", step)``,
    p2p ``Op("S"|"R", step, peer)``, the tied-embedding all-reduce ``Op("T", step, peer)``
    (first and last stage) and the local reduce + optimizer step ``Op("O", step)``.  A send at
    step t from s to n and the matching receive on n both end at max(both sides ready) +
    transfer (gloo sends block until the receive is posted): S(s→n, t) depends on the op
    before R(n←s, t) on n and vice versa; T likewise.  F/B keep ``pipeline_deps``.
    """
    from deepspeed.runtime.pipe import schedule as ds

    from ds_mp.schedules.terapipe.schedule import BackwardSlice, ForwardSlice, LoadSlice
    from ds_mp.schedules.registry import resolve
    from ds_mp.schedules.simulate import Op, pipeline_deps
    from ds_mp.schedules.terapipe.schedule import TeraPipeSchedule

    p2p = (ds.SendActivation, ds.SendGrad, ds.RecvActivation, ds.RecvGrad)
    table, before = [], {}
    for s in range(K):
        sch = (TeraPipeSchedule(MICRO_BATCHES, K, s, [(ROWS, slices)]) if schedule == "terapipe"
               else resolve(schedule)(micro_batches=MICRO_BATCHES, stages=K, stage_id=s))
        ops, count = [], {"F": 0, "B": 0}
        for t, cmds in enumerate(sch.steps()):
            for c in cmds:
                if isinstance(c, (ForwardSlice, BackwardSlice)):
                    op = Op("F" if isinstance(c, ForwardSlice) else "B", c.micro, c.buffer_id % len(slices))
                elif isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                    kind = "F" if isinstance(c, ds.ForwardPass) else "B"
                    op, count[kind] = Op(kind, count[kind]), count[kind] + 1  # micro-batches in order
                elif isinstance(c, p2p):
                    up = isinstance(c, (ds.SendActivation, ds.RecvGrad))
                    op = Op("S" if type(c).__name__.startswith("Send") else "R", t, s + 1 if up else s - 1)
                elif isinstance(c, (ds.LoadMicroBatch, LoadSlice)):
                    op = Op("L", t)
                elif isinstance(c, ds.ReduceTiedGrads) and s in (0, K - 1):
                    op = Op("T", t, K - 1 - s)
                elif isinstance(c, ds.OptimizerStep):
                    op = Op("O", t)
                else:
                    continue
                before[s, op] = (s, ops[-1]) if ops else None
                ops.append(op)
        table.append(ops)
    mates = {"S": "R", "R": "S", "T": "T"}

    def deps(stage: int, op: Any, K: int) -> list:
        if op.kind in "FB":
            return pipeline_deps(stage, op, K)
        if op.kind not in mates:
            return []
        mate = (op.slice, Op(mates[op.kind], op.micro, stage))
        if mate not in before:
            raise ValueError(f"{schedule}: stage {stage} {op} has no matching partner on stage {mate[0]}")
        return [before[mate]] if before[mate] else []
    return table, deps


def trace_costs(traces: list[dict], n_slices: int) -> dict:
    """Mean traced seconds per simulator cost key (see :func:`op_cost`) over the traced steps.

    A p2p transfer's cost is min(send, matching receive) duration (the side that came later
    waited only for the transfer); the k-th send of s to n matches the k-th receive of n from s.
    """
    from ds_mp.tools.viz import instruction_kind

    acc: dict[tuple, list[float]] = {}
    for tr in traces:
        K = len(tr)
        for s, events in tr.items():
            for name, buf, a, b in events:
                kind = instruction_kind(name)
                if kind in ("forward", "backward"):
                    acc.setdefault((s, kind[0].upper(), buf % n_slices if "Slice" in name else 0), []).append(b - a)
                elif name.startswith("Load"):
                    acc.setdefault((s, "L", 0), []).append(b - a)
            local = [b - a for n, _, a, b in events if n in ("ReduceGrads", "OptimizerStep")
                     or (n == "ReduceTiedGrads" and s not in (0, K - 1))]
            acc.setdefault((s, "O", 0), []).append(sum(local))
        durations = {(s, n): [b - a for m, _, a, b in ev if m == n] for s, ev in tr.items()
                     for n in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ReduceTiedGrads")}
        for s in range(K - 1):  # link s <-> s+1: activations ("A") go up, gradients ("G") down
            for key, snd, rcv in (("A", (s, "SendActivation"), (s + 1, "RecvActivation")),
                                  ("G", (s + 1, "SendGrad"), (s, "RecvGrad"))):
                acc.setdefault((s, key, 0), []).extend(map(min, zip(durations[snd], durations[rcv])))
        tied = durations[0, "ReduceTiedGrads"] + durations[K - 1, "ReduceTiedGrads"]
        acc.setdefault((0, "T", 0), []).append(min(tied))
    return {k: statistics.mean(v) for k, v in acc.items() if v}


def op_cost(cost: dict, s: int, op: Any) -> float:
    """Cost of ``op`` on stage ``s`` from a :func:`trace_costs` table (missing keys cost 0)."""
    if op.kind in "SR":
        up = (op.kind == "S") == (op.slice > s)  # sending up or receiving from below: activations
        return cost.get((min(s, op.slice), "A" if up else "G", 0), 0.0)
    if op.kind == "T":
        return cost.get((0, "T", 0), 0.0)
    return cost.get((s, op.kind, op.slice if op.kind in "FB" else 0), 0.0)


def makespan(trace: dict) -> float:
    return max(e for ev in trace.values() for *_, e in ev) - min(ev[0][2] for ev in trace.values())


def predictions(schedule: str, K: int, slices: list[int], traces: list[dict], stage_costs: list) -> dict:
    """Per traced step, its iteration time simulated from that step's op costs (engine
    instruction streams with blocking p2p; the planner's F/B timetable with asynchronous p2p +
    the traced epilogue); medians over steps, the median per-step |error| of the blocking
    model, and the a-priori prediction from the profile."""
    from ds_mp.schedules.simulate import simulate
    from ds_mp.schedules.terapipe.planner import slice_costs

    sl = slices if schedule == "terapipe" else [sum(slices)]
    table, deps = engine_timetable(schedule, K, slices)
    planner = planner_timetable(schedule, K, slices)
    blocking, async_, tails = [], [], []
    for tr in traces:
        cost = trace_costs([tr], len(sl))
        blocking.append(simulate(table, lambda s, op: op_cost(cost, s, op), deps=deps).iteration_time)
        tails.append(max(cost[s, "O", 0] for s in range(K)) + cost[0, "T", 0])
        async_.append(simulate(planner, lambda s, op: op_cost(cost, s, op)).iteration_time + tails[-1])
    t, share = [slice_costs(sl, c) for c in stage_costs], {"F": 1 / 3, "B": 2 / 3}
    prof = simulate(table, lambda s, op: t[s][op.slice] * share[op.kind] if op.kind in share else 0.0, deps=deps)
    med = statistics.median
    return {"async_s": med(async_), "blocking_s": med(blocking), "epilogue_s": med(tails),
            "step_error": med(abs(p / makespan(tr) - 1) for p, tr in zip(blocking, traces)),
            "profile_s": prof.iteration_time}


def projection(out_dir: str, own: tuple) -> tuple[dict, str]:
    """``project_gpt3`` from stage 0's cost model (terapipe's 8 × 512 profile if saved here)."""
    from ds_mp.schedules.simulate import GPT3_SHAPES, ModelShape, project_gpt3
    from ds_mp.schedules.terapipe.cost_model import fit_cost_model

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


class TracedVariant(Variant):
    """A :class:`Variant` whose every step is traced: its time is the traced makespan (first
    instruction start to last end, all ranks), and the traces (warm-up dropped) give the op
    costs, so costs and measured times come from the same steps."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.traces: list[dict] = []
        self.warm = False

    def steps(self, k: int) -> list[tuple[float, float]]:
        self.group.call("use", self.schedule, self.plan)
        out = []
        for _ in range(k):
            tr = self.group.call("trace")[0]
            out.append((makespan(tr), 0.0))
            if self.warm:
                self.traces.append(tr)
        self.warm = True
        return out


def run(quick: bool, out_dir: str) -> dict:
    s = QUICK if quick else FULL
    shape, L = asdict(s), s.seq
    slices = fixed_slices(L)
    repeats, steps = (2, 1) if quick else (4, 2)
    kw = {"shape": shape, "micro": ROWS, "gas": MICRO_BATCHES, "slices": slices}
    configs = [Config(f"pp{K}", "benchmarks.terapipe:setup_schedule_bench", K, 1, kw) for K in DEGREES]
    with started(configs) as groups:
        per_stage = {K: groups[f"pp{K}"].call("profile", GRANULARITY) for K in DEGREES}
        runs = [TracedVariant(groups[f"pp{K}"], f"pp{K}_{sch}", sch, [(ROWS, slices)] if sch == "terapipe" else None)
                for sch in SCHEDULES for K in DEGREES]
        times = interleave(runs, repeats, steps)
    traces = {v.cfg.name: v.traces for v in runs}
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
                     f"{p['step_error']:.1%}",
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
    t1 = table1_projection()
    summary.append("PROJECTION of the paper's Table 1 settings (NOT measured; V100-shaped cost table): DP plan vs best "
                   f"uniform {min(r['dp_vs_uniform'] for r in t1):.2f}×–{max(r['dp_vs_uniform'] for r in t1):.2f}× "
                   f"(paper, Fig. 6: {PAPER_DP_VS_UNIFORM[0]}×/{PAPER_DP_VS_UNIFORM[1]}×), vs GPipe with micro-batches "
                   f"{min(r['dp_vs_gpipe'] for r in t1):.2f}×–{max(r['dp_vs_gpipe'] for r in t1):.2f}× (paper: "
                   f"{PAPER_VS_GPIPE[0]}×–{PAPER_VS_GPIPE[1]}×)")
    for line in summary:
        print("  " + line)
    return {"table1_projection": t1,
            "workload": s.describe() + f", M={MICRO_BATCHES} micro-batches × {ROWS} rows, PP=2 and 3, "
                        f"TeraPipe slices {slices}", "configs": res, "errors": errors, "projection": proj,
            "projection_source": source, "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "ratios": {f"{n}_predicted_vs_measured": 1 + e for n, e in errors.items()}, "plots": [],
            "tables": [table("simulated vs measured iteration time (seconds)", [
                "config", "measured (median)", "IQR", "sim: trace costs, async p2p", "error",
                "sim: trace costs, blocking p2p", "error", "per-step |error| (median)", "epilogue (traced)",
                "sim: profile, blocking, a priori", "error"], rows),
                table("PROJECTION (not measured): TeraPipe on GPT-3 shapes, one layer per stage, 1 × 2048 tokens",
                      ["model", "stages", "DP slices", "projected s/iteration", "no slicing", "speed-up"], prow),
                table1_table(t1)]}


# ------------------------------------------------------------------ the paper's Table 1, projected

@dataclass(frozen=True)
class PaperSetting:
    """A row of TeraPipe's Table 1 (Li et al., ICML 2021): GPT-3 shape, global batch B, data-parallel
    shards, pipeline stages, GPUs per layer for Megatron op partitioning; L = 2048."""

    setting: int
    model: str
    batch: int
    data: int
    pipe: int
    op: int

    @property
    def rows(self) -> int:
        """Sequences per pipeline per step."""
        return self.batch // self.data


# Transcribed from the paper's Table 1 (#GPUs = data × pipe × op: 192, 320, 384, 384 as in its
# text; the repository's evaluation script runs 24, 40, 48, 48 p3.16xlarge nodes of 8 V100s).
TABLE1 = [PaperSetting(1, "gpt3-1b", 128, 8, 24, 1), PaperSetting(2, "gpt3-1b", 72, 2, 12, 8),
          PaperSetting(3, "gpt3-1b", 72, 1, 24, 8), PaperSetting(4, "gpt3-13b", 32, 2, 20, 8),
          PaperSetting(5, "gpt3-13b", 32, 1, 40, 8), PaperSetting(6, "gpt3-44b", 8, 4, 96, 1),
          PaperSetting(7, "gpt3-44b", 8, 2, 24, 8), PaperSetting(8, "gpt3-44b", 8, 1, 48, 8),
          PaperSetting(9, "gpt3-175b", 2, 1, 96, 4), PaperSetting(10, "gpt3-175b", 2, 1, 48, 8)]
PAPER_VS_GPIPE = (1.21, 5.0)        # the paper's range of speed-ups over GPipe + Megatron (Fig. 5)
PAPER_DP_VS_UNIFORM = (1.12, 1.04)  # the paper's Fig. 6: DP slicing over the best uniform slicing

# V100 cost shape: a layer's latency is flat while the GPU is not saturated and linear after
# (the paper's Fig. 3/4: flat to ~256 tokens), at an achieved fp16 rate; Megatron's 4 all-reduces
# per layer (forward + backward) over NVLink; stage-to-stage p2p over the 25 Gbit/s network.
V100_TFLOPS = 50.0       # achieved fp16 TFLOP/s of the dense layers in the linear region (40% of the 125 peak)
ATTN_TFLOPS = 10.0       # achieved by 2021's unfused attention (QKᵀ, softmax, AV: memory-bound), TFLOP/s
KNEE_TOKENS = 256        # rows × tokens of a slice below which a layer costs the same
NVLINK_GBS = 100.0       # all-reduce bus bandwidth inside a node, GB/s
NET_GBS = 25 / 8         # p3.16xlarge network, GB/s
NET_LATENCY = 30e-6      # per message, s


def v100_cost(s: PaperSetting) -> Any:
    """cost(b, i, j): one stage (N / pipe layers, each split over ``op`` GPUs) forward + backward of
    b rows × i tokens after j cached tokens, plus its two p2p messages (activation, gradient)."""
    from ds_mp.schedules.simulate import GPT3_SHAPES

    shape = GPT3_SHAPES[s.model]
    h, layers = shape.hidden, shape.layers / s.pipe
    rate, attn_rate = V100_TFLOPS * 1e12 * s.op, ATTN_TFLOPS * 1e12 * s.op

    def cost(b: int, i: int, j: int) -> float:
        dense = 3 * 24 * h * h * max(b * i, KNEE_TOKENS)             # flat below the knee
        attn = 3 * 4 * h * b * (i * j + i * (i + 1) / 2)             # QKᵀ and AV, F + 2×B
        allreduce = (4 * 2 * (s.op - 1) / s.op * b * i * h * 2 / (NVLINK_GBS * 1e9)) if s.op > 1 else 0.0
        p2p = 2 * (NET_LATENCY + b * i * h * 2 / (NET_GBS * 1e9))
        return layers * (dense / rate + attn / attn_rate + allreduce) + p2p
    return cost


def table1_projection(granularity: int = 64) -> list[dict]:
    """Per Table 1 setting: the joint DP plan (``plan_joint``, batch-slice sizes 1, 2, 4, …), the
    best uniform slicing (equal batch split × uniform token slices) and GPipe (equal batch split,
    no token slicing: micro-batching), each simulated (``simulate_plan``) on the V100-shaped cost."""
    from ds_mp.schedules.simulate import simulate_plan
    from ds_mp.schedules.terapipe.planner import plan_joint, predicted_time_joint, uniform_slices

    L, out = 2048, []
    for s in TABLE1:
        B, K, cost = s.rows, s.pipe, v100_cost(s)
        sizes = [b for b in (2 ** k for k in range(8)) if b <= B]
        splits = [n for n in range(1, B + 1) if B % n == 0]
        dp = plan_joint(B, L, K, cost, granularity=granularity, batch_sizes=sizes)
        uniform = [[(B // n, uniform_slices(L, m))] * n for n in splits for m in (2 ** k for k in range(6))]
        gpipe = [[(B // n, [L])] * n for n in splits]
        best_u = min(uniform, key=lambda p: predicted_time_joint(p, K, cost))
        best_g = min(gpipe, key=lambda p: predicted_time_joint(p, K, cost))
        t = {k: simulate_plan(p, K, cost).iteration_time for k, p in (("dp", dp), ("uniform", best_u), ("gpipe", best_g))}
        out.append({"setting": s.setting, "model": s.model, "rows_per_pipeline": B, "stages": K, "op": s.op,
                    "dp_plan": [[b, sl] for b, sl in dp], "best_uniform": [len(best_u), best_u[0][0], len(best_u[0][1])],
                    "gpipe_micro_batches": len(best_g), "time_s": t,
                    "dp_vs_uniform": t["uniform"] / t["dp"], "dp_vs_gpipe": t["gpipe"] / t["dp"]})
    return out


def table1_table(rows: list[dict]) -> dict:
    def plan_str(p: list) -> str:
        return f"{len(p)} batch-slice(s) of {sorted({b for b, _ in p})} rows, {max(len(sl) for _, sl in p)} token slices max"
    body = [[f"({r['setting']})", r["model"], r["rows_per_pipeline"], r["stages"], r["op"], plan_str(r["dp_plan"]),
             f"{r['best_uniform'][0]}×{r['best_uniform'][1]} rows × {r['best_uniform'][2]} slices",
             r["gpipe_micro_batches"], f"{r['time_s']['dp']:.2f}", f"{r['dp_vs_uniform']:.2f}×",
             f"{r['dp_vs_gpipe']:.2f}×"] for r in rows]
    return table("PROJECTION (not measured): the paper's Table 1 settings on a V100-shaped cost "
                 f"(flat to {KNEE_TOKENS} tokens, {V100_TFLOPS:.0f} TFLOP/s after, attention {ATTN_TFLOPS:.0f} TFLOP/s, NVLink all-reduce, "
                 f"{NET_GBS * 8:.0f} Gbit/s p2p); paper: {PAPER_VS_GPIPE[0]}×–{PAPER_VS_GPIPE[1]}× over GPipe, "
                 f"DP over uniform {PAPER_DP_VS_UNIFORM[0]}×/{PAPER_DP_VS_UNIFORM[1]}× (Fig. 6)",
                 ["setting", "model", "rows per pipeline", "stages", "GPUs per layer", "DP plan", "best uniform",
                  "GPipe micro-batches", "DP s/iter", "DP vs best uniform", "DP vs GPipe"], body)


if __name__ == "__main__":
    for r in table1_table(table1_projection())["rows"]:
        print(r)
