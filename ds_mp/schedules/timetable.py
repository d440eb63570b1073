"""Timetable -> DeepSpeed instruction steps: any per-stage op order, run with blocking or posted sends.

A schedule written as a *timetable* (``table[s]`` = the ops stage s runs, in order: ``F``
forward, ``B`` backward or input-gradient backward, ``W`` weight-gradient backward; see
:mod:`ds_mp.schedules.simulate`) becomes the per-step instruction lists DeepSpeed's engine
executes.  Three things are derived, the same way on every rank:

1. **When.**  The simulator plays the timetable with modelled op costs (``start(s, op)``).
2. **Transfers.**  ``F(s, u)`` with s > 0 receives u's activation from stage s−1;
   ``B(s, u)`` with s < K−1 receives u's output gradient from stage s+1.  A transfer happens
   at its consumer's start time τ: the receiver posts its receive right before the consumer
   op (DeepSpeed keeps one shared gradient buffer, so a gradient must be consumed before the
   next one arrives), the sender sends it at τ in its own program.
3. **Order.**  Every transfer gets the global key ``(τ, lower stage, kind, op)``; each stage
   runs its transfers in key order, and a compute op with start ``t`` before a transfer with
   τ > t (a send at τ = t precedes the compute that starts at t).  Because every stage
   performs its transfers in the order of one global total order, the least unfinished
   transfer always has both its ends waiting on it: blocking send/recv cannot deadlock,
   whatever the real op times turn out to be.  A sender always sends after it computed the
   value: the producer ends before its consumer starts in the model (costs > 0).

The instruction stream of stage s is cut into *rounds*, one per transfer (``len(transfers) + 1``
steps); round r holds the stage's compute ops before transfer r and transfer r when the stage
is one of its ends.  The step index is thus the same on both ends of every transfer (what the
pure-Python unrollers in the tests check).  With posted sends (the engine's default) each send
then moves up to right after the op computing its value (:func:`sends_early`).

Two more things come with the compiled stream.  **Acknowledgements** (:func:`acknowledgements`):
for each receive, how many of this stage's sends to that peer the peer had received before it sent
the message, read off the peer's own compiled program; the engine waits for those sends then, at
no cost (they are done), instead of pinning every posted send to the end of the step.  **A cache**
(:data:`COMPILED`): the engine builds a schedule per ``train_batch``, and compiling (a simulation of
every stage) is the same work while its inputs (:meth:`TimetableSchedule.compile_key`) are.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

from deepspeed.runtime.pipe import schedule as ds

from ds_mp.schedules.simulate import Deps, Op, OpCost, SimResult, pipeline_deps, simulate


@dataclass(frozen=True, order=True)
class Transfer:
    """One p2p message: ``kind`` "act" (src = dst − 1) or "grad" (src = dst + 1) of ``op``'s unit,
    at the consumer's modelled start ``time``."""

    time: float
    low: int    # the lower stage of the pair (the channel)
    kind: str   # "act" before "grad" at equal times on a channel
    op: Op      # the consumer op (F on dst for "act", B on dst for "grad")
    src: int
    dst: int


Item = tuple  # ("compute", op) | ("send", Transfer) | ("recv", Transfer)


def transfers(table: Sequence[Sequence[Op]], result: SimResult, peer: Callable[[int, Op], int | None]) -> list[Transfer]:
    """Every transfer of the timetable in global order; ``peer(s, op)`` is the stage that sends
    ``op``'s input to stage s (None: no transfer, e.g. W or the first stage's F)."""
    out = []
    for s, ops in enumerate(table):
        for op in ops:
            src = peer(s, op)
            if src is None:
                continue
            kind = "act" if op.kind == "F" else "grad"
            out.append(Transfer(result.times[(s, op)][0], min(s, src), kind, op, src, s))
    return sorted(out)


def linear_peer(num_stages: int) -> Callable[[int, Op], int | None]:
    """A linear pipeline: F receives from s−1, B from s+1, W from nobody."""
    def peer(s: int, op: Op) -> int | None:
        if op.kind == "F":
            return s - 1 if s > 0 else None
        if op.kind == "B":
            return s + 1 if s < num_stages - 1 else None
        return None
    return peer


def rounds(table: Sequence[Sequence[Op]], cost: OpCost, deps: Deps,
           peer: Callable[[int, Op], int | None],
           producer: Callable[[Transfer], Op] | None = None) -> list[list[list[Item]]]:
    """``out[s][r]``: the items stage s runs in round r (compute ops, then at most one transfer).

    ``producer`` (posted sends only): the sender's op that computes each transfer's value; every
    send then moves up to right after it, behind the stage's earlier sends (:func:`sends_early`).

    Raises ValueError (from the simulator) if the timetable cannot run (a dependency that
    is never scheduled, or an order that deadlocks), or if an op has no positive cost.
    """
    result = simulate(table, cost, deps=deps)
    for (s, op), (a, b) in result.times.items():
        if not b > a:
            raise ValueError(f"stage {s} {op}: cost {b - a} must be > 0 to order transfers around it")
    moves = transfers(table, result, peer)
    K = len(table)
    out: list[list[list[Item]]] = [[[] for _ in range(len(moves) + 1)] for _ in range(K)]
    for s, ops in enumerate(table):
        mine = [(r, m) for r, m in enumerate(moves) if s in (m.src, m.dst)]
        i = 0  # next compute op of stage s
        for r, m in mine:
            while i < len(ops) and result.times[(s, ops[i])][0] < m.time:
                out[s][r].append(("compute", ops[i]))
                i += 1
            out[s][r].append(("send" if m.src == s else "recv", m))
        out[s][-1].extend(("compute", op) for op in ops[i:])
    if producer is not None:
        out = [sends_early(stage, producer) for stage in out]
    return out


def sends_early(stage: list[list[Item]], producer: Callable[[Transfer], Op]) -> list[list[Item]]:
    """One stage's rounds with each send right after the compute op producing its value.

    For *posted* (non-blocking) sends.  A send stays behind the stage's earlier sends, so each
    channel carries its messages in the global transfer order its receiver expects; it moves only
    earlier (its producer came before it), and receives keep their places.  A posted send waits
    for nothing, so removing the wait on everything between the producer and the send's compiled
    place cannot deadlock a stream that ran with blocking sends.  The send joins the round of the
    item it follows (rounds then no longer pair a send with its receive)."""
    flat = [(r, item) for r, items in enumerate(stage) for item in items]
    waiting = [item for _, item in flat if item[0] == "send"]
    out: list[list[Item]] = [[] for _ in stage]
    done: set = set()
    for r, item in flat:
        if item[0] == "send":
            continue
        out[r].append(item)
        if item[0] == "compute":
            done.add(item[1])
        while waiting and producer(waiting[0][1]) in done:
            out[r].append(waiting.pop(0))
    if waiting:
        raise ValueError(f"sends whose value is never computed on this stage: {[m for _, m in waiting]}")
    return out


def acknowledgements(stages: Sequence[Sequence[Sequence[Item]]]) -> dict[Transfer, int]:
    """For each transfer m of the compiled programs ``stages[s][r]``: how many messages from
    ``m.dst`` the sender ``m.src`` had received when it sends m (its program order).  The receiver
    of m then knows that its first that-many sends to ``m.src`` have been received (each channel is
    FIFO): waiting for them once m has arrived returns at once."""
    out: dict[Transfer, int] = {}
    for stage in stages:
        got: dict[int, int] = {}
        for items in stage:
            for kind, m in items:
                if kind == "recv":
                    got[m.src] = got.get(m.src, 0) + 1
                elif kind == "send":
                    out[m] = got.get(m.dst, 0)
    return out


def _freeze(value: Any) -> Hashable:
    """A hashable stand-in for a schedule attribute (lists, tuples, dicts and sets, nested)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(v) for v in value)
    return value


#: Compiled streams by :meth:`TimetableSchedule.compile_key`, newest last; at most
#: :data:`COMPILED_KEPT` (a batch ramp moves through a few micro-batch counts).
COMPILED: "OrderedDict[Hashable, Compiled]" = OrderedDict()
COMPILED_KEPT = 8


@dataclass(frozen=True)
class Compiled:
    """One stage's compiled stream: its rounds, the pipe buffer of each item (flat index), the
    buffer count, and the acknowledgement of each of its receives (in stream order)."""

    rounds: list[list[Item]]
    buffers: dict[int, int]
    num_buffers: int
    acks: list[int]


def modelled_peak(ops: Sequence[Any], pending_weight: float = 1.0) -> float:
    """The most a stage's op order (simulator ``Op``s) holds at once, in forwards' worth: an F adds
    1 (its activations), a split backward's B turns it into ``pending_weight`` (the activations a
    pending W keeps plus the gradients B recorded for it), W frees it; a whole backward ``B`` with
    no W in the order frees it."""
    split = {(op.micro, op.slice) for op in ops if op.kind == "W"}
    live = peak = 0.0
    for op in ops:
        unit = (op.micro, op.slice)
        if op.kind == "F":
            live += 1
        elif op.kind == "B":
            live += pending_weight - 1 if unit in split else -1
        elif op.kind == "W":
            live -= pending_weight
        peak = max(peak, live)
    return peak


__all__ = ["modelled_peak", "Transfer", "Item", "transfers", "linear_peer", "rounds", "sends_early", "acknowledgements", "COMPILED",
           "Compiled", "TimetableSchedule"]


# ------------------------------------------------------------------ as a DeepSpeed PipeSchedule

class TimetableSchedule(ds.PipeSchedule):
    """A ``PipeSchedule`` whose steps are compiled from a timetable of every stage (:func:`rounds`).

    Subclasses give :meth:`table` (every stage's ops), :meth:`cost` (modelled seconds, > 0; only
    the order of events depends on it), and the instructions of a compute op (:meth:`compute`);
    ``deps`` are the simulator's dependencies of the op kinds used.  Pipe buffers are reused: a
    unit ``(op.micro, op.slice)`` takes a free buffer at its first instruction on this stage and
    gives it back after its last (its backward, weight pass or gradient send), so
    ``num_pipe_buffers()`` is the most units ever alive at once on this stage.
    """

    deps: Deps = staticmethod(pipeline_deps)
    #: The engine posts its sends and a send never waits behind a receive on its link
    #: (``DsMpPipelineEngine.sends_overtake_receives``: gloo): compile each send right after its
    #: value is computed (:func:`sends_early`) instead of at its consumer's modelled start.
    posted_sends: bool = False

    def table(self) -> list[list[Op]]:
        raise NotImplementedError

    def cost(self, stage: int, op: Op) -> float:
        return 2.0 if op.kind == "B" else 1.0

    def peer(self) -> Callable[[int, Op], int | None]:
        """The stage that sends each op's input (:func:`transfers`); a linear pipeline here."""
        return linear_peer(self.stages)

    def sent_unit(self, move: Transfer) -> tuple[int, int]:
        """The sender's unit ``(micro, slice)`` whose value ``move`` carries: the consumer's own unit
        in a linear pipeline."""
        return move.op.micro, move.op.slice

    def compute(self, op: Op, buffer_id: int) -> list:
        """Instructions of compute ``op`` on this stage with its unit in ``buffer_id``."""
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        if op.kind == "F":
            return ([ds.LoadMicroBatch(buffer_id=buffer_id)] if first or last else []) + \
                [ds.ForwardPass(buffer_id=buffer_id)]
        if op.kind == "B":
            return [ds.BackwardPass(buffer_id=buffer_id)]
        raise ValueError(f"{type(self).__name__}: no instruction for op kind {op.kind!r}")

    def transfer(self, side: str, move: Transfer, buffer_id: int) -> list:
        """Instructions of this stage's ``side`` ("send" or "recv") of ``move``, its unit in
        ``buffer_id``: DeepSpeed's send/receive of an activation or a gradient (with its fixed
        neighbours)."""
        if move.kind == "act":
            return [ds.SendActivation(buffer_id=buffer_id) if side == "send" else ds.RecvActivation(buffer_id=buffer_id)]
        return [ds.SendGrad(buffer_id=buffer_id) if side == "send" else ds.RecvGrad(buffer_id=buffer_id)]

    def compile_key(self) -> Hashable:
        """Everything the compiled stream depends on: the class, ``posted_sends`` and the instance's
        data attributes (micro-batches, stages, this stage, the subclass's options: virtual stages,
        chunk weights, the slicing plan, …), frozen.  Left out: callables (a schedule's functions,
        ``deps``, are made from its data attributes) and ``PipeSchedule``'s iteration over its own
        steps (``it``: None, then the steps generator)."""
        state = {k: v for k, v in vars(self).items()
                 if not k.startswith("_") and k != "it" and not callable(v) and not isinstance(v, Iterator)}
        return type(self), self.posted_sends, _freeze(state)

    def _compiled(self) -> Compiled:
        key = self.compile_key()
        if key in COMPILED:
            COMPILED.move_to_end(key)
            return COMPILED[key]
        producer = (lambda m: Op("F" if m.kind == "act" else "B", *self.sent_unit(m))) if self.posted_sends else None
        every = rounds(self.table(), self.cost, self.deps, self.peer(), producer)
        mine = every[self.stage_id]
        flat = [(r, item) for r, items in enumerate(mine) for item in items]

        def unit(item: Item) -> tuple[int, int]:
            kind, x = item
            return (x.micro, x.slice) if kind == "compute" else self.sent_unit(x) if kind == "send" else \
                (x.op.micro, x.op.slice)
        last = {unit(item): i for i, (_, item) in enumerate(flat)}
        free: list[int] = []
        buffers: dict[tuple[int, int], int] = {}
        assign: dict[int, int] = {}  # flat index -> buffer
        count = 0
        for i, (_, item) in enumerate(flat):
            u = unit(item)
            if u not in buffers:
                if not free:
                    free.append(count)
                    count += 1
                buffers[u] = free.pop(0)
            assign[i] = buffers[u]
            if last[u] == i:
                free.append(buffers.pop(u))
                free.sort()
        acked = acknowledgements(every)
        COMPILED[key] = Compiled(mine, assign, max(count, 1), [acked[m] for _, (kind, m) in flat if kind == "recv"])
        while len(COMPILED) > COMPILED_KEPT:
            COMPILED.popitem(last=False)
        return COMPILED[key]

    def acknowledged(self) -> list[int]:
        """Per receive of this stage's stream, in order: how many of this stage's sends to the
        sender the sender had received before sending it (:func:`acknowledgements`)."""
        return self._compiled().acks

    def num_pipe_buffers(self) -> int:
        return self._compiled().num_buffers

    def steps(self) -> Iterator[list]:
        compiled = self._compiled()
        mine, assign = compiled.rounds, compiled.buffers
        i = 0
        for r, items in enumerate(mine):
            cmds: list = []
            for kind, x in items:
                buf = assign[i]
                i += 1
                cmds += self.compute(x, buf) if kind == "compute" else self.transfer(kind, x, buf)
            if r == len(mine) - 1:
                cmds += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield cmds
