"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, §6): the V-shaped zero-bubble timetable.

The layers are cut into 2P chunks (virtual stages v = 0 … 2P−1); pipeline rank r holds chunk r
(its local chunk 0) and chunk 2P−1−r (its local chunk 1).  A micro-batch goes down the ranks
through chunks 0 … P−1, turns on rank P−1 (chunk P−1 → chunk P, both local: no message) and
comes back up through chunks P … 2P−1; the loss is on rank 0 (chunk 2P−1, beside the embedding:
a tied embedding needs no gradient all-reduce across stages).  Each backward is split as in
ZB-H1 (:mod:`ds_mp.schedules.zero_bubble`): B (input gradient, on the critical path) and W
(weight gradient, nobody waits for it).  ``Op.slice`` is the local chunk c; the dependencies
(:func:`v_deps`) and who sends each op's input (:func:`v_peer`)::

    F(r, m, 0)  needs F(r−1, m, 0)                      (r > 0; rank 0 loads the micro-batch)
    F(r, m, 1)  needs F(r+1, m, 1), or F(P−1, m, 0) on r = P−1 (the turn, local)
    B(r, m, 1)  needs F(r, m, 1) and B(r−1, m, 1)       (r > 0; rank 0's chunk 1 holds the loss)
    B(r, m, 0)  needs F(r, m, 0) and B(r+1, m, 0), or B(P−1, m, 1) on r = P−1 (local)
    W(r, m, c)  needs B(r, m, c)

**The timetable** (:func:`zb_v_timetable`) is built the way the paper builds its schedules: a
greedy list scheduler plays every rank with modelled op costs and, whenever a rank is free, runs
(1) a B that is ready, (2) else a ready F if the memory bound allows it (chunk 1 first: it
finishes a micro-batch already inside the rank), (3) else the oldest pending W, (4) else it
idles until the next op ends.  So W fills exactly the time a rank would otherwise wait.

**Memory.**  A rank holds a chunk's activations from its F to its W; counted in chunk units (half
a 1F1B stage), 1F1B's largest rank holds ``L = 2·min(P, M)``.  A pending W (B done, W not) also
holds the gradients B recorded for it: it weighs ``pending_weight`` units (as ZB-H1's "auto"
counts it, :func:`~ds_mp.schedules.simulate.zb_deferrals`).  Two deferrals:

* ``"bounded"`` (default): the scheduler keeps ``held + open + (pending_weight − 1) ≤ L`` where
  ``open`` counts micro-batches whose chunk-0 F ran and chunk-1 F has not (their chunk-1 F is
  reserved): an F of chunk 0 runs only if the next B still fits, a B that would not fit first runs
  the oldest pending W.  Held memory with recorded gradients ≤ 1F1B's largest rank for P, M ≥ 2
  (a lone rank or micro-batch holds ``1 + pending_weight`` units at its chunk-1 B, over 1F1B's 2).
  The price: at P = 2 with ``pending_weight`` ≥ 1.5 only one micro-batch fits in the V at a time
  (projected slower than 1F1B, :func:`projection`); the bound is what the storage census measures.
* ``"paper"``: the paper's unbounded deferral — W only when the rank has nothing else to run;
  the activations (``pending_weight`` = 1: the recorded gradients not counted) bounded by the
  paper's 2P chunk units.

Every stage's op order is read off the schedule as a list (:func:`figure` prints it like the
paper's figure); :class:`~ds_mp.schedules.timetable.TimetableSchedule` compiles any such table
into deadlock-free sends and receives with :func:`v_peer` (nothing crosses the turn; the
default ``sent_unit`` holds: every message carries its consumer's own chunk).
``"pipeline": {"schedule": "zb-v"}`` selects it (:class:`ZeroBubbleV`; its runtime, with the V
layer placement, the hand-offs at the turn and the loss on rank 0, is ``ds_mp.engine.zb_v``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from deepspeed.runtime.pipe import schedule as ds

from ds_mp.config.registry import ALL_FAMILIES
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel
from ds_mp.schedules.simulate import (Deps, Op, OpCost, SimResult, Timetable, interleaved_deps, interleaved_timetable,
                                      one_f_one_b_timetable, simulate, zb_h1_timetable, zero_bubble_deps)
from ds_mp.schedules.timetable import TimetableSchedule, Transfer
from ds_mp.schedules.zero_bubble import ZeroBubbleSpec
from ds_mp.engine_view import StageView

DEFERRALS = ("bounded", "paper")


def unit_cost(rank: int, op: Op) -> float:
    """F = B = W = 1 per chunk (the paper's symmetric case)."""
    return 1.0


def v_deps(num_ranks: int) -> Deps:
    """The simulator's dependencies of ZB-V on ``num_ranks`` ranks (module docstring)."""
    P = num_ranks

    def deps(r: int, op: Op, K: int) -> list[tuple[int, Op]]:
        m, c = op.micro, op.slice
        if op.kind == "W":
            return [(r, Op("B", m, c))]
        if op.kind == "F":
            if c == 0:
                return [(r - 1, op)] if r > 0 else []
            return [(r + 1, op)] if r < P - 1 else [(r, Op("F", m, 0))]
        if op.kind == "B":
            own = [(r, Op("F", m, c))]
            if c == 1:
                return own + ([(r - 1, op)] if r > 0 else [])
            return own + ([(r + 1, op)] if r < P - 1 else [(r, Op("B", m, 1))])
        raise ValueError(f"v_deps knows ops F, B and W, got {op.kind!r}")
    return deps


def v_peer(num_ranks: int) -> Callable[[int, Op], int | None]:
    """The rank that sends an op's input (None: local or loaded): chunk 0's F from r − 1 and its B
    from r + 1, chunk 1's F from r + 1 and its B from r − 1; nothing crosses the turn (rank P−1)
    or enters rank 0's chunk-1 B (the loss)."""
    P = num_ranks

    def peer(r: int, op: Op) -> int | None:
        down = op.slice == 0  # chunk 0 flows down the ranks, chunk 1 up
        if op.kind == "F":
            src = r - 1 if down else r + 1
        elif op.kind == "B":
            src = r + 1 if down else r - 1
        else:
            return None
        return src if 0 <= src < P else None
    return peer


def _limits(P: int, M: int, deferral: str, pending_weight: float) -> tuple[float, float]:
    """(memory limit in chunk units, weight of a pending W) of a deferral mode."""
    if deferral == "bounded":
        return max(2.0 * min(P, M), 1.0 + pending_weight), pending_weight
    if deferral == "paper":
        return 2.0 * P, 1.0
    raise ValueError(f"zb-v deferral: expected one of {DEFERRALS}, got {deferral!r}")


def zb_v_timetable(P: int, M: int, deferral: str = "bounded", cost: OpCost = unit_cost,
                   pending_weight: float = 2.0) -> Timetable:
    """Every rank's ZB-V op order for ``P`` ranks and ``M`` micro-batches (module docstring), from a
    greedy play with ``cost(rank, op)`` seconds (> 0).  Deterministic: the same on every rank."""
    if P < 1 or M < 1:
        raise ValueError(f"zb-v needs P >= 1 ranks and M >= 1 micro-batches, got P={P}, M={M}")
    limit, pw = _limits(P, M, deferral, pending_weight)
    deps = v_deps(P)
    table: Timetable = [[] for _ in range(P)]
    end: dict[tuple[int, Op], float] = {}
    free = [0.0] * P
    fnext = [[0, 0] for _ in range(P)]   # next micro-batch to forward, per rank and chunk
    bnext = [[0, 0] for _ in range(P)]   # next micro-batch to run B of, per rank and chunk
    pending: list[list[Op]] = [[] for _ in range(P)]  # W owed, oldest first
    held, opened = [0.0] * P, [0] * P
    total = 6 * M * P
    t, done = 0.0, 0

    def ready(r: int, op: Op) -> bool:
        return all(end.get(d, float("inf")) <= t for d in deps(r, op, P))

    def run(r: int, op: Op) -> None:
        nonlocal done
        table[r].append(op)
        end[(r, op)] = free[r] = t + float(cost(r, op))
        done += 1
        if op.kind == "F":
            fnext[r][op.slice] += 1
            held[r] += 1
            opened[r] += 1 if op.slice == 0 else -1
        elif op.kind == "B":
            bnext[r][op.slice] += 1
            held[r] += pw - 1
            pending[r].append(Op("W", op.micro, op.slice))
        else:
            held[r] -= pw

    def pick(r: int) -> Op | None:
        bs = [Op("B", bnext[r][c], c) for c in (1, 0) if bnext[r][c] < fnext[r][c]]
        bs = sorted(b for b in bs if ready(r, b))
        if bs:
            if held[r] + opened[r] + (pw - 1) > limit and pending[r]:
                return pending[r].pop(0)
            return bs[0]
        for c in (1, 0):
            if fnext[r][c] < M and ready(r, Op("F", fnext[r][c], c)):
                need = 1 if c == 1 else 2 + (pw - 1)
                if c == 1 or held[r] + opened[r] + need <= limit:
                    return Op("F", fnext[r][c], c)
        return pending[r].pop(0) if pending[r] else None

    while done < total:
        progressed = False
        for r in range(P):
            if free[r] <= t:
                op = pick(r)
                if op is not None:
                    run(r, op)
                    progressed = True
        later = [e for e in list(free) + list(end.values()) if e > t]
        if not later:
            if not progressed:
                raise RuntimeError(f"zb-v scheduler stuck at t={t} (P={P}, M={M}, {deferral}): a bug")
            continue
        if not progressed or all(f > t for f in free):
            t = min(later)
    return table


def held_peak(ops: list[Op], pending_weight: float = 1.0) -> float:
    """The most one rank's op order holds at once, in 1F1B stages (a chunk is half a stage): an F
    adds its chunk's activations, a B turns them into ``pending_weight`` (with the recorded
    gradients), a W frees them."""
    live = peak = 0.0
    for op in ops:
        live += {"F": 1.0, "B": pending_weight - 1.0, "W": -pending_weight}[op.kind]
        peak = max(peak, live)
    return peak / 2


def figure(table: Timetable) -> str:
    """One row per rank, its ops in order, like the paper's figure: ``F3`` / ``B3`` / ``W3`` for
    chunk 0 (down the V), ``f3`` / ``b3`` / ``w3`` for chunk 1 (back up)."""
    def label(op: Op) -> str:
        return (op.kind if op.slice == 0 else op.kind.lower()) + str(op.micro)
    return "\n".join(f"rank {r}: " + " ".join(map(label, ops)) for r, ops in enumerate(table))


def project(P: int, M: int, cost: OpCost = unit_cost, deferral: str = "bounded", pending_weight: float = 2.0,
            latency: float = 0.0) -> SimResult:
    """Simulated step of ZB-V (makespan, per-rank busy time, bubble) with ``cost(rank, op)`` per
    chunk op: the timetable built for these costs, played by :func:`~ds_mp.schedules.simulate.simulate`."""
    table = zb_v_timetable(P, M, deferral, cost, pending_weight)
    return simulate(table, cost, latency=latency, deps=v_deps(P))


def lower_bound(P: int, M: int, f: float, b: float, w: float) -> float:
    """No ZB-V step is shorter than ``(P − 1)·f + 2M(f + b + w)`` with chunk op costs f, b, w:
    rank P−1 gets its first input after P − 1 chunk forwards and then has 2M of each op to run.
    The paper's deferral reaches it within P chunk ops (checked): the bubble is that ramp, → 0
    as M grows."""
    return (P - 1) * f + 2 * M * (f + b + w)


def projection(P: int, M: int, F: float, B: float, W: float) -> dict[str, float]:
    """Simulated step (seconds) of each schedule at the same work: per-stage op costs F (forward),
    B (input gradient), W (weight gradient); 1F1B and interleaved run B + W as one backward, a V
    or interleaved chunk costs half a stage's.  Keys: "1f1b", "zb-h1 auto", "zb-h1 paper",
    "interleaved" (v = 2; only when P divides M), "zb-v bounded", "zb-v paper"."""
    stage = {"F": F, "B": B, "W": W}
    chunk = {k: v / 2 for k, v in stage.items()}
    whole = lambda costs: lambda s, op: costs["B"] + costs["W"] if op.kind == "B" else costs[op.kind]  # noqa: E731
    out = {"1f1b": simulate(one_f_one_b_timetable(P, M), whole(stage)).iteration_time}
    for d in ("auto", "paper"):
        out[f"zb-h1 {d}"] = simulate(zb_h1_timetable(P, M, d), lambda s, op: stage[op.kind],
                                     deps=zero_bubble_deps).iteration_time
    if M % P == 0:
        out["interleaved"] = simulate(interleaved_timetable(P, M, 2), whole(chunk),
                                      deps=interleaved_deps(2)).iteration_time
    for d in DEFERRALS:
        out[f"zb-v {d}"] = project(P, M, lambda r, op: chunk[op.kind], deferral=d).iteration_time
    return out


# ------------------------------------------------------------------ as a DeepSpeed schedule

class VForward(ds.BufferOpInstruction):
    """F of micro-batch ``micro`` through this rank's local chunk ``chunk`` (0: down the V, 1: back
    up), its unit in ``buffer_id``.  kwargs: ``buffer_id``, ``chunk``, ``micro``."""


class VBackwardInput(ds.BufferOpInstruction):
    """B (input gradient) of ``micro`` through local chunk ``chunk``.  kwargs as :class:`VForward`."""


class VBackwardWeight(ds.BufferOpInstruction):
    """W (weight gradient) of ``micro`` through local chunk ``chunk``.  kwargs as :class:`VForward`."""


class VPeer(ds.PipeInstruction):
    """The next transfer's peer: the rank it goes to or comes from (chunk 0 flows down the ranks,
    chunk 1 up, so a rank's neighbours change with the chunk).  kwargs: ``prev`` (where activations
    come from and gradients go) or ``next`` (where activations go and gradients come from)."""


INSTRUCTIONS = {"F": VForward, "B": VBackwardInput, "W": VBackwardWeight}


class ZeroBubbleV(TimetableSchedule):
    """``"schedule": "zb-v"``: :func:`zb_v_timetable` compiled into instruction steps, the
    transfers along :func:`v_peer` (none at the turn); ``pipeline.zb_max_pending_w`` picks the
    deferral ("auto": ``"bounded"``, within 1F1B's memory; "paper": the paper's).  Engine side:
    ``ds_mp.engine.zb_v``.  Ops are priced alike (only the compiled order of transfers depends on
    it, the same on every rank)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, deferral: str = "bounded",
                 forward_only: bool = False) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        if deferral not in DEFERRALS:
            raise ValueError(f"zb-v deferral: expected one of {DEFERRALS}, got {deferral!r}")
        self.deferral, self.forward_only = deferral, forward_only
        self.deps = v_deps(stages)

    @classmethod
    def from_engine(cls, engine: StageView) -> "ZeroBubbleV":
        return cls(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id,
                   deferral=deferral_of(engine.ds_mp_config))

    @staticmethod
    def pipeline_layout(cfg: Any, hf_config: Any, costs: Any = None) -> tuple[list[str], list[int]]:
        """The V placement (rank r holds chunks r and 2P − 1 − r); the combinations it cannot
        place were refused by :class:`ZeroBubbleVSpec` when the config was loaded.  ``"partition":
        "cost"`` balances the measured ``costs`` (a ``LayerCosts``) per rank
        (:func:`~ds_mp.models.partition.v_balanced_blocks`)."""
        from ds_mp.models.pipeline import v_pipeline_layout

        names, parts, _ = v_pipeline_layout(hf_config, cfg.pp, cfg.pipeline.partition, costs)
        return names, parts

    def table(self) -> list[list[Op]]:
        if self.forward_only:  # evaluation: every chunk-0 forward, then every chunk-1 forward
            return [[Op("F", m, c) for c in (0, 1) for m in range(self.micro_batches)] for _ in range(self.stages)]
        return zb_v_timetable(self.stages, self.micro_batches, self.deferral)

    def cost(self, stage: int, op: Op) -> float:
        return 1.0

    def peer(self) -> Callable[[int, Op], int | None]:
        return v_peer(self.stages)

    def compute(self, op: Op, buffer_id: int) -> list:
        """One instruction per op; the runtime loads the micro-batch at rank 0's chunk 0 and hands
        over locally at the turn."""
        return [INSTRUCTIONS[op.kind](buffer_id=buffer_id, chunk=op.slice, micro=op.micro)]

    def transfer(self, side: str, move: Transfer, buffer_id: int) -> list:
        """DeepSpeed's send/receive, after :class:`VPeer` pointing it at this transfer's other end."""
        peer = move.dst if side == "send" else move.src
        forward = (move.kind == "act") == (side == "send")  # an activation sent, or a gradient received
        return [VPeer(**{"next" if forward else "prev": peer})] + super().transfer(side, move, buffer_id)

    def steps(self) -> Iterator[list]:
        step_end = (ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep)
        for cmds in super().steps():
            yield [c for c in cmds if not isinstance(c, step_end)] if self.forward_only else cmds


def deferral_of(cfg: Any) -> str:
    """``pipeline.zb_max_pending_w`` as a ZB-V deferral: "auto" -> "bounded", "paper" -> "paper"."""
    return {"auto": "bounded", "paper": "paper"}[cfg.pipeline.zb_max_pending_w]


class ZeroBubbleVSpec(ZeroBubbleSpec):
    """ZB-V: the combinations it does not run (yet), each refused with one line naming the key and
    the fix, on every rank before anything is built.  What is tested against HF: PP = 2 and 3, DP,
    TP (with and without sequence parallelism), clipping, LoRA (PEFT), activation checkpointing,
    ZeRO-1, bf16, GPT-2 and the Llama family, ``"partition": "cost"`` (balanced per rank,
    :meth:`~ds_mp.models.partition.LayerCosts.v_blocks`); fp16 and ZeRO-2 are refused as for zb-h1
    (:class:`~ds_mp.schedules.zero_bubble.ZeroBubbleSpec`)."""

    def check(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        pp, P = cfg.pipeline, cfg.pp
        if pp.zb_max_pending_w not in ("auto", "paper"):
            raise ConfigError(f"ds_mp.pipeline.zb_max_pending_w: {pp.zb_max_pending_w!r}; zb-v defers W 'auto' "
                              "(within 1F1B's memory) or 'paper' (the paper's unbounded deferral); use one of those")
        if P < 2:
            raise ConfigError(f"ds_mp.pipeline.stages: {P}; the zb-v schedule needs at least 2 stages (its V turns "
                              "on the last); use 1f1b on one stage")
        if shape.n_layer < 2 * P:
            raise ConfigError(f"ds_mp.pipeline.stages: zb-v cuts the {shape.n_layer} blocks into 2·stages = {2 * P} "
                              f"chunks; use a model with at least {2 * P} blocks or another schedule")
        if pp.partition not in ("uniform", "parameters", "cost"):
            raise ConfigError(f"ds_mp.pipeline.partition: {pp.partition!r} with zb-v, which cuts its 2·stages "
                              "chunks 'uniform', by 'parameters' or by measured 'cost'; use one of those")


ZB_V = ZeroBubbleVSpec(timetable=ZeroBubbleV, runtime="ds_mp.engine.zb_v:attach", families=ALL_FAMILIES,
                       batch_ramp=False, context_parallel=True)


__all__ = ["DEFERRALS", "unit_cost", "v_deps", "v_peer", "zb_v_timetable", "held_peak", "figure", "project",
           "lower_bound", "projection", "VForward", "VBackwardInput", "VBackwardWeight", "VPeer", "ZeroBubbleV",
           "deferral_of", "ZeroBubbleVSpec", "ZB_V"]
