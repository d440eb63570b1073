"""Pipeline parallelism PP=2: ds_mp 1F1B / GPipe against DeepSpeed's own PipelineModule.

Configurations (same GPT-2, same global batch of M = 4 micro-batches, 2 ranks × 1 thread
each unless noted):

    hf_1x1        1 process × 1 thread, plain HF on the whole batch      (reference)
    deepspeed_1f1b plain DeepSpeed: GPT-2 layers as LayerSpecs in a PipelineModule,
                  DeepSpeed's PipelineEngine and TrainSchedule          (the peer)
    ds_mp_1f1b    ds_mp.initialize, schedule "1f1b"                    (target ≤ 1.05× the peer's time)
    ds_mp_gpipe   ds_mp.initialize, schedule "gpipe"

Both pipelines split the same way: stage 0 = embedding + positions + 4 blocks, stage 1 =
4 blocks + ln_f + tied head + loss.  Also measured: peak saved-activation bytes per rank
(autograd saved tensors, parameters excluded; tracemalloc cannot see torch's allocator)
for GPipe vs 1F1B, and one traced step of each ds_mp schedule, drawn as
``timeline_<schedule>.png`` with the measured bubble next to ``ds_mp.schedules.simulate``'s
prediction from the same trace's mean forward/backward durations per stage.
"""
from __future__ import annotations

import os
import statistics
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import Config, bar_chart, fmt_ratio, run_side_by_side, summarize, table
from benchmarks.workloads import LR, Bench, DsMpBench, Shape, batch, hf_model, shape_dict

DESCRIPTION = "PP=2, M=4: ds_mp 1F1B vs DeepSpeed PipelineModule; GPipe vs 1F1B time, memory, timelines"
PEER_TARGET = 1.05  # ds_mp 1F1B time / DeepSpeed time
STAGES, MICRO_BATCHES, ROWS = 2, 4, 2  # PP degree, M, rows per micro-batch


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

    def __init__(self, rank: int, world: int, shape: dict, rows: int = ROWS,
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
        net = PipelineModule(layers=layers, num_stages=world, loss_fn=lm_loss, partition_method="type:Block")
        want = [0, 2 + n // 2, n + 4]
        if net.parts != want:
            raise RuntimeError(f"DeepSpeed split the layers as {net.parts}, ds_mp as {want}; fix the partition")
        cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": micro_batches,
               "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
               "steps_per_print": 10**9}
        self.engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        ids, labels = batch(shape, rows * micro_batches)
        self.micro = [(ids[i:i + rows], labels[i:i + rows]) for i in range(0, rows * micro_batches, rows)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self.micro)))


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
    """:class:`DsMpBench` plus activation-memory and trace measurements."""

    def activation_peak(self) -> int:
        meter = ActivationMeter(self.engine.module.parameters())
        with meter.hooks():
            self.step()
        return meter.peak

    def trace(self, out_dir: str, schedule: str) -> dict | None:
        """Collective: record one step, gather it; rank 0 writes JSON + PNG, returns stats."""
        from ds_mp.tools.viz import gather_trace, timeline_png, write_chrome_trace

        self.engine.trace.clear()
        self.engine.trace_enabled = True
        self.step()
        self.engine.trace_enabled = False
        traces = gather_trace(self.engine)
        if traces is None:
            return None
        write_chrome_trace(traces, os.path.join(out_dir, f"timeline_{schedule}.json"))
        stats = timeline_png(traces, os.path.join(out_dir, f"timeline_{schedule}.png"),
                             f"ds_mp {schedule}, PP={STAGES}, M={MICRO_BATCHES}")
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

def configs(quick: bool) -> list[Config]:
    shape = shape_dict(quick)
    mp = {"shape": shape, "micro": ROWS, "gas": MICRO_BATCHES, "pp": STAGES}
    return [Config("hf_1x1", "benchmarks.workloads:setup_hf", 1, 1, {"shape": shape, "rows": ROWS * MICRO_BATCHES}),
            Config("deepspeed_1f1b", "benchmarks.pipeline:setup_deepspeed_pipe", STAGES, 1, {"shape": shape}),
            Config("ds_mp_1f1b", "benchmarks.pipeline:setup_ds_mp_pipe", STAGES, 1, {**mp, "schedule": "1f1b"}),
            Config("ds_mp_gpipe", "benchmarks.pipeline:setup_ds_mp_pipe", STAGES, 1, {**mp, "schedule": "gpipe"})]


def run(quick: bool, out_dir: str) -> dict:
    cfgs = configs(quick)
    shape = shape_dict(quick)
    tokens = ROWS * MICRO_BATCHES * shape["seq"]
    repeats, steps = (2, 1) if quick else (6, 2)
    extra: dict[str, Any] = {}

    def measure(groups: dict) -> None:
        for sched in ("1f1b", "gpipe"):
            g = groups[f"ds_mp_{sched}"]
            extra[f"act_{sched}"] = g.call("activation_peak")
            extra[f"trace_{sched}"] = g.call("trace", out_dir, sched)[0]

    times, _ = run_side_by_side(cfgs, repeats, steps, extra=measure)
    res = summarize(times, {c.name: tokens for c in cfgs})
    med = {n: r["median_s"] for n, r in res.items()}
    act = {s: max(extra[f"act_{s}"]) for s in ("1f1b", "gpipe")}
    ratios = {"ds_mp_1f1b_time_vs_deepspeed": med["ds_mp_1f1b"] / med["deepspeed_1f1b"],
              "gpipe_time_vs_1f1b": med["ds_mp_gpipe"] / med["ds_mp_1f1b"],
              "gpipe_activation_peak_vs_1f1b": act["gpipe"] / act["1f1b"]}
    ratios.update({f"{n}_tokens_per_s_vs_1x1": res["hf_1x1"]["median_s"] / m for n, m in med.items()})
    peer = ratios["ds_mp_1f1b_time_vs_deepspeed"]
    summary = [f"ds_mp 1F1B step time vs DeepSpeed PipelineModule 1F1B: {peer:.2f}× (target ≤ {PEER_TARGET}×: "
               f"{'met' if peer <= PEER_TARGET else 'NOT met'})",
               f"GPipe vs 1F1B: time {ratios['gpipe_time_vs_1f1b']:.2f}×, peak saved activations per rank "
               f"{ratios['gpipe_activation_peak_vs_1f1b']:.2f}×"]
    rows = [[n, f"{c.ranks} × {c.threads}", fmt_ratio(ratios[f"{n}_tokens_per_s_vs_1x1"]),
             fmt_ratio(med[n] / med["deepspeed_1f1b"]), f"±{res[n]['iqr_rel']:.0%}",
             fmt_ratio(res[n]["cpu_s"] / res["deepspeed_1f1b"]["cpu_s"])] for n, c in
            ((c.name, c) for c in cfgs)]
    bubbles = []
    for sched in ("1f1b", "gpipe"):
        t = extra[f"trace_{sched}"]
        res[f"ds_mp_{sched}"].update(trace=t, activation_peak_bytes=extra[f"act_{sched}"])
        bubbles.append([sched, f"{t['bubble']:.1%}", f"{t['fb_window_bubble']:.1%}", f"{t['simulated_bubble']:.1%}",
                        fmt_ratio(t["fb_window_s"] / t["simulated_makespan_s"]),
                        f"{act[sched] / 2**20:.0f} MiB"])
        summary.append(f"{sched}: bubble measured {t['bubble']:.1%} (whole step), {t['fb_window_bubble']:.1%} "
                       f"(F/B window) vs simulated {t['simulated_bubble']:.1%}")
    for line in summary:
        print("  " + line)
    names = [c.name for c in cfgs]
    plot = bar_chart(os.path.join(out_dir, "pipeline.png"), names,
                     [ratios[f"{n}_tokens_per_s_vs_1x1"] for n in names], "tokens/s vs 1 process × 1 thread",
                     "ratio")
    return {"workload": Shape(**shape).describe() + f", PP={STAGES}, M={MICRO_BATCHES} micro-batches × {ROWS} rows",
            "configs": res, "ratios": ratios, "summary": summary, "repeats": repeats, "steps_per_repeat": steps,
            "plots": [os.path.basename(plot), "timeline_1f1b.png", "timeline_gpipe.png"],
            "tables": [table("throughput", ["config", "ranks × threads", "tokens/s vs 1×1",
                                            "step time vs DeepSpeed 1F1B", "step-time IQR",
                                            "CPU s/step (all ranks) vs DeepSpeed 1F1B"], rows),
                       table("bubble (one traced step) and memory",
                             ["schedule", "bubble (whole step)", "bubble (F/B window)", "simulated bubble",
                              "F/B window vs simulated makespan", "peak saved activations / rank"], bubbles)]}
