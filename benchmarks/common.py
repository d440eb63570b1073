"""Benchmark harness: persistent worker groups timed side by side, results, plots.

One configuration = one :class:`Group` of ``ranks`` spawned processes (gloo, ``threads``
torch threads each).  A group builds its model once (``setup``: ``"module:function"``
called as ``fn(rank, world, **kwargs)`` on every rank, returning an object with a
``step()`` method) and then waits on a queue, idle, while the other groups run.
:func:`interleave` runs ``steps`` steps of every group in turn, round-robin over
``repeats`` rounds (the order rotates every round), so slow drifts of a shared machine
hit every configuration alike.  A step's time is the slowest rank's; a configuration's
figure is the median over all its timed steps.  Only ratios of medians are reported.
"""
from __future__ import annotations

import datetime
import importlib
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.multiprocessing as mp


@dataclass
class Config:
    name: str  # row label in tables and plots
    setup: str  # "module:function"; fn(rank, world, **kwargs) -> object with .step()
    ranks: int = 1  # processes (gloo ranks)
    threads: int = 1  # torch intra-op threads per process
    kwargs: dict = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_once(target: Callable, world: int, *args: Any, what: str = "ranks", timeout: float = 600) -> None:
    """Run ``target(rank, world, port, *args)`` once on ``world`` spawned ranks; raise if any fails.

    For one-shot measurements (memory, a recorded timeline) that do not need the
    persistent, interleaved worker groups of :class:`Group`.
    """
    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{what} failed: exit codes {[p.exitcode for p in procs]}")


def _resolve(path: str) -> Callable:
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


def _worker(rank: int, cfg: Config, port: int, cmds: Any, results: Any) -> None:
    n = str(cfg.threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.ranks), LOCAL_RANK=str(rank), LOCAL_SIZE=str(cfg.ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=n, MKL_NUM_THREADS=n,
                      DS_MP_TIMEOUT=os.environ.get("DS_MP_TIMEOUT", "600"))
    import torch

    torch.set_num_threads(cfg.threads)
    try:
        bench = _resolve(cfg.setup)(rank, cfg.ranks, **cfg.kwargs)
        results.put((rank, "ok", None))
        while (cmd := cmds.get()) is not None:
            if cmd[0] == "steps":
                out = []
                for _ in range(cmd[1]):
                    t0, c0 = time.perf_counter(), time.process_time()
                    bench.step()
                    out.append((time.perf_counter() - t0, time.process_time() - c0))
            else:
                out = getattr(bench, cmd[1])(*cmd[2])
            results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        results.put((rank, "error", traceback.format_exc()))


class Group:
    """The processes of one configuration; ``steps``/``call`` block until every rank answers."""

    def __init__(self, cfg: Config, timeout: float = 900) -> None:
        self.cfg, self.timeout = cfg, timeout
        ctx = mp.get_context("spawn")
        self.cmds = [ctx.Queue() for _ in range(cfg.ranks)]
        self.results = ctx.Queue()
        port = _free_port()
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(cfg.threads)  # before torch loads
        try:
            self.procs = [ctx.Process(target=_worker, args=(r, cfg, port, self.cmds[r], self.results), daemon=True)
                          for r in range(cfg.ranks)]
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

    def wait_ready(self) -> None:
        """Block until every rank has built its model."""
        self._collect()

    def _collect(self) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(out) < self.cfg.ranks:
            try:
                rank, status, value = self.results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"no answer within {self.timeout}s"
                    raise RuntimeError(f"benchmark config {self.cfg.name!r}: {why}") from None
                continue
            if status == "error":
                self.close()
                raise RuntimeError(f"benchmark config {self.cfg.name!r}, rank {rank} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.cfg.ranks)]

    def steps(self, k: int) -> list[tuple[float, float]]:
        """Run ``k`` steps; per step (slowest rank's wall seconds, CPU seconds summed over
        ranks: every thread of every rank, gloo's included)."""
        for q in self.cmds:
            q.put(("steps", k))
        per_rank = self._collect()
        return [(max(w for w, _ in ts), sum(c for _, c in ts)) for ts in zip(*per_rank)]

    def call(self, method: str, *args: Any) -> list[Any]:
        """``bench.<method>(*args)`` on every rank (a collective if the method is one)."""
        for q in self.cmds:
            q.put(("call", method, args))
        return self._collect()

    def close(self) -> None:
        for q, p in zip(self.cmds, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


LOADS: dict[str, list[tuple[float, float]]] = {}
"""Per configuration name, the 1-min load average (before, after) each of its timed blocks in
the latest :func:`interleave` (read by :func:`summarize`)."""


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def interleave(groups: list[Group], repeats: int, steps: int, warmup: int = 1) -> dict[str, list[tuple]]:
    """Warm up every group, then ``repeats`` round-robin rounds of ``steps`` steps each;
    per config the list of (wall, CPU) seconds of every timed step.  The machine's load
    before and after every block is kept in :data:`LOADS`."""
    for g in groups:
        g.steps(warmup)
    times: dict[str, list[tuple]] = {g.cfg.name: [] for g in groups}
    for g in groups:
        LOADS[g.cfg.name] = []
    for rep in range(repeats):
        order = groups[rep % len(groups):] + groups[:rep % len(groups)]
        for g in order:
            before = load_avg()
            times[g.cfg.name] += g.steps(steps)
            LOADS[g.cfg.name].append((before, load_avg()))
        print(f"  round {rep + 1}/{repeats} (running medians): " + "  ".join(
            f"{n} {statistics.median(w for w, _ in t):.2f}s" for n, t in times.items()), flush=True)
    return times


def run_side_by_side(configs: list[Config], repeats: int, steps: int, warmup: int = 1,
                     extra: Callable[[dict[str, Group]], Any] | None = None) -> tuple[dict[str, list[tuple]], Any]:
    """Start every group (all at once: start-up is import-bound), interleave, call
    ``extra(groups)``, close all."""
    groups: list[Group] = []
    try:
        t0 = time.perf_counter()
        for cfg in configs:
            groups.append(Group(cfg))
        for g in groups:
            g.wait_ready()
            print(f"  ready: {g.cfg.name} ({g.cfg.ranks} rank(s) × {g.cfg.threads} thread(s)) after "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        times = interleave(groups, repeats, steps, warmup)
        more = extra({g.cfg.name: g for g in groups}) if extra else None
    finally:
        for g in groups:
            g.close()
    return times, more


def summarize(times: dict[str, list[tuple]], tokens_per_step: dict[str, int]) -> dict[str, dict]:
    """Per config: median step wall seconds, spread (IQR / median), tokens/s, median CPU
    seconds per step (all ranks), raw times."""
    out = {}
    for name, ts in times.items():
        wall = [w for w, _ in ts]
        med = statistics.median(wall)
        q = statistics.quantiles(wall, n=4) if len(wall) >= 2 else [med, med, med]
        out[name] = {"median_s": med, "iqr_rel": (q[2] - q[0]) / med, "tokens_per_s": tokens_per_step[name] / med,
                     "cpu_s": statistics.median(c for _, c in ts), "step_times_s": wall,
                     "load_before_after": LOADS.get(name, [])}
    return out


def load_span(summary: dict) -> str:
    """``"b → a"``: the highest 1-min load seen before and after a configuration's timed blocks."""
    loads = summary.get("load_before_after") or [(float("nan"), float("nan"))]
    return f"{max(b for b, _ in loads):.1f} → {max(a for _, a in loads):.1f}"


# ------------------------------------------------------------------ ratios with intervals

@dataclass(frozen=True)
class Ratio:
    """A ratio of medians with a bootstrap interval: ``value`` is the point estimate,
    ``lo``/``hi`` the 5th/95th percentiles over resamples (a 90% interval)."""

    value: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.value:.2f}× [{self.lo:.2f}, {self.hi:.2f}]"

    def verdict(self, target: float, at_least: bool = True) -> str:
        """``met`` only when the whole interval clears ``target``; ``NOT met`` when the whole
        interval misses it; otherwise the interval straddles it and the run cannot tell."""
        lo, hi = (self.lo, self.hi) if at_least else (-self.hi, -self.lo)
        t = target if at_least else -target
        if lo >= t:
            return "met"
        if hi < t:
            return "NOT met"
        return "not shown (interval straddles the target)"

    def as_dict(self) -> dict:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


def speedup(slow: list[float], fast: list[float], scale: float = 1.0, resamples: int = 2000,
            seed: int = 0) -> Ratio:
    """``scale · median(slow) / median(fast)`` — e.g. tokens/s of ``fast`` over ``slow`` for
    equal tokens per step (``scale`` corrects unequal ones) — with a percentile bootstrap
    interval: both samples are resampled independently, with replacement."""
    import random

    rng = random.Random(seed)
    point = scale * statistics.median(slow) / statistics.median(fast)
    boots = sorted(scale * statistics.median(rng.choices(slow, k=len(slow)))
                   / statistics.median(rng.choices(fast, k=len(fast))) for _ in range(resamples))
    return Ratio(point, boots[int(0.05 * (resamples - 1))], boots[int(0.95 * (resamples - 1))])


def tokens_ratio(res: dict[str, dict], name: str, base: str) -> Ratio:
    """tokens/s of config ``name`` over config ``base`` from :func:`summarize`'s output."""
    a, b = res[name], res[base]
    scale = (a["tokens_per_s"] * a["median_s"]) / (b["tokens_per_s"] * b["median_s"])  # tokens per step ratio
    return speedup(b["step_times_s"], a["step_times_s"], scale)


# ------------------------------------------------------------------ reporting helpers

def machine() -> dict:
    """What the numbers were measured on."""
    import deepspeed
    import torch
    import transformers

    from ds_mp.models.cost_profile import cpu_model

    return {"cpu_count": os.cpu_count(), "cpu": cpu_model(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def table(title: str, columns: list[str], rows: list[list[Any]]) -> dict:
    return {"title": title, "columns": columns, "rows": rows}


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}×"


def bar_chart(path: str, labels: list[str], values: list[float], title: str, ylabel: str,
              reference: float | None = 1.0, target: float | None = None) -> str:
    """Bars of ``values`` (ratios) with a dashed reference line and an optional target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels)), 4))
    bars = ax.bar(range(len(labels)), values, color="#4C72B0")
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=15, ha="right", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1)
    if target is not None:
        ax.axhline(target, color="#C44E52", linestyle=":", linewidth=1.5, label=f"target {target:g}")
        ax.legend(loc="upper right")
    ax.set_ylim(0, max([*values, target or 0.0, reference or 0.0]) * 1.15)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def command_line() -> str:
    return " ".join(["python -m benchmarks.run", *sys.argv[1:]])
