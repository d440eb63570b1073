"""New pipeline schedules at PP=2, side by side: ZB-H1 and token-sliced 1F1B against 1F1B.

Configurations (same GPT-2, 2 ranks × 1 thread each, uniform split, the same rows every step):

    deepspeed_1f1b_M{4,8}  plain DeepSpeed PipelineModule + its TrainSchedule (the peer)
    ds_mp_1f1b_M{4,8}      ds_mp "1f1b" (DeepSpeed's TrainSchedule in ds_mp's engine)
    ds_mp_zb-h1_M{4,8}     ds_mp "zb-h1", default ``zb_max_pending_w`` "auto" (issue targets: ≥ 1.10×
                           deepspeed_1f1b, peak held memory ≤ 1.10× ds_mp_1f1b's largest rank)
    ds_mp_zb-h1_paper_M{4,8}  the paper's deferral (``zb_max_pending_w`` "paper": stage s defers s W)
    ds_mp_zb-h1_balanced_M{4,8}  the same with the blocks split [4, 2] (:func:`balanced_split`): the
                           uniform [3, 3] leaves the LM head's stage the slowest, so ZB-H1's W has
                           no bubble to fill there
    ds_mp_interleaved_M{4,8}  ds_mp "interleaved", virtual_stages = 2 (issue target: ≥ 1.05× deepspeed_1f1b)
    ds_mp_{1f1b,zb-h1,interleaved}_blocking_M8  the same with DeepSpeed's blocking sends
                           (``post_sends`` off): what posting the sends gains
    terapipe_gpipe         TeraPipe, M = 4 micro-batches × 4 equal token slices, today's order
    terapipe_1f1b          the same slices in the 1F1B order (target: time within 5% of
                           terapipe_gpipe at ≤ 0.6× its peak activation memory)

After the timed rounds each ds_mp configuration records, per rank, the peak *held* memory over one
step (:func:`ds_mp.engine.held.held_during`: a storage census after every instruction — saved
activations, the gradients B recorded for W, pipe buffers, posted sends; weights, gradients and
optimizer state not charged), the peak of saved activations alone
(:class:`ds_mp.engine.memory.SavedActivations`, what TeraPipe's target is stated in) and a few
traced steps.  The
simulator (``ds_mp.schedules.simulate``) replays each schedule's timetable with the traced op
costs (every F/B/W its own mean duration over the traced steps; p2p latency 0) plus the traced
epilogue (tied-gradient all-reduce, reduce, optimizer step; slowest stage): that prediction is
checked against the median makespan of the same traced steps (target |error| ≤ 10%; the untimed
median step is shown beside it).  Projections (labelled so) use
the validated simulator with the measured per-stage costs: interleaved 1F1B (v = 2, each chunk
half a stage's cost) at the measured shapes, and the paper-scale PP = 8, M = 32 with the
measured F : B : W ratio.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, run_side_by_side, speedup, summarize, table
from benchmarks.pipeline import DsMpPipeBench
from benchmarks.workloads import Shape

DESCRIPTION = ("PP=2: ZB-H1, interleaved (v=2) and token-sliced 1F1B vs 1F1B (ds_mp and DeepSpeed's) and TeraPipe's "
               "GPipe order; time, peak activations, simulator check; PP=8 projected")
ZB_TARGET, INTERLEAVED_TARGET, SIM_TARGET, ZB_MEMORY = 1.10, 1.05, 0.10, 1.10
SLICED_TIME, SLICED_MEMORY = 0.05, 0.6  # token-sliced 1F1B: time within 5% of TeraPipe's, memory at most 0.6×
FULL = Shape(n_layer=6, n_embd=256, n_head=8, vocab=4096, seq=256, n_positions=256)
QUICK = Shape(n_layer=4, n_embd=128, n_head=4, vocab=2048, seq=128, n_positions=128)
STAGES, ROWS, SLICES, VIRTUAL = 2, 2, 4, 2
COMPUTE = {"ForwardPass": "F", "ForwardSlice": "F", "BackwardPass": "B", "BackwardSlice": "B",
           "BackwardInput": "B", "BackwardWeight": "W", "ChunkForward": "F", "ChunkBackward": "B"}
EPILOGUE = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


class SchedBench(DsMpPipeBench):
    """A ds_mp PP=2 configuration with peak-activation and traced-cost measurements."""

    def __init__(self, rank: int, world: int, shape: dict, micro: int, gas: int, schedule: str,
                 terapipe: dict | None = None, pipeline: dict | None = None, post_sends: bool = True) -> None:
        import ds_mp

        from benchmarks.workloads import batch, ds_mp_config, hf_model

        cfg = ds_mp_config(shape, pp=STAGES, micro=micro, gas=gas, schedule=schedule)
        if terapipe:
            cfg["ds_mp"]["terapipe"] = terapipe
        cfg["ds_mp"]["pipeline"].update(pipeline or {})  # interleaved: virtual_stages
        self.engine, self.opt, _, _ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        self.engine.post_sends = post_sends
        ids, labels = batch(shape, micro * gas)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, micro * gas, micro)]

    def activation_peak(self) -> int:
        from ds_mp.engine.memory import SavedActivations

        with SavedActivations(self.engine.module.parameters()) as m:
            self.step()
        return m.peak

    def held_peak(self) -> list[int]:
        """Held memory over one step (:func:`ds_mp.engine.held.held_during`): [peak bytes, bytes held
        before the step]."""
        from ds_mp.engine.held import held_during

        return list(held_during(self.engine, self.step))

    def traced(self, steps: int) -> list[list[tuple[str, float, float]]]:
        """``steps`` traced steps on this rank: per step the (instruction, start, end) list in order
        (``time.perf_counter``: one monotonic clock for every process of this host)."""
        import torch.distributed as dist

        out = []
        for _ in range(steps):
            dist.barrier()
            self.engine.trace.clear()
            self.engine.trace_enabled = True
            self.step()
            self.engine.trace_enabled = False
            out.append([(name, start, end) for name, _, start, end in self.engine.trace])
        return out

    def timetable(self) -> list:
        """Every stage's ops in the order this rank's schedule runs them (simulator ``Op``s)."""
        sched = self.engine._train_schedule()
        if hasattr(sched, "table"):
            return sched.table()
        from ds_mp.schedules.simulate import one_f_one_b_timetable, terapipe_timetable

        if self.engine.schedule_name == "terapipe":
            return terapipe_timetable(STAGES, SLICES, self.engine.micro_batches)
        return one_f_one_b_timetable(STAGES, self.engine.micro_batches)


def setup_sched(rank: int, world: int, **kwargs: Any) -> SchedBench:
    return SchedBench(rank, world, **kwargs)


def makespans(traces: list[list[list[tuple[str, float, float]]]]) -> list[float]:
    """Per traced step: last end − first start over every rank."""
    return [max(e for tr in step for _, _, e in tr) - min(s for tr in step for _, s, _ in tr)
            for step in zip(*traces)]


def predict(table: list, traces: list[list[list[tuple[str, float, float]]]], kind: str) -> tuple[float, dict]:
    """Simulated step (s) from traced costs: the k-th F/B/W of a stage costs the mean over steps of
    that stage's k-th traced instruction of that kind; plus the slowest stage's traced epilogue."""
    from ds_mp.schedules.simulate import interleaved_deps, pipeline_deps, simulate, zero_bubble_deps

    costs: dict = {}
    epilogue = []
    for s, per_step in enumerate(traces):
        ops = {k: [op for op in table[s] if op.kind == k] for k in "FBW"}
        sums: dict = {}
        for step in per_step:
            seen = {"F": 0, "B": 0, "W": 0}
            for name, start, end in step:
                k, dur = COMPUTE.get(name.partition("@")[0]), end - start  # ChunkForward@<micro>.<chunk>
                if k is not None:
                    op = ops[k][seen[k]]
                    seen[k] += 1
                    sums.setdefault((s, op), []).append(dur)
        costs.update({key: statistics.mean(v) for key, v in sums.items()})
        epilogue.append(statistics.median(sum(e - b for n, b, e in step if n in EPILOGUE) for step in per_step))
    deps = {"zb-h1": zero_bubble_deps, "interleaved": interleaved_deps(VIRTUAL)}.get(kind, pipeline_deps)
    result = simulate(table, lambda s, op: max(costs[(s, op)], 1e-9), deps=deps)
    per_kind = {k: statistics.mean(v for (s, op), v in costs.items() if op.kind == k) for k in "FBW"
                if any(op.kind == k for _, op in costs)}
    return result.iteration_time + max(epilogue), {"stage_costs": per_kind, "epilogue_s": max(epilogue)}


def projections(F: float, B: float, W: float) -> list[list]:
    """Simulated step ratios over 1F1B (F, B+W per micro-batch and stage; p2p free) — projected."""
    from ds_mp.schedules.simulate import (interleaved_deps, interleaved_timetable, one_f_one_b_timetable, simulate,
                                          zb_h1_timetable, zero_bubble_deps)

    rows = []
    for K, M in ((2, 4), (2, 8), (8, 32)):
        one = simulate(one_f_one_b_timetable(K, M), lambda s, op: F if op.kind == "F" else B + W).iteration_time
        zb, paper = (simulate(zb_h1_timetable(K, M, d), lambda s, op: {"F": F, "B": B, "W": W}[op.kind],
                              deps=zero_bubble_deps).iteration_time for d in ("auto", "paper"))
        il = simulate(interleaved_timetable(K, M, 2), lambda s, op: (F if op.kind == "F" else B + W) / 2,
                      deps=interleaved_deps(2)).iteration_time
        rows.append([f"PP={K}, M={M}", f"{one / zb:.3f}×", f"{one / paper:.3f}×", f"{one / il:.3f}×", "projected"])
    return rows


def balanced_split(shape: dict) -> list[int]:
    """Blocks per stage (PP=2) evening out the stages' compute, the LM head and its loss on the
    last stage weighing ``vocab · n_embd / (12 · n_embd²)`` blocks (its multiply-adds per token
    against a block's): [4, 2] at the full shape, where the uniform [3, 3] leaves the last stage the
    slowest, always busy, and the first one idle in every cycle."""
    n, head = shape["n_layer"], shape["vocab"] / (12 * shape["n_embd"])
    first = min(range(1, n), key=lambda k: max(k, n - k + head))
    return [first, n - first]


def run(quick: bool, out_dir: str) -> dict:
    shape = asdict(QUICK if quick else FULL)
    repeats, steps, traced = (2, 2, 2) if quick else (6, 3, 3)
    configs = []
    for M in (4, 8):
        configs += [Config(f"deepspeed_1f1b_M{M}", "benchmarks.pipeline:setup_deepspeed_pipe", ranks=STAGES,
                           kwargs={"shape": shape, "partition_method": "uniform", "rows": ROWS, "micro_batches": M}),
                    Config(f"ds_mp_1f1b_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": "1f1b"}),
                    Config(f"ds_mp_zb-h1_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": "zb-h1"}),
                    Config(f"ds_mp_zb-h1_paper_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": "zb-h1",
                                   "pipeline": {"zb_max_pending_w": "paper"}}),
                    Config(f"ds_mp_zb-h1_balanced_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": "zb-h1",
                                   "pipeline": {"partition": balanced_split(shape)}}),
                    Config(f"ds_mp_interleaved_M{M}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                           kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": "interleaved",
                                   "pipeline": {"virtual_stages": VIRTUAL}})]
    configs += [Config(f"{c.name[:-3]}_blocking_M8", c.setup, ranks=STAGES, kwargs={**c.kwargs, "post_sends": False})
                for c in configs if c.name in ("ds_mp_1f1b_M8", "ds_mp_zb-h1_M8", "ds_mp_interleaved_M8")]
    seq = shape["seq"]
    for order in ("gpipe", "1f1b"):
        configs.append(Config(f"terapipe_{order}", "benchmarks.schedules:setup_sched", ranks=STAGES,
                              kwargs={"shape": shape, "micro": ROWS, "gas": 4, "schedule": "terapipe",
                                      "terapipe": {"slices": [seq // SLICES] * SLICES, "order": order}}))
    measured: dict = {}

    def extra(groups: dict) -> None:
        for name, g in groups.items():
            if name.startswith("deepspeed") or "_blocking" in name:
                continue
            measured[name] = {"peak": g.call("activation_peak"), "held": [p for p, _ in g.call("held_peak")],
                              "traces": g.call("traced", traced),
                              "table": g.call("timetable")[0]}

    times, _ = run_side_by_side(configs, repeats, steps, extra=extra)
    res = summarize(times, {c.name: ROWS * c.kwargs.get("gas", c.kwargs.get("micro_batches", 1)) * shape["seq"]
                            for c in configs})

    def ratio(slow: str, fast: str) -> Any:
        return speedup(res[slow]["step_times_s"], res[fast]["step_times_s"])

    def cpu_ratio(slow: str, fast: str) -> Any:  # CPU seconds per step, both ranks: the work, not its overlap
        return speedup([c for _, c in times[slow]], [c for _, c in times[fast]])

    rows, summary, ratios = [], [], {}
    for M in (4, 8):
        for fast, base, target in ((f"ds_mp_zb-h1_M{M}", f"deepspeed_1f1b_M{M}", ZB_TARGET),
                                   (f"ds_mp_zb-h1_M{M}", f"ds_mp_1f1b_M{M}", None),
                                   (f"ds_mp_zb-h1_paper_M{M}", f"deepspeed_1f1b_M{M}", ZB_TARGET),
                                   (f"ds_mp_1f1b_M{M}", f"deepspeed_1f1b_M{M}", None),
                                   (f"ds_mp_zb-h1_balanced_M{M}", f"deepspeed_1f1b_M{M}", ZB_TARGET),
                                   (f"ds_mp_zb-h1_balanced_M{M}", f"ds_mp_1f1b_M{M}", None),
                                   (f"ds_mp_interleaved_M{M}", f"deepspeed_1f1b_M{M}", INTERLEAVED_TARGET),
                                   (f"ds_mp_interleaved_M{M}", f"ds_mp_1f1b_M{M}", None)):
            r, c = ratio(base, fast), cpu_ratio(base, fast)
            ratios[f"{fast}/{base}"] = {**r.as_dict(), "cpu": c.as_dict()}
            rows.append([fast, base, str(r), str(c), f"≥ {target}×: {r.verdict(target)}" if target else ""])
    for name in ("1f1b", "zb-h1", "interleaved"):
        fast, base = f"ds_mp_{name}_M8", f"ds_mp_{name}_blocking_M8"
        r, c = ratio(base, fast), cpu_ratio(base, fast)
        ratios[f"{fast}/{base}"] = {**r.as_dict(), "cpu": c.as_dict()}
        rows.append([fast, base, str(r), str(c), ""])
    tp = ratio("terapipe_gpipe", "terapipe_1f1b")
    ratios["terapipe_1f1b/terapipe_gpipe"] = tp.as_dict()
    rows.append(["terapipe_1f1b", "terapipe_gpipe", str(tp), str(cpu_ratio("terapipe_gpipe", "terapipe_1f1b")),
                 f"within {SLICED_TIME:.0%}: {tp.verdict(1 - SLICED_TIME)}"])
    mem_rows = []
    for name in measured:
        mem_rows.append([name] + [f"{p / 2**20:.1f}" for p in measured[name]["held"] + measured[name]["peak"]])
    peaks = {n: max(m["peak"]) for n, m in measured.items()}
    mem_ratio = peaks["terapipe_1f1b"] / peaks["terapipe_gpipe"]
    summary.append(f"token-sliced 1F1B: {tp} of TeraPipe's GPipe-order speed at {mem_ratio:.2f}× its peak saved "
                   f"activations (target ≤ {SLICED_MEMORY}: {'met' if mem_ratio <= SLICED_MEMORY else 'NOT met'})")
    held = {n: max(m["held"]) for n, m in measured.items()}
    for M in (4, 8):
        one = held[f"ds_mp_1f1b_M{M}"]
        zb = held[f"ds_mp_zb-h1_M{M}"] / one
        summary.append(f"M={M}: peak held memory (largest rank) over ds_mp 1f1b's: zb-h1 {zb:.2f}× (target ≤ "
                       f"{ZB_MEMORY}: {'met' if zb <= ZB_MEMORY else 'NOT met'}), the paper's deferral "
                       f"{held[f'ds_mp_zb-h1_paper_M{M}'] / one:.2f}×, interleaved "
                       f"{held[f'ds_mp_interleaved_M{M}'] / one:.2f}×; zb-h1 with the split {balanced_split(shape)} "
                       f"{held[f'ds_mp_zb-h1_balanced_M{M}'] / one:.2f}×")
    sim_rows, stage_costs = [], {}
    for name, m in measured.items():
        kind = "zb-h1" if "zb-h1" in name else "interleaved" if "interleaved" in name else "other"
        pred, info = predict(m["table"], m["traces"], kind)
        traced_step = statistics.median(makespans(m["traces"]))
        stage_costs[name] = {**info, "traced_makespan_s": traced_step}
        err = pred / traced_step - 1
        sim_rows.append([name, f"{res[name]['median_s']:.3f}", f"{traced_step:.3f}", f"{pred:.3f}", f"{err:+.1%}",
                         "met" if abs(err) <= SIM_TARGET else "NOT met", "measured"])
    zb = stage_costs["ds_mp_zb-h1_M8"]["stage_costs"]
    proj = projections(zb["F"], zb["B"], zb["W"])
    summary.append(f"projected with the measured F:B:W = {zb['F']:.3f}:{zb['B']:.3f}:{zb['W']:.3f} s: "
                   + "; ".join(f"{r[0]} zb-h1 {r[1]} (the paper's deferral {r[2]}), interleaved v=2 {r[3]} over 1F1B"
                               for r in proj))
    return {"workload": f"{Shape(**shape).describe()}; PP=2, {ROWS} rows per micro-batch",
            "repeats": repeats, "steps_per_repeat": steps, "results": res, "ratios": ratios,
            "stage_costs": stage_costs, "summary": summary,
            "tables": [table("Speed (ratio of median step times, 90% interval) and CPU work (ratio of median CPU "
                             "seconds per step over both ranks; > 1: less work)",
                             ["config", "over", "speed-up", "CPU work", "target"], rows),
                       table("Peak held memory per rank (MiB; storage census after every instruction) and peak saved "
                             "activations alone", ["config", "held rank 0", "held rank 1", "saved rank 0",
                                                   "saved rank 1"], mem_rows),
                       table("Simulator vs measured step (the traced steps' op costs, p2p latency 0)",
                             ["config", "median step s", "traced step s", "predicted s", "error vs traced",
                              f"within {SIM_TARGET:.0%}", "row"],
                             sim_rows),
                       table("Projected step-time gain over 1F1B (simulator, measured F:B:W)",
                             ["shape", "zb-h1", "zb-h1 paper", "interleaved v=2", "row"], proj)]}
