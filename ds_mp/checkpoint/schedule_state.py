"""A schedule's work in flight across steps (Ouroboros: stashed module inputs, deltas on their
way), saved per rank beside the layout-free weights as ``schedule-ppPP-tpTT-dpDD.pt``, and the
layouts it resumes at (:func:`schedule_source`)."""
from __future__ import annotations

import os
from typing import Any

from ds_mp.checkpoint.integrity import CheckpointError, Manifest, load_torch
from ds_mp.engine_view import EngineView


def layout_of(engine: EngineView) -> dict:
    t = engine.topology
    return {"tp": t.tp, "pp": t.pp, "dp": t.dp, "cp": t.cp}


def schedule_state(engine: EngineView) -> dict | None:
    return engine.schedule_state_dict()


def schedule_file(path: str, topo: Any, tp_rank: int | None = None) -> str:
    tp = topo.tp_rank if tp_rank is None else tp_rank
    return os.path.join(path, f"schedule-pp{topo.pp_rank:02d}-tp{tp:02d}-dp{topo.dp_rank:02d}.pt")


def schedule_source(engine: EngineView, path: str, saved_layout: dict | None) -> str | None:
    """The schedule-state file this rank resumes from, None if its schedule keeps none.

    In-flight work (Ouroboros: stashed module inputs, deltas in flight) is tied to the ring (PP)
    and to each replica's samples (DP).  Across a TP change it moves when the schedule says its
    state is replicated over TP (``engine.schedule_state_tp_free()``: activations are whole on
    every TP rank, no TP-sharded weight snapshots, no dropout masks to redraw): every new TP rank
    then takes TP rank 0's file."""
    if not engine.keeps_schedule_state():
        return None
    layout, topo = layout_of(engine), engine.topology
    if saved_layout is None or saved_layout == layout:
        return schedule_file(path, topo)
    way_out = "or start from the weights with ds_mp.training.init_from"
    if (saved_layout["pp"], saved_layout["dp"]) != (layout["pp"], layout["dp"]):
        raise CheckpointError(f"{path}: in-flight {engine.schedule_name} work was saved at {saved_layout}, the engine "
                              f"has {layout}: it is tied to the ring (PP) and to each replica's samples (DP); resume "
                              f"at pp={saved_layout['pp']}, dp={saved_layout['dp']} (any TP), {way_out}")
    if not engine.schedule_state_tp_free():
        raise CheckpointError(f"{path}: in-flight {engine.schedule_name} work was saved at tp={saved_layout['tp']}, the "
                              f"engine has tp={layout['tp']}; it moves across TP only with recompute 'current' and "
                              f"dropout 0 (no TP-sharded weight snapshots, no masks to redraw): resume at "
                              f"tp={saved_layout['tp']}, {way_out}")
    return schedule_file(path, topo, tp_rank=0)


def load_schedule_state(engine: EngineView, path: str, manifest: Manifest | None, saved_layout: dict | None) -> None:
    """The schedule's in-flight state of this rank (saved only by schedules that keep one; see
    :func:`schedule_source` for the layouts it resumes at)."""
    file = schedule_source(engine, path, saved_layout)
    if file is None:
        return
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no {os.path.basename(file)}; schedule {engine.schedule_name!r} keeps work "
                              "in flight across steps and resumes only at the layout it was saved with (or start "
                              "from the weights with ds_mp.training.init_from)")
    saved = load_torch(file, manifest)
    engine.load_schedule_state_dict(saved["state"])


__all__ = ["layout_of", "schedule_state", "schedule_file", "schedule_source", "load_schedule_state"]
