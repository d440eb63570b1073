"""Recording pipeline timelines from a run: gather every rank's instruction trace and write it
as Chrome-trace JSON (https://ui.perfetto.dev, chrome://tracing).

Used by the training loop (``training.trace_steps``) and re-exported by
:mod:`ds_mp.tools.viz`, which draws traces (``ds-mp timeline``).  A trace is what
:class:`ds_mp.engine.pipeline_engine.DsMpPipelineEngine` records with
``engine.record_trace()``: per rank a list of ``(instruction, buffer_id, start, end)``
in ``time.perf_counter()`` seconds.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ds_mp.training.metrics import COMPUTE_KINDS, instruction_kind
from ds_mp.engine_view import EngineView

__all__ = ["Trace", "event_label", "gather_trace", "chrome_trace", "write_chrome_trace"]

Trace = list[tuple[str, int, float, float]]  # (instruction, buffer_id, start_s, end_s)


def event_label(name: str, buffer_id: int) -> str:
    """``F3`` / ``B3`` for forward / backward of buffer 3, ``W3`` for a weight-gradient pass split off
    the backward (``zb-h1``'s ``BackwardWeight``; its ``BackwardInput`` is ``B3``); an interleaved
    chunk's pass (recorded as ``ChunkForward@3.1``) is ``F3.1``: micro-batch 3, local chunk 1, as
    the simulator writes it; other instructions keep their name."""
    name, _, unit = name.partition("@")
    kind = instruction_kind(name)
    if kind in COMPUTE_KINDS and (unit or buffer_id >= 0):
        letter = "F" if kind == "forward" else "W" if "Weight" in name else "B"
        return f"{letter}{unit or buffer_id}"
    return name


# ------------------------------------------------------------------ recording

def gather_trace(engine: EngineView, trace: Trace | None = None) -> dict[int, Trace] | None:
    """Collective: every rank's ``engine.trace`` (or the ``trace`` given, e.g. several steps
    collected by the training loop) on rank 0 (``{rank: trace}``), None elsewhere.

    Clock alignment: after a barrier every rank reads ``time.perf_counter()``; rank r's times
    are shifted by ``ref_0 − ref_r`` onto rank 0's clock.  Limitation: this assumes all ranks
    leave the barrier at the same instant; the error is the barrier's exit skew (tens of µs
    over gloo on one host, a network latency across hosts) plus clock drift over the traced
    interval.  On one Linux host ``perf_counter`` is the shared monotonic clock, so the
    shift is only that skew.  Without torch.distributed it returns ``{0: engine.trace}``.
    """
    import torch.distributed as dist

    trace = [(str(n), int(b), float(s), float(e)) for n, b, s, e in (engine.trace if trace is None else trace)]
    if not (dist.is_available() and dist.is_initialized()):
        return {0: trace}
    dist.barrier()
    ref = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((ref, trace), gathered, dst=0)
    if rank != 0:
        return None
    ref0 = gathered[0][0]
    return {r: [(n, b, s + ref0 - ref_r, e + ref0 - ref_r) for n, b, s, e in tr]
            for r, (ref_r, tr) in enumerate(gathered)}


def chrome_trace(traces: dict[int, Trace], t0: float | None = None) -> dict:
    """Chrome-trace dict: one complete ("X") event per instruction, µs since ``t0`` (default:
    the earliest start), ``pid = tid = rank`` so each rank is one row; ``args`` keep the
    instruction name, kind and buffer id."""
    starts = [s for tr in traces.values() for _, _, s, _ in tr]
    origin = t0 if t0 is not None else min(starts, default=0.0)
    events: list[dict] = []
    for rank in sorted(traces):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": rank,
                       "args": {"sort_index": rank}})
        for name, buf, start, end in traces[rank]:
            events.append({"name": event_label(name, buf), "cat": instruction_kind(name), "ph": "X",
                           "pid": rank, "tid": rank, "ts": (start - origin) * 1e6,
                           "dur": max(0.0, end - start) * 1e6,
                           "args": {"instruction": name, "buffer_id": buf}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(traces: dict[int, Trace], path: str, t0: float | None = None) -> str:
    """Write :func:`chrome_trace` to ``path`` (directories created); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(traces, t0), f)
    return path
