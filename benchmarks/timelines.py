"""Recorded Ouroboros timeline on the pipeline benchmark's model, beside 1F1B/GPipe/TeraPipe.

Ouroboros (K = 3 modules on 2 ranks) runs the same GPT-2 shape and the same rows per
step as ``benchmarks/pipeline.py`` (its ``M`` micro-batches become one iteration's batch);
one traced iteration after two warm-up iterations is gathered to rank 0 and drawn as
``timeline_ouroboros.png`` (+ Chrome-trace JSON).  The steady-state picture is the point:
every rank computes in every iteration, no backward locking.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

DESCRIPTION = "Ouroboros K=3 on 2 ranks: recorded timeline on the pipeline benchmark's model"


def _rank(rank: int, world: int, port: int, shape: dict, rows: int, micro: int, out_dir: str,
          result_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import json

    import torch

    torch.set_num_threads(1)
    import ds_mp
    from benchmarks.workloads import batch, ds_mp_config, hf_model
    from ds_mp.tools.viz import gather_trace, timeline_png, write_chrome_trace

    cfg = ds_mp_config(shape, pp=2, micro=rows, gas=micro, schedule="ouroboros")
    cfg["ds_mp"]["ouroboros"] = {"modules": 3}
    engine, *_ = ds_mp.initialize(model=hf_model(shape), config=cfg)
    ids, labels = batch(shape, rows * micro)
    data = [(ids[i:i + rows], labels[i:i + rows]) for i in range(0, rows * micro, rows)]
    for _ in range(2):  # fill the ring: every module has a sample in flight
        engine.train_batch(iter(data))
    engine.trace.clear()
    engine.trace_enabled = True
    engine.train_batch(iter(data))
    engine.trace_enabled = False
    traces = gather_trace(engine)
    if traces is not None:
        write_chrome_trace(traces, os.path.join(out_dir, "timeline_ouroboros.json"))
        stats = timeline_png(traces, os.path.join(out_dir, "timeline_ouroboros.png"),
                             "ds_mp Ouroboros, K=3 modules on 2 ranks (steady state)")
        with open(os.path.join(result_dir, "stats.json"), "w") as f:
            json.dump(stats, f, default=float)
    from ds_mp.engine.initialize import shutdown_distributed

    shutdown_distributed(clean=True)  # a gloo group left to exit-time destructors can abort a finished rank


def run(quick: bool, out_dir: str) -> dict:
    import json

    from benchmarks.common import spawn_once
    from benchmarks.pipeline import MICRO_BATCHES, ROWS
    from benchmarks.workloads import Shape, shape_dict

    shape = shape_dict(quick)
    with tempfile.TemporaryDirectory() as tmp:
        spawn_once(_rank, 2, shape, ROWS, MICRO_BATCHES, out_dir, tmp, what="timeline ranks")
        with open(os.path.join(tmp, "stats.json")) as f:
            stats: dict[str, Any] = json.load(f)
    rows = [[rank, f"{r['compute_s'] * 1000:.0f}", f"{r['bubble'] * 100:.1f}%"]
            for rank, r in sorted(stats["ranks"].items())]
    return {"tables": [{"title": "Ouroboros, one traced steady-state iteration",
                        "columns": ["rank", "compute ms", "bubble"], "rows": rows}],
            "summary": [f"workload: {Shape(**shape).describe()}, {ROWS * MICRO_BATCHES} rows per iteration",
                        f"overall bubble {stats['bubble'] * 100:.1f}% over a {stats['makespan_s'] * 1000:.0f} ms "
                        "iteration (forward is sequential across the ring, backward runs on both ranks)"],
            "workload": Shape(**shape).describe(), "repeats": 1, "steps_per_repeat": 1,
            "ratios": {}, "plots": ["timeline_ouroboros.png"]}
