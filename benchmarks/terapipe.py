"""TeraPipe PP=2 on one long sequence: the planner's slicing against DeepSpeed 1F1B, GPipe and
uniform slicings, each next to the simulator's prediction.

Configurations (GPT-2 8 × 512, vocab 8192, batch 1 × 1024 tokens, 2 ranks × 1 thread unless noted):

    hf_1x1          1 process × 1 thread, plain HF                       (the physical reference)
    deepspeed_1f1b  plain DeepSpeed PipelineModule + TrainSchedule, M = 1 (the whole batch)
    gpipe           ds_mp GPipe, M = 1
    terapipe_dp     ds_mp TeraPipe, slices from the DP planner (``plan_for``) on a cost model
                    profiled here, one stage per rank (``profile_engine_stage``)
    uniform_<n>     ds_mp TeraPipe, n equal slices, n ∈ {1, 2, 4, 8, 16} (+ the cost model's best n)

The ds_mp configurations share one pair of processes: ``ScheduleBench.use`` switches the
engine's schedule and TeraPipe plan before each configuration's steps (the module is built
with ``dynamic_shape=True``, as TeraPipe needs; GPipe then re-announces shapes on every send,
a few small messages per step).  The cost model is saved to ``<out_dir>/terapipe_profile_<tag>.json``
(a ``ds_mp.terapipe.profile`` file) with the raw per-rank samples beside it, and reused: delete
both to profile again.  Predictions: ``ds_mp.schedules.simulate`` on the timetable of each
configuration with per-stage costs t_s(l, c) fitted on rank s's samples, split into forward /
backward by the fraction measured in the traced DP step.  Optimizer step, loss and p2p are
not in the model, so predictions sit a little under the measurements.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any, Iterator, Sequence

from benchmarks.common import Config, Group, fmt_ratio, interleave, speedup, summarize, table
from benchmarks.workloads import DsMpBench, Shape, batch, ds_mp_config, hf_model

DESCRIPTION = "TeraPipe PP=2, batch 1 × 1024 tokens: DP slicing vs DeepSpeed 1F1B (M=1), GPipe, uniform slicings"
TARGET_VS_1F1B, TARGET_VS_UNIFORM = 1.5, 1.05
STAGES, GRANULARITY, SWEEP = 2, 16, (1, 2, 4, 8, 16)
FIT_WARNING = 0.15  # mean relative fit error above which the profile is called unreliable
FULL = Shape(n_layer=8, n_embd=512, n_head=8, vocab=8192, seq=1024, n_positions=1024)
QUICK = Shape(n_layer=4, n_embd=256, n_head=8, vocab=4096, seq=256, n_positions=256)


# ------------------------------------------------------------------ workers (shared with simulator.py)

class ScheduleBench(DsMpBench):
    """A ds_mp pipeline built for TeraPipe that can run any registered schedule and plan."""

    def __init__(self, rank: int, world: int, shape: dict, micro: int, gas: int = 1,
                 slices: Sequence[int] | None = None, partition: str | list = "uniform",
                 output_dir: str = "") -> None:
        import ds_mp

        cfg = ds_mp_config(shape, pp=world, micro=micro, gas=gas, schedule="terapipe")
        cfg["ds_mp"]["terapipe"] = {"slices": list(slices or [shape["seq"]]), "granularity": GRANULARITY}
        cfg["ds_mp"]["pipeline"]["partition"] = partition
        if output_dir:  # where a "cost" partition keeps its per-layer profile
            cfg["ds_mp"]["training"] = {"output_dir": output_dir}
        self.engine, self.opt, _, _ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        ids, labels = batch(shape, micro * gas)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, micro * gas, micro)]
        self.seq = shape["seq"]

    def parts(self) -> list[int]:
        """Pipeline layer boundaries of the stages (the partition chosen at build)."""
        return list(self.engine.module.parts)

    def use(self, schedule: str, plan: list | None = None) -> None:
        """Run ``schedule`` from now on; for TeraPipe with ``plan`` = [(rows, token slices)]."""
        from ds_mp.engine import terapipe

        self.engine.schedule_name = schedule
        if plan is not None:  # the engine side of TeraPipe with a fixed plan
            self.engine.schedule_support = terapipe.attach(self.engine)
            self.engine.schedule_support.plan = [(b, list(s)) for b, s in plan]

    def profile(self, granularity: int) -> list[tuple[int, int, float]]:
        """(i, j, seconds) of this rank's stage: forward+backward of i tokens after j."""
        from ds_mp.engine.terapipe_profile import profile_engine_stage

        return profile_engine_stage(self.engine, self.seq, granularity)

    def transfer(self, granularity: int) -> list[float]:
        """Collective: this rank's p2p seconds per slice at the profile's table lengths."""
        from ds_mp.engine.terapipe_profile import profile_grid, profile_transfer

        return profile_transfer(self.engine, profile_grid(self.seq, granularity)[0])

    def trace(self) -> dict | None:
        """Collective: one traced step, every rank's events on rank 0 (None elsewhere)."""
        from ds_mp.tools.viz import gather_trace

        self.engine.trace.clear()
        self.engine.trace_enabled = True
        self.step()
        self.engine.trace_enabled = False
        return gather_trace(self.engine)


def setup_schedule_bench(rank: int, world: int, **kwargs: Any) -> ScheduleBench:
    return ScheduleBench(rank, world, **kwargs)


class Variant:
    """A configuration run by a shared group: ``steps`` first switches the group to it."""

    def __init__(self, group: Group, name: str, schedule: str, plan: list | None = None) -> None:
        self.group, self.schedule, self.plan = group, schedule, plan
        self.cfg = Config(name, group.cfg.setup, group.cfg.ranks, group.cfg.threads)

    def steps(self, k: int) -> list[tuple[float, float]]:
        self.group.call("use", self.schedule, self.plan)
        return self.group.steps(k)


@contextlib.contextmanager
def started(configs: list[Config]) -> Iterator[dict[str, Group]]:
    """Start every group at once, wait until all are built, close them all on exit."""
    groups: dict[str, Group] = {}
    t0 = time.perf_counter()
    try:
        for cfg in configs:
            groups[cfg.name] = Group(cfg)
        for g in groups.values():
            g.wait_ready()
            print(f"  ready: {g.cfg.name} ({g.cfg.ranks} rank(s)) after {time.perf_counter() - t0:.0f}s", flush=True)
        yield groups
    finally:
        for g in groups.values():
            g.close()


def fit_stages(per_rank: list[list]) -> tuple[list, Any, list[float], float]:
    """Per-stage cost models, the bottleneck model (slowest rank per (i, j), what the planner
    uses), and their mean relative fit errors."""
    from ds_mp.schedules.terapipe.cost_model import fit_cost_model

    fits = [fit_cost_model([tuple(x) for x in samples]) for samples in per_rank]
    worst: dict[tuple[int, int], float] = {}
    for samples in per_rank:
        for i, j, t in samples:
            worst[i, j] = max(worst.get((i, j), 0.0), t)
    bottleneck, err = fit_cost_model([(i, j, t) for (i, j), t in sorted(worst.items())])
    return [m for m, _ in fits], bottleneck, [e for _, e in fits], err


def table_model(per_rank: list[list], transfer: list[list[float]] | None) -> Any:
    """The engine's cost model (``measure_cost_model``'s): the paper's table fitted on the slowest
    rank per (i, j), plus the slowest rank's p2p time per slice."""
    from ds_mp.schedules.terapipe.cost_model import fit_table_cost_model

    worst: dict[tuple[int, int], float] = {}
    for samples in per_rank:
        for i, j, t in samples:
            worst[i, j] = max(worst.get((i, j), 0.0), t)
    model, _ = fit_table_cost_model([(i, j, t) for (i, j), t in sorted(worst.items())])
    return model.with_transfer([max(col) for col in zip(*transfer)]) if transfer else model


def load_or_profile(group: Group, path: str, meta: dict, passes: int = 2) -> tuple[list[list], Any, float]:
    """Per-rank profile samples and p2p times per slice: from ``<path>`` (+ ``_samples.json``) if
    saved, else measured now on ``group`` (``passes`` times, the fastest per (i, j): load spikes
    from other processes only ever add time) and saved, with the engine's cost model
    (:func:`table_model`) at ``path``.  Also returns the 1-min load average when the profile was taken."""
    samples_path = path.replace(".json", "_samples.json")
    if os.path.isfile(path) and os.path.isfile(samples_path):
        with open(samples_path) as f:
            saved = json.load(f)
        print(f"  reusing the cost-model profile {samples_path} (taken {saved['date']}, "
              f"load {saved['load_avg_1m']})")
        if "transfer" not in saved:  # saved before p2p was profiled: measure it now, keep the rest
            saved["transfer"] = group.call("transfer", GRANULARITY)
            table_model(saved["per_rank"], saved["transfer"]).save(path)
            with open(samples_path, "w") as f:
                json.dump(saved, f, indent=1)
        return saved["per_rank"], saved["transfer"], saved["load_avg_1m"]
    load, t0 = round(os.getloadavg()[0], 2), time.perf_counter()
    runs = [group.call("profile", GRANULARITY) for _ in range(passes)]
    per_rank = [[[i, j, min(run[r][k][2] for run in runs)] for k, (i, j, _) in enumerate(runs[0][r])]
                for r in range(len(runs[0]))]
    t1 = time.perf_counter()
    transfer = group.call("transfer", GRANULARITY)
    print(f"  profiled every stage ({passes} passes) in {t1 - t0:.0f}s, p2p in {time.perf_counter() - t1:.1f}s "
          f"(1-min load {load})", flush=True)
    table_model(per_rank, transfer).save(path)
    with open(samples_path, "w") as f:
        json.dump({**meta, "per_rank": per_rank, "transfer": transfer, "granularity": GRANULARITY, "passes": passes,
                   "load_avg_1m": load, "compute_profile_s": round(t1 - t0, 2), "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                  f, indent=1)
    return per_rank, transfer, load


def predict(timetable: list, slices: Sequence[int], stage_costs: list, fwd: list[float]) -> float:
    """Simulated iteration time: op (F|B, slice i) on stage s costs fwd_s | 1 − fwd_s of t_s(l_i, c_i)."""
    from ds_mp.schedules.simulate import simulate
    from ds_mp.schedules.terapipe.planner import slice_costs

    t = [slice_costs(slices, c) for c in stage_costs]
    return simulate(timetable, lambda s, op: t[s][op.slice] * (fwd[s] if op.kind == "F" else 1 - fwd[s])
                    ).iteration_time


def compute_s(events: list, kinds: tuple = ("forward", "backward")) -> float:
    """Seconds of a rank's traced events of the given instruction kinds."""
    from ds_mp.tools.viz import instruction_kind

    return sum(e - s for n, _, s, e in events if instruction_kind(n) in kinds)


# ------------------------------------------------------------------ the benchmark

def run(quick: bool, out_dir: str) -> dict:
    from ds_mp.schedules.simulate import one_f_one_b_timetable, terapipe_timetable
    from ds_mp.schedules.terapipe.planner import predicted_time, slice_costs, uniform_slices
    from ds_mp.schedules.terapipe.planner import plan_for
    from ds_mp.tools.viz import timeline_png, write_chrome_trace

    s = QUICK if quick else FULL
    shape, L, K = asdict(s), s.seq, STAGES
    repeats, steps = (2, 1) if quick else (10, 1)  # 10 interleaved rounds: a 90% interval of ~±3%
    tag = f"{s.n_layer}x{s.n_embd}_v{s.vocab}_L{L}_b1_pp{K}"
    configs = [Config("hf_1x1", "benchmarks.workloads:setup_hf", 1, 1, {"shape": shape, "rows": 1}),
               Config("deepspeed_1f1b", "benchmarks.pipeline:setup_deepspeed_pipe", K, 1,
                      {"shape": shape, "rows": 1, "micro_batches": 1}),
               # ds_mp's stages balanced by measured layer cost (the head + loss weigh about 1.3 blocks)
               Config("ds_mp", "benchmarks.terapipe:setup_schedule_bench", K, 1,
                      {"shape": shape, "micro": 1, "partition": "cost", "output_dir": tempfile.mkdtemp()})]
    with started(configs) as groups:
        per_rank, transfer, profile_load = load_or_profile(
            groups["ds_mp"], os.path.join(out_dir, f"terapipe_profile_{tag}.json"),
            {"shape": shape, "stages": K, "micro_batch": 1})
        stage_costs, _, stage_err, err = fit_stages(per_rank)
        cost = table_model(per_rank, transfer)  # what the engine's slices="auto" plans with
        dp = plan_for(cost, 1, L, K, 1, GRANULARITY)[0][1]
        best_m = len(best_uniform_g(L, K, cost))
        sweep = sorted(set(SWEEP) | {best_m})
        slicings = {"terapipe_dp": dp, **{f"uniform_{m}": uniform_slices(L, m) for m in sweep}}
        print(f"  DP plan ({len(dp)} slices): {dp}; cost-model best uniform: {best_m} slices; "
              f"fit error {err:.1%} (stages {', '.join(f'{e:.1%}' for e in stage_err)})", flush=True)
        ds = groups["ds_mp"]
        runs = [groups["hf_1x1"], groups["deepspeed_1f1b"], Variant(ds, "gpipe", "gpipe")]
        runs += [Variant(ds, n, "terapipe", [(1, sl)]) for n, sl in slicings.items()]
        times = interleave(runs, repeats, steps)
        ds.call("use", "terapipe", [(1, dp)])
        traces = ds.call("trace")[0]
        parts = ds.call("parts")[0]
    write_chrome_trace(traces, os.path.join(out_dir, "timeline_terapipe.json"))
    tl = timeline_png(traces, os.path.join(out_dir, "timeline_terapipe.png"),
                      f"ds_mp TeraPipe, PP={K}, 1 × {L} tokens, DP slices {dp}")
    fwd = [compute_s(traces[r], ("forward",)) / compute_s(traces[r]) for r in sorted(traces)]
    inflation = [compute_s(traces[r]) / sum(slice_costs(dp, c)) for r, c in enumerate(stage_costs)]
    regime = planner_regime(cost, L)

    res = summarize(times, {r.cfg.name: L for r in runs})
    med = {n: r["median_s"] for n, r in res.items()}
    pred = {n: predict(terapipe_timetable(K, len(sl)), sl, stage_costs, fwd) for n, sl in slicings.items()}
    pred["gpipe"] = pred["deepspeed_1f1b"] = predict(one_f_one_b_timetable(K, 1), [L], stage_costs, fwd)
    pred["hf_1x1"] = sum(c(L, 0) for c in stage_costs)  # both stages' work, one after the other
    fast = {n: min(r["step_times_s"]) for n, r in res.items()}  # nearest to an idle machine
    uniform = {n: med[n] for n in slicings if n.startswith("uniform_")}
    best_u, best_fast = min(uniform, key=uniform.get), min(fast[n] for n in uniform)
    ratios = {"terapipe_dp_vs_deepspeed_1f1b": med["deepspeed_1f1b"] / med["terapipe_dp"],
              "terapipe_dp_vs_best_uniform": med[best_u] / med["terapipe_dp"],
              "terapipe_dp_vs_gpipe": med["gpipe"] / med["terapipe_dp"],
              "fastest_step_dp_vs_deepspeed_1f1b": fast["deepspeed_1f1b"] / fast["terapipe_dp"],
              "fastest_step_dp_vs_best_uniform": best_fast / fast["terapipe_dp"],
              **{f"{n}_tokens_per_s_vs_1x1": med["hf_1x1"] / m for n, m in med.items()},
              "predicted_dp_vs_best_uniform": min(pred[n] for n in uniform) / pred["terapipe_dp"],
              "planner_objective_dp_vs_best_uniform":
                  predicted_time(slicings[f"uniform_{best_m}"], K, cost) / predicted_time(dp, K, cost)}
    wall = {n: r["step_times_s"] for n, r in res.items()}
    r1 = speedup(wall["deepspeed_1f1b"], wall["terapipe_dp"])  # tokens/s ratio: equal tokens per step
    r2 = speedup(wall[best_u], wall["terapipe_dp"])
    intervals = {"terapipe_dp_vs_deepspeed_1f1b": r1.as_dict(), "terapipe_dp_vs_best_uniform": r2.as_dict()}
    summary = [f"TeraPipe (DP plan, {len(dp)} slices) vs DeepSpeed 1F1B M=1, tokens/s: {r1} "
               f"(target ≥ {TARGET_VS_1F1B}×: {r1.verdict(TARGET_VS_1F1B)})",
               f"DP plan vs best measured uniform slicing ({best_u}): {r2} "
               f"(target ≥ {TARGET_VS_UNIFORM}×: {r2.verdict(TARGET_VS_UNIFORM)}); "
               f"the simulator predicts {ratios['predicted_dp_vs_best_uniform']:.2f}×, the planner's own "
               f"objective (eq. 5) {ratios['planner_objective_dp_vs_best_uniform']:.2f}×",
               f"each configuration's fastest step (a load-robust view: external load slows the two busy "
               f"ranks of a pipelined step more than the one busy rank of an unsliced one): DP vs 1F1B "
               f"{ratios['fastest_step_dp_vs_deepspeed_1f1b']:.2f}×, DP vs best uniform "
               f"{ratios['fastest_step_dp_vs_best_uniform']:.2f}×",
               f"TeraPipe DP tokens/s vs 1 process × 1 thread: {ratios['terapipe_dp_tokens_per_s_vs_1x1']:.2f}× "
               f"(2 ranks on 2 cores: at most 2×); traced bubble {tl['bubble']:.1%}",
               f"cost model: {len(per_rank[0])} samples per stage, mean relative fit error {err:.1%} "
               f"(per stage {', '.join(f'{e:.1%}' for e in stage_err)}); forward share of F+B "
               f"{', '.join(f'{f:.2f}' for f in fwd)} per stage; traced F+B of the DP step = "
               f"{', '.join(f'{x:.2f}×' for x in inflation)} the profile's per stage (the simulator's gap)",
               "planner's predicted DP gain over the best uniform slicing, same stage cost model (not measured): "
               + ", ".join(f"K={k} L={n}: {g:.3f}×" for (k, n), g in regime.items())]
    if err > FIT_WARNING:
        summary.append(f"WARNING: cost-model fit error {err:.0%} (profile taken at 1-min load {profile_load}): "
                       "the plan is unreliable; delete results/terapipe_profile_* and rerun on a quiet machine")
    for line in summary:
        print("  " + line)
    rows = [[n, f"{len(slicings[n])}" if n in slicings else "1", f"{med[n]:.3f}", f"{fast[n]:.3f}", f"{pred[n]:.3f}",
             f"{pred[n] / med[n] - 1:+.0%}", str(speedup(wall["deepspeed_1f1b"], wall[n])),
             fmt_ratio(ratios[f"{n}_tokens_per_s_vs_1x1"]), f"±{res[n]['iqr_rel']:.0%}"] for n in med]
    plot = sweep_plot(os.path.join(out_dir, "terapipe.png"),
                      {int(n.split("_")[1]): (med[n], pred[n]) for n in uniform},
                      (len(dp), med["terapipe_dp"], pred["terapipe_dp"]), med["deepspeed_1f1b"], L)
    for n in med:
        res[n].update(predicted_s=pred[n], slices=slicings.get(n, [L]))
    return {"workload": s.describe() + f", batch 1 × {L}, PP={K}, 2 ranks × 1 thread; ds_mp pipeline layer "
                        f"boundaries {parts} (partition \"cost\"; DeepSpeed's 1F1B on its default split)",
            "configs": res, "ratios": ratios, "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "dp_slices": dp, "cost_model": cost.to_dict(), "intervals": intervals, "fit_error": err, "stage_fit_errors": stage_err,
            "forward_fraction": fwd, "trace": tl, "traced_vs_profiled_compute": inflation,
            "planner_dp_vs_uniform_by_stages_and_length": {f"K{k}_L{n}": g for (k, n), g in regime.items()},
            "plots": [os.path.basename(plot), "timeline_terapipe.png"],
            "tables": [table("iteration time: measured (median) vs simulated", [
                "config", "slices", "measured s (median)", "fastest step s", "simulated s", "sim error",
                "speed-up vs DeepSpeed 1F1B", "tokens/s vs 1×1", "step-time IQR"], rows)]}


def best_uniform_g(L: int, K: int, cost: Any) -> list[int]:
    """The best (eq. 5) uniform slicing in the planner's own search space: slices of equal
    length, a multiple of the granularity (a uniform slicing off that grid is not a candidate of
    the DP, so comparing with it would not measure the planner)."""
    from ds_mp.schedules.terapipe.planner import predicted_time, uniform_slices

    ms = [m for m in range(1, L // GRANULARITY + 1) if L % m == 0 and (L // m) % GRANULARITY == 0]
    return min((uniform_slices(L, m) for m in ms), key=lambda s: predicted_time(s, K, cost))


def planner_regime(cost: Any, L: int) -> dict[tuple[int, int], float]:
    """Planner objective (eq. 5) of the best uniform slicing / the DP plan's, for K stages of
    the same per-stage cost and sequences L and 2L: where the DP pays off (large K)."""
    from ds_mp.schedules.terapipe.planner import predicted_time
    from ds_mp.schedules.terapipe.planner import plan_for

    out = {}
    for K in (2, 8, 32):
        for n in (L, 2 * L):
            dp = plan_for(cost, 1, n, K, 1, GRANULARITY)[0][1]
            out[K, n] = predicted_time(best_uniform_g(n, K, cost), K, cost) / predicted_time(dp, K, cost)
    return out


def sweep_plot(path: str, uniform: dict[int, tuple[float, float]], dp: tuple[int, float, float],
               one_f_one_b: float, L: int) -> str:
    """Iteration time vs number of uniform slices (the paper's Figure 6), DP plan marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(uniform)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, [uniform[x][0] for x in xs], "o-", color="#4C72B0", label="uniform slicing, measured")
    ax.plot(xs, [uniform[x][1] for x in xs], "o--", color="#4C72B0", alpha=0.5, mfc="none",
            label="uniform slicing, simulated")
    ax.plot([dp[0]], [dp[1]], "*", ms=16, color="#C44E52", label=f"DP plan ({dp[0]} slices), measured")
    ax.plot([dp[0]], [dp[2]], "*", ms=16, color="#C44E52", mfc="none", label="DP plan, simulated")
    ax.axhline(one_f_one_b, color="grey", ls=":", label="DeepSpeed 1F1B M=1, measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel(f"number of token slices (sequence of {L})")
    ax.set_ylabel("iteration time (s)")
    ax.set_ylim(0, max(one_f_one_b, *(v for p in uniform.values() for v in p)) * 1.1)
    ax.set_title("TeraPipe PP=2: iteration time vs slicing")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
