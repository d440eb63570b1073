"""Context parallelism (CP): held activation memory and the longest trainable ``seq_len`` per rank at
CP = 2 against CP = 1, and tokens/s at ``seq_len`` 4096 against TP = 2 and one process × 2 threads.

    cp1                     one rank, 1 thread (the memory reference)
    cp2_allgather           2 ranks × 1 thread, ``context_parallel`` 2, impl ``allgather`` (zigzag shards)
    cp2_ulysses             the same with impl ``ulysses`` (contiguous shards, head all-to-all)
    tp2                     2 ranks × 1 thread, ``tensor_parallel`` 2 (the whole sequence on each rank)
    one_process_2_threads   one rank, 2 threads (the same two cores, no communication)

Memory is the storage census of :func:`ds_mp.engine.held.held_during` after every instruction of one
step, the largest rank's peak (activations autograd saved, pipe buffers, losses; weights, gradients and
optimizer state not charged): deterministic, so its "interval" is the point.  Targets (issue 50):
held memory per rank at CP = 2 ≤ 0.55× CP = 1's at the same ``seq_len``; the longest ``seq_len`` whose
held memory fits CP = 1's at ``MEMORY_SEQ`` (the budget), CP = 2 over CP = 1, ≥ 1.8× — searched on a
grid of multiples of ``MEMORY_SEQ`` / 8 up to 2.5 ×, so the ratio is stated as the grid's interval [longest that fits, first that does not) over CP = 1's longest.  tokens/s:
the ratio of median step times with a 90% bootstrap interval (``benchmarks.common.speedup``).
``DS_MP_CP_MEMORY_ONLY=1`` skips the timed rounds (and TP = 2, one process × 2 threads) and measures
memory alone.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, run_side_by_side, speedup, summarize, table
from benchmarks.workloads import Shape, batch, ds_mp_config, hf_model

DESCRIPTION = ("CP=2 vs CP=1: held activation memory and longest seq_len per rank; tokens/s at seq 4096: CP=2 "
               "(allgather, ulysses) vs TP=2 vs one process × 2 threads")
MEMORY_TARGET, LENGTH_TARGET = 0.55, 1.8
FULL = Shape(n_layer=2, n_embd=128, n_head=4, vocab=2048, seq=4096, n_positions=4096)
QUICK = Shape(n_layer=2, n_embd=64, n_head=4, vocab=1024, seq=1024, n_positions=1024)
ROWS = 1


class CpBench:
    """ds_mp at ``tp`` × ``cp`` (impl ``impl``) on ``ROWS`` rows of the shape's ``seq`` tokens; a
    step is one ``train_batch``; :meth:`held_at` is the census of one step at a shorter ``seq``."""

    def __init__(self, rank: int, world: int, shape: dict, tp: int = 1, cp: int = 1, impl: str = "allgather") -> None:
        import ds_mp

        cfg = ds_mp_config(shape, tp=tp, micro=ROWS)
        cfg["ds_mp"]["context_parallel"] = {"size": cp, "impl": impl}
        self.engine, self.opt, _, _ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        self.shape = shape

    def _batch(self, seq: int) -> list:
        ids, labels = batch({**self.shape, "seq": seq}, ROWS)
        return [(ids, labels)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self._batch(self.shape["seq"]))))

    def held_at(self, seq: int) -> int:
        """Peak held bytes of one step on rows of ``seq`` tokens (this rank), after one step at ``seq``
        (steady state: what the previous step left, e.g. its layout's mask, is that of the same length,
        not of the timed steps' longer rows)."""
        from ds_mp.engine.held import held_during

        self.engine.train_batch(iter(self._batch(seq)))
        peak, _ = held_during(self.engine, lambda: self.engine.train_batch(iter(self._batch(seq))))
        return peak


def setup(rank: int, world: int, **kwargs: Any) -> CpBench:
    return CpBench(rank, world, **kwargs)


def _memory(shape: dict, held: dict[str, list[list[int]]], grid: list[int]) -> tuple[dict, list, list]:
    """Per-seq largest-rank held bytes -> the two targets' numbers, table rows and summary lines."""
    base = max(held["cp1"][0])  # CP=1 at MEMORY_SEQ (= grid[0]): the budget
    out, rows, summary = {}, [], []
    for name in ("cp2_allgather", "cp2_ulysses"):
        per_seq = [max(h) for h in held[name]]
        ratio = per_seq[0] / base
        fits = [s for s, b in zip(grid, per_seq) if b <= base]
        longest_cp1 = max(s for s, b in zip(grid, [max(h) for h in held["cp1"]]) if b <= base)
        longest = max(fits) if fits else 0
        over = min([s for s in grid if s > longest] or [0])  # the first grid seq that does not fit (0: none)
        low, high = longest / longest_cp1, (over / longest_cp1 if over else float("inf"))  # ratio in [low, high)
        verdict = "met" if low >= LENGTH_TARGET else "NOT met" if high <= LENGTH_TARGET else "not shown"
        span = f"[{low:.2f}, {high:.2f})" if over else f"≥ {low:.2f}"
        out[name] = {"held_over_cp1": ratio, "longest_seq": longest, "longest_seq_cp1": longest_cp1,
                     "length_ratio": [low, high], "held_bytes_per_seq": dict(zip(map(str, grid), per_seq))}
        mem = "met" if ratio <= MEMORY_TARGET else "NOT met"
        rows.append([name, f"{ratio:.3f}×", mem, f"{longest} / {longest_cp1}: {span}×", verdict])
        summary.append(f"{name}: held memory per rank {ratio:.3f}× CP=1's at seq {grid[0]} (target ≤ {MEMORY_TARGET}: "
                       f"{mem}); longest seq within CP=1's budget {span}× CP=1's (target ≥ {LENGTH_TARGET}: {verdict})")
    return out, rows, summary


def run(quick: bool, out_dir: str) -> dict:  # noqa: ARG001 - no plots
    shape = asdict(QUICK if quick else FULL)
    repeats, steps = (2, 1) if quick else (5, 2)
    T0 = shape["seq"] // 4  # MEMORY_SEQ: the budget's seq_len
    grid = [T0 * k // 8 for k in range(8, 21)]  # T0 … 2.5·T0 in steps of T0/8 (divisible by 2·C for allgather)
    two = {"ranks": 2}
    configs = [Config("cp1", "benchmarks.context_parallel:setup", kwargs={"shape": shape}),
               Config("cp2_allgather", "benchmarks.context_parallel:setup", **two, kwargs={"shape": shape, "cp": 2}),
               Config("cp2_ulysses", "benchmarks.context_parallel:setup", **two,
                      kwargs={"shape": shape, "cp": 2, "impl": "ulysses"}),
               Config("tp2", "benchmarks.context_parallel:setup", **two, kwargs={"shape": shape, "tp": 2}),
               Config("one_process_2_threads", "benchmarks.context_parallel:setup", threads=2, kwargs={"shape": shape})]
    memory_only = os.environ.get("DS_MP_CP_MEMORY_ONLY") == "1"
    if memory_only:
        configs, repeats = configs[:3], 0
    held: dict[str, list[list[int]]] = {}

    def extra(groups: dict) -> None:
        for name in ("cp1", "cp2_allgather", "cp2_ulysses"):
            held[name] = [groups[name].call("held_at", s) for s in grid]

    times, _ = run_side_by_side(configs, repeats, steps, extra=extra)
    res = {} if memory_only else summarize(times, {c.name: ROWS * shape["seq"] for c in configs})
    memory, mem_rows, summary = _memory(shape, held, grid)
    ratios, speed_rows = {}, []
    for fast in () if memory_only else ("cp2_allgather", "cp2_ulysses", "tp2"):
        for base in ("one_process_2_threads", "tp2"):
            if fast == base:
                continue
            r = speedup(res[base]["step_times_s"], res[fast]["step_times_s"])
            ratios[f"{fast}/{base}"] = r.as_dict()
            speed_rows.append([f"{fast} over {base}", str(r)])
    summary += [] if memory_only else [f"tokens/s at seq {shape['seq']}: " + "; ".join(
        f"{k} {v['value']:.2f}× [{v['lo']:.2f}, {v['hi']:.2f}]" for k, v in ratios.items())]
    return {"workload": f"{Shape(**shape).describe()}; {ROWS} row per step; memory at seq {grid[0]} … {grid[-1]}",
            "repeats": repeats, "steps_per_repeat": steps, "results": res, "ratios": ratios, "memory": memory,
            "held_peak_bytes": held, "summary": summary,
            "tables": [table(f"Held memory per rank at CP=2 over CP=1 (seq {grid[0]}; largest rank, storage census) and "
                             "the longest seq_len within CP=1's held memory at that seq (the grid's interval)",
                             ["config", "held / CP=1", f"≤ {MEMORY_TARGET}×", "longest seq CP=2 / CP=1",
                              f"≥ {LENGTH_TARGET}×"], mem_rows),
                       table(f"tokens/s at seq {shape['seq']} (ratio of median step times, 90% interval)",
                             ["comparison", "speed-up"], speed_rows)]}
