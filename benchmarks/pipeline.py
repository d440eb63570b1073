"""Pipeline parallelism PP=2: ds_mp 1F1B / GPipe against DeepSpeed's own PipelineModule.

Configurations (same GPT-2, same global batch of M = 8 micro-batches, 2 ranks × 1 thread
each unless noted):

    hf_1x1               1 process × 1 thread, plain HF on the whole batch   (reference)
    deepspeed_parameters plain DeepSpeed: GPT-2 layers as LayerSpecs in a PipelineModule,
                         DeepSpeed's PipelineEngine and TrainSchedule, its default
                         ``partition_method="parameters"``                  (the peer)
    deepspeed_uniform    the same with ``partition_method="uniform"``
    ds_mp_cost           ds_mp.initialize, "1f1b", ``"partition": "cost"``   (the issue's targets:
                         ≥ 1.55× hf_1x1 and ≥ 1.05× deepspeed_parameters in tokens/s)
    ds_mp_1f1b           ds_mp.initialize, "1f1b", ``"partition": "uniform"`` (engine parity: the
                         same split as deepspeed_uniform, step time ≤ 1.05× of it)
    ds_mp_gpipe          ds_mp.initialize, "gpipe", uniform

Every configuration's split (pipeline layer boundaries) is in the table.  The cost
partition is profiled once before the side-by-side groups start (a quiet machine, as at
the start of a training run; a fresh profile every run) and then read from its cache.
Ratios carry 90% bootstrap intervals and a target is "met" only when the interval clears it;
next to them, the gain over DeepSpeed's split that the simulator predicts from the measured
per-layer costs (what balancing alone can give: at this shape about 1.06×, blocks [5, 3]
instead of [4, 4] with the head + loss ≈ 1.3 blocks).
Also measured: peak saved-activation bytes per rank (autograd saved tensors, parameters
excluded; tracemalloc cannot see torch's allocator) for GPipe vs 1F1B, and one traced step of
ds_mp 1F1B (uniform and cost splits) and GPipe, drawn as ``timeline_<name>.png`` with the
measured bubble next to ``ds_mp.schedules.simulate``'s prediction from the same trace's mean
forward/backward durations per stage.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import (Config, Group, bar_chart, fmt_ratio, load_span, run_side_by_side, speedup, summarize,
                               table, tokens_ratio)
from benchmarks.workloads import LR, Bench, DsMpBench, Shape, batch, ds_mp_config, hf_model, shape_dict

DESCRIPTION = ("PP=2, M=8: ds_mp 1F1B with the cost-balanced split vs 1 process and DeepSpeed's PipelineModule "
               "(parameters, uniform); GPipe vs 1F1B time, memory, timelines")
VS_1X1_TARGET, VS_PEER_TARGET = 1.55, 1.05  # tokens/s of ds_mp_cost over hf_1x1 / over deepspeed_parameters
PARITY_TARGET = 1.05  # ds_mp_1f1b step time / deepspeed_uniform step time (same split): at most
STAGES, MICRO_BATCHES, ROWS = 2, 8, 2  # PP degree, M, rows per micro-batch


# ------------------------------------------------------------------ plain DeepSpeed peer

class Wte(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.wte = hf.transformer.wte


def _embed(module: Wte, ids: torch.Tensor) -> torch.Tensor:
    return module.wte(ids)


def _head(module: Wte, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, module.wte.weight)


class Wpe(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.wpe = hf.transformer.wpe

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return tok + self.wpe(torch.arange(tok.shape[1]).unsqueeze(0))


class Block(nn.Module):
    """HF ``GPT2Block`` (causal self-attention without a mask argument)."""

    def __init__(self, hf: Any, i: int) -> None:
        super().__init__()
        self.block = hf.transformer.h[i]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)


class LnF(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.ln_f = hf.transformer.ln_f

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: ``logits[:, t]`` predicts ``labels[:, t + 1]``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class DeepSpeedPipeBench(Bench):
    """Plain DeepSpeed: ``PipelineModule`` of LayerSpecs + ``deepspeed.initialize``."""

    def __init__(self, rank: int, world: int, shape: dict, partition_method: str = "parameters", rows: int = ROWS,
                 micro_batches: int = MICRO_BATCHES) -> None:
        import deepspeed
        import deepspeed.ops
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 1-min JIT build
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        hf = hf_model(shape)
        n = hf.config.n_layer
        layers = [TiedLayerSpec("wte", Wte, hf, forward_fn=_embed, tied_weight_attr=["wte.weight"]),
                  LayerSpec(Wpe, hf), *[LayerSpec(Block, hf, i) for i in range(n)], LayerSpec(LnF, hf),
                  TiedLayerSpec("wte", Wte, hf, forward_fn=_head, tied_weight_attr=["wte.weight"])]
        net = PipelineModule(layers=layers, num_stages=world, loss_fn=lm_loss, partition_method=partition_method)
        cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": micro_batches,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
               "steps_per_print": 10**9}
        self.engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        ids, labels = batch(shape, rows * micro_batches)
        self.micro = [(ids[i:i + rows], labels[i:i + rows]) for i in range(0, rows * micro_batches, rows)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self.micro)))

    def split(self) -> dict:
        return {"parts": [int(p) for p in self.engine.module.parts]}  # DeepSpeed's may be numpy ints


def setup_deepspeed_pipe(rank: int, world: int, shape: dict, **kwargs: Any) -> DeepSpeedPipeBench:
    return DeepSpeedPipeBench(rank, world, shape, **kwargs)


# ------------------------------------------------------------------ ds_mp with measurements

class ActivationMeter:
    """Peak bytes of tensors autograd keeps for backward (``saved_tensors_hooks``), each
    storage counted once while any saved reference to it lives; parameters excluded."""

    def __init__(self, params: Any) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        if ptr in self.live:
            self.live[ptr][1] += 1
        else:
            self.live[ptr] = [t.untyped_storage().nbytes(), 1]
            self.current += self.live[ptr][0]
            self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


class DsMpPipeBench(DsMpBench):
    """:class:`DsMpBench` with a ``pipeline.partition`` (its profile cache in ``output_dir``),
    plus activation-memory and trace measurements."""

    def __init__(self, rank: int, world: int, shape: dict, micro: int, gas: int, pp: int, schedule: str = "1f1b",
                 partition: str | list = "uniform", output_dir: str = "") -> None:
        import ds_mp

        cfg = ds_mp_config(shape, pp=pp, micro=micro, gas=gas, schedule=schedule)
        cfg["ds_mp"]["pipeline"]["partition"] = partition
        if output_dir:
            cfg["ds_mp"]["training"] = {"output_dir": output_dir}
        self.engine, self.opt, _, _ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        ids, labels = batch(shape, micro * gas)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, micro * gas, micro)]

    def split(self) -> dict:
        costs = self.engine.layer_costs
        return {"parts": list(self.engine.module.parts), "layer_costs_s": vars(costs) if costs else None}

    def activation_peak(self) -> int:
        meter = ActivationMeter(self.engine.module.parameters())
        with meter.hooks():
            self.step()
        return meter.peak

    def trace(self, out_dir: str, label: str) -> dict | None:
        """Collective: record one step, gather it; rank 0 writes ``timeline_<label>`` JSON + PNG, returns stats."""
        from ds_mp.tools.viz import gather_trace, timeline_png, write_chrome_trace

        self.engine.trace.clear()
        self.engine.trace_enabled = True
        self.step()
        self.engine.trace_enabled = False
        traces = gather_trace(self.engine)
        if traces is None:
            return None
        schedule = self.engine.schedule_name
        write_chrome_trace(traces, os.path.join(out_dir, f"timeline_{label}.json"))
        stats = timeline_png(traces, os.path.join(out_dir, f"timeline_{label}.png"),
                             f"ds_mp {schedule}, layers per stage {self.engine.module.parts}, PP={STAGES}, "
                             f"M={MICRO_BATCHES}")
        return {**stats, **simulated(traces, schedule)}


def setup_ds_mp_pipe(rank: int, world: int, **kwargs: Any) -> DsMpPipeBench:
    return DsMpPipeBench(rank, world, **kwargs)


def simulated(traces: dict[int, list], schedule: str) -> dict:
    """Simulator prediction from the trace's mean F/B seconds per stage, and the measured
    bubble over the forward/backward window (first forward start to last backward end)."""
    from ds_mp.schedules.simulate import gpipe_timetable, one_f_one_b_timetable, simulate
    from ds_mp.tools.viz import bubble_stats, instruction_kind

    cost = {}
    for stage, tr in traces.items():
        for kind in ("forward", "backward"):
            cost[stage, kind[0].upper()] = statistics.mean(e - s for n, _, s, e in tr if instruction_kind(n) == kind)
    table_fn = one_f_one_b_timetable if schedule == "1f1b" else gpipe_timetable
    sim = simulate(table_fn(len(traces), MICRO_BATCHES), lambda s, op: cost[s, op.kind])
    fb = [(n, b, s, e) for tr in traces.values() for n, b, s, e in tr if instruction_kind(n) in ("forward", "backward")]
    lo, hi = min(s for _, _, s, _ in fb), max(e for _, _, _, e in fb)
    window = {r: [ev for ev in tr if ev[2] >= lo and ev[3] <= hi] for r, tr in traces.items()}
    return {"simulated_bubble": sim.bubble_fraction, "simulated_makespan_s": sim.iteration_time,
            "fb_window_bubble": bubble_stats(window)["bubble"], "fb_window_s": hi - lo,
            "op_costs_s": {f"{s}{k}": v for (s, k), v in cost.items()}}


# ------------------------------------------------------------------ the benchmark

TRACED = {"1f1b": "ds_mp_1f1b", "cost": "ds_mp_cost", "gpipe": "ds_mp_gpipe"}  # timeline label -> config


def configs(quick: bool, profile_dir: str) -> list[Config]:
    shape = shape_dict(quick)
    mp = {"shape": shape, "micro": ROWS, "gas": MICRO_BATCHES, "pp": STAGES}
    ds = "benchmarks.pipeline:setup_deepspeed_pipe"
    return [Config("hf_1x1", "benchmarks.workloads:setup_hf", 1, 1, {"shape": shape, "rows": ROWS * MICRO_BATCHES}),
            Config("deepspeed_parameters", ds, STAGES, 1, {"shape": shape, "partition_method": "parameters"}),
            Config("deepspeed_uniform", ds, STAGES, 1, {"shape": shape, "partition_method": "uniform"}),
            Config("ds_mp_cost", "benchmarks.pipeline:setup_ds_mp_pipe", STAGES, 1,
                   {**mp, "partition": "cost", "output_dir": profile_dir}),
            Config("ds_mp_1f1b", "benchmarks.pipeline:setup_ds_mp_pipe", STAGES, 1, {**mp, "schedule": "1f1b"}),
            Config("ds_mp_gpipe", "benchmarks.pipeline:setup_ds_mp_pipe", STAGES, 1, {**mp, "schedule": "gpipe"})]


def predicted_gain(costs: dict, split: dict, shape: dict) -> float:
    """Simulated 1F1B step time of DeepSpeed's ``parameters`` split over the cost split's, both
    priced with the measured per-layer costs (the head with the last stage, the embedding with
    the first)."""
    from ds_mp.schedules.simulate import one_f_one_b_timetable, simulate

    def step_time(parts: list[int]) -> float:
        first = parts[1] - 2  # layers 0, 1 are wte, wpe
        stage = [first * costs["block"] + costs["embed"],
                 (shape["n_layer"] - first) * costs["block"] + costs["head"]]
        table = one_f_one_b_timetable(STAGES, MICRO_BATCHES)
        return simulate(table, lambda s, op: stage[s] * (1 / 3 if op.kind == "F" else 2 / 3)).iteration_time

    return step_time(split["deepspeed_parameters"]["parts"]) / step_time(split["ds_mp_cost"]["parts"])


def profile_cost_split(cfg: Config) -> None:
    """Build the cost-partitioned engine alone, before anything else runs, so its per-layer
    profile is taken on a quiet machine and cached in its output_dir for the timed group."""
    group = Group(Config(cfg.name + "_profile", cfg.setup, cfg.ranks, cfg.threads, cfg.kwargs))
    try:
        group.wait_ready()
    finally:
        group.close()


def run(quick: bool, out_dir: str) -> dict:
    profile_dir = tempfile.mkdtemp(prefix="ds_mp_pipeline_bench_")
    try:
        return _run(quick, out_dir, profile_dir)
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)


def _run(quick: bool, out_dir: str, profile_dir: str) -> dict:
    cfgs = configs(quick, profile_dir)
    by_name = {c.name: c for c in cfgs}
    shape = shape_dict(quick)
    tokens = ROWS * MICRO_BATCHES * shape["seq"]
    repeats, steps = (2, 1) if quick else (10, 2)
    extra: dict[str, Any] = {}

    def measure(groups: dict) -> None:
        for name, g in groups.items():
            if name != "hf_1x1":
                extra[f"split_{name}"] = g.call("split")[0]
        for sched in ("1f1b", "gpipe"):
            extra[f"act_{sched}"] = groups[f"ds_mp_{sched}"].call("activation_peak")
        for label, name in TRACED.items():
            extra[f"trace_{label}"] = groups[name].call("trace", out_dir, label)[0]

    profile_cost_split(by_name["ds_mp_cost"])
    times, _ = run_side_by_side(cfgs, repeats, steps, extra=measure)
    res = summarize(times, {c.name: tokens for c in cfgs})
    wall = {n: r["step_times_s"] for n, r in res.items()}
    vs_1x1 = {c.name: tokens_ratio(res, c.name, "hf_1x1") for c in cfgs}
    vs_peer = {c.name: tokens_ratio(res, c.name, "deepspeed_parameters") for c in cfgs}
    cost_vs_uniform_peer = tokens_ratio(res, "ds_mp_cost", "deepspeed_uniform")
    cost_vs_ds_mp_uniform = tokens_ratio(res, "ds_mp_cost", "ds_mp_1f1b")
    parity = speedup(wall["ds_mp_1f1b"], wall["deepspeed_uniform"])  # time ratio, same split
    gpipe_time = speedup(wall["ds_mp_gpipe"], wall["ds_mp_1f1b"])
    act = {s: max(extra[f"act_{s}"]) for s in ("1f1b", "gpipe")}
    ratios = {f"{n}_tokens_per_s_vs_1x1": r.value for n, r in vs_1x1.items()}
    ratios.update({"ds_mp_cost_vs_deepspeed_parameters": vs_peer["ds_mp_cost"].value,
                   "ds_mp_cost_vs_deepspeed_uniform": cost_vs_uniform_peer.value,
                   "ds_mp_cost_vs_ds_mp_uniform": cost_vs_ds_mp_uniform.value,
                   "ds_mp_1f1b_time_vs_deepspeed_uniform": parity.value,
                   "gpipe_time_vs_1f1b": gpipe_time.value,
                   "gpipe_activation_peak_vs_1f1b": act["gpipe"] / act["1f1b"]})
    intervals = {"ds_mp_cost_vs_1x1": vs_1x1["ds_mp_cost"].as_dict(),
                 "ds_mp_cost_vs_deepspeed_parameters": vs_peer["ds_mp_cost"].as_dict(),
                 "ds_mp_cost_vs_deepspeed_uniform": cost_vs_uniform_peer.as_dict(),
                 "ds_mp_1f1b_time_vs_deepspeed_uniform": parity.as_dict()}
    split = {n: extra[f"split_{n}"] for n in by_name if n != "hf_1x1"}
    costs = split["ds_mp_cost"]["layer_costs_s"]
    summary = [f"ds_mp 1F1B, cost split {split['ds_mp_cost']['parts']}, tokens/s vs 1 × 1: {vs_1x1['ds_mp_cost']} "
               f"(target ≥ {VS_1X1_TARGET}×: {vs_1x1['ds_mp_cost'].verdict(VS_1X1_TARGET)})",
               f"ds_mp 1F1B, cost split, tokens/s vs DeepSpeed PipelineModule (parameters, "
               f"{split['deepspeed_parameters']['parts']}): {vs_peer['ds_mp_cost']} (target ≥ {VS_PEER_TARGET}×: "
               f"{vs_peer['ds_mp_cost'].verdict(VS_PEER_TARGET)})",
               f"ds_mp 1F1B, cost split, tokens/s vs DeepSpeed PipelineModule (uniform, "
               f"{split['deepspeed_uniform']['parts']}): {cost_vs_uniform_peer}; vs ds_mp uniform: "
               f"{cost_vs_ds_mp_uniform}",
               f"measured costs per micro-batch (forward + backward): embedding {1e3 * costs['embed']:.1f} ms, "
               f"block {1e3 * costs['block']:.1f} ms, ln_f + head + loss {1e3 * costs['head']:.1f} ms; from them "
               f"ds_mp.schedules.simulate predicts the cost split at {predicted_gain(costs, split, shape):.3f}× the "
               "tokens/s of DeepSpeed's parameters split (compute only, backward = 2 × forward)"
               if costs else "no cost profile",
               f"engine parity, same uniform split: ds_mp 1F1B step time vs DeepSpeed {parity} (target ≤ "
               f"{PARITY_TARGET}×: {parity.verdict(PARITY_TARGET, at_least=False)})",
               f"GPipe vs 1F1B: time {gpipe_time}, peak saved activations per rank "
               f"{ratios['gpipe_activation_peak_vs_1f1b']:.2f}×",
               "intervals are 90% bootstrap intervals over the timed steps"]
    rows = [[c.name, f"{c.ranks} × {c.threads}", str(split[c.name]["parts"]) if c.name in split else "—",
             str(vs_1x1[c.name]), str(vs_peer[c.name]), f"±{res[c.name]['iqr_rel']:.0%}",
             fmt_ratio(res[c.name]["cpu_s"] / res["deepspeed_parameters"]["cpu_s"]), load_span(res[c.name])]
            for c in cfgs]
    bubbles = []
    for label, name in TRACED.items():
        t = extra[f"trace_{label}"]
        res[name]["trace"] = t
        mem = f"{act[label] / 2**20:.0f} MiB" if label in act else "—"
        bubbles.append([label, str(split[name]["parts"]), f"{t['bubble']:.1%}", f"{t['fb_window_bubble']:.1%}",
                        f"{t['simulated_bubble']:.1%}", fmt_ratio(t["fb_window_s"] / t["simulated_makespan_s"]), mem])
        summary.append(f"{label}: bubble measured {t['bubble']:.1%} (whole step), {t['fb_window_bubble']:.1%} "
                       f"(F/B window) vs simulated {t['simulated_bubble']:.1%}")
    for sched in ("1f1b", "gpipe"):
        res[f"ds_mp_{sched}"]["activation_peak_bytes"] = extra[f"act_{sched}"]
    for n, sp in split.items():
        res[n]["split"] = sp
    for line in summary:
        print("  " + line)
    names = [c.name for c in cfgs]
    plot = bar_chart(os.path.join(out_dir, "pipeline.png"), names, [vs_1x1[n].value for n in names],
                     "tokens/s vs 1 process × 1 thread", "ratio", target=VS_1X1_TARGET)
    return {"workload": Shape(**shape).describe() + f", PP={STAGES}, M={MICRO_BATCHES} micro-batches × {ROWS} rows",
            "configs": res, "ratios": ratios, "intervals": intervals, "summary": summary, "repeats": repeats,
            "steps_per_repeat": steps,
            "plots": [os.path.basename(plot), *(f"timeline_{label}.png" for label in TRACED)],
            "tables": [table("throughput", ["config", "ranks × threads", "layer boundaries (parts)",
                                            "tokens/s vs 1×1 [90% interval]",
                                            "tokens/s vs DeepSpeed parameters [90% interval]", "step-time IQR",
                                            "CPU s/step (all ranks) vs DeepSpeed parameters",
                                            "load before → after (max)"], rows),
                       table("bubble (one traced step) and memory",
                             ["traced", "parts", "bubble (whole step)", "bubble (F/B window)", "simulated bubble",
                              "F/B window vs simulated makespan", "peak saved activations / rank"], bubbles)]}
