"""TeraPipe (Li et al., ICML 2021): pipelining one sequence along its tokens.

A causal Transformer's position t depends only on positions ≤ t, so each micro-batch's
sequence of L tokens is cut into slices l_1 … l_M (and its rows into batch-slices) and stage
k forwards slice i while stage k+1 forwards slice i−1.  A *unit* is one (micro-batch,
batch-slice, token slice); units run in the order micro → batch-slice → token slice.

Attention of a slice to the earlier slices' keys/values: ``ds_mp.engine.terapipe_kv``.  Engine handlers of
the instructions below: ``ds_mp.engine.terapipe``.

Loss: slice i's targets are ``shift_labels(labels)[:, c:c+l]`` (the last token of slice i
predicts the first of slice i+1) and its loss is Σ token losses / (valid targets of the whole
micro-batch), so the slices' losses sum to the micro-batch's HF loss.

Timetable (K stages, U units, P = U + K − 1 steps per phase; the paper's figure)::

    forward phase:  stage s forwards unit t − s at step t
    backward phase: stage s backwards unit U − 1 − (t − (K − 1 − s)) at step t

    K=2, U=3    step  0    1    2    3  |  0    1    2    3
    stage 0           F0   F1   F2      |       B2   B1   B0
    stage 1                F0   F1   F2 |  B2   B1   B0

A result is sent one step after it is computed, and received at that same step by the
neighbour (sends before receives inside a step), as in ``GPipe``.
"""
from __future__ import annotations

from dataclasses import dataclass


from deepspeed.runtime.pipe.schedule import BufferOpInstruction

from ds_mp.schedules.gpipe import FillDrain
from ds_mp.schedules.simulate import Op, sliced_one_f_one_b_timetable
from ds_mp.schedules.terapipe.planner import Plan
from ds_mp.schedules.timetable import TimetableSchedule
from ds_mp.engine_view import StageView


# ------------------------------------------------------------------ instructions
# Instructions are DeepSpeed ``PipeInstruction`` value objects: their keyword arguments
# become attributes and are passed to the engine method registered for the type.
# Activations and gradients of token slices travel with DeepSpeed's own Send/Recv
# instructions on the slice's buffer (the module has ``dynamic_shape=True``).
# A *unit* is ``(micro, batch_slice, slice)``: rows ``(r0, r1)`` and tokens ``(a, b)`` of
# micro-batch ``micro``; each unit owns one pipe buffer.

class LoadSlice(BufferOpInstruction):
    """First/last stage: put unit ``buffer_id``'s input ``(ids[r0:r1, a:b], positions a..b-1)``
    and/or its targets ``(shift_labels(labels)[r0:r1, a:b], valid targets of the micro-batch)``
    into the buffer.  Fetches micro-batch ``micro`` from the data iterator on its first use.

    kwargs: ``buffer_id``, ``micro``, ``rows=(r0, r1)``, ``tokens=(a, b)``.
    """


class ForwardSlice(BufferOpInstruction):
    """Forward unit ``buffer_id`` with this stage's blocks attending to the cached keys/values
    of the earlier token slices of the same sequence ``(micro, batch_slice)``, then cache its own.

    kwargs: ``buffer_id``, ``micro``, ``batch_slice``, ``slice``.
    """


class BackwardSlice(BufferOpInstruction):
    """Backward unit ``buffer_id``; the key/value gradients that later slices left on this
    slice's cached keys/values flow into it.  After slice 0 the sequence's cache is freed.

    kwargs: ``buffer_id``, ``micro``, ``batch_slice``, ``slice``.
    """



@dataclass(frozen=True)
class Unit:
    micro: int
    batch_slice: int
    slice: int
    rows: tuple[int, int]    # [r0, r1) of the micro-batch
    tokens: tuple[int, int]  # [a, b) of the sequence


def plan_units(plan: Plan, micro_batches: int) -> list[Unit]:
    """Units in forward order: micro-batch, then batch-slice, then token slice."""
    out = []
    for m in range(micro_batches):
        r0 = 0
        for bs, (rows, slices) in enumerate(plan):
            a = 0
            for i, n in enumerate(slices):
                out.append(Unit(m, bs, i, (r0, r0 + rows), (a, a + n)))
                a += n
            r0 += rows
    return out


class TeraPipeSchedule(FillDrain):
    """Token-sliced GPipe: ``FillDrain`` over units, backwards in reverse (the module docstring's
    timetable)."""

    dynamic_shape = True  # uneven slices: DeepSpeed must announce activation shapes on every send

    def __init__(self, micro_batches: int, stages: int, stage_id: int, plan: Plan) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.plan = plan
        self.units = plan_units(plan, micro_batches)

    @classmethod
    def from_engine(cls, engine: StageView) -> "TeraPipeSchedule | TeraPipe1F1B":
        """The order ``terapipe.order`` names: "gpipe" (this class) or "1f1b" (:class:`TeraPipe1F1B`)."""
        order = getattr(engine.ds_mp_config.terapipe, "order", "gpipe") if engine.ds_mp_config else "gpipe"
        kind = TeraPipe1F1B if order == "1f1b" else cls
        return kind(engine.micro_batches, engine.num_stages, engine.stage_id, engine.schedule_support.new_batch())

    reverse_backward = True  # slice i's backward needs the key/value gradients of slices > i

    def num_items(self) -> int:
        return len(self.units)

    def load(self, u: int) -> LoadSlice:
        x = self.units[u]
        return LoadSlice(buffer_id=u, micro=x.micro, rows=x.rows, tokens=x.tokens)

    def forward(self, u: int) -> ForwardSlice:
        x = self.units[u]
        return ForwardSlice(buffer_id=u, micro=x.micro, batch_slice=x.batch_slice, slice=x.slice)

    def backward(self, u: int) -> BackwardSlice:
        x = self.units[u]
        return BackwardSlice(buffer_id=u, micro=x.micro, batch_slice=x.batch_slice, slice=x.slice)

    def ops(self) -> list[Op]:
        """This stage's forwards/backwards in order, as simulator ops ``Op(kind, micro, slice)``
        with ``slice`` numbering the (batch-slice, token slice) pairs of a micro-batch."""
        per_micro = sum(len(s) for _, s in self.plan)
        return [Op("F" if isinstance(c, ForwardSlice) else "B", c.micro, c.buffer_id % per_micro)
                for step in self.steps() for c in step if isinstance(c, (ForwardSlice, BackwardSlice))]


class TeraPipe1F1B(TimetableSchedule):
    """Token-sliced 1F1B (``"terapipe": {"order": "1f1b"}``): the units of :class:`TeraPipeSchedule`
    in :func:`ds_mp.schedules.simulate.sliced_one_f_one_b_timetable`'s order — a sequence's last
    slice is backwarded as soon as it is forwarded on the last stage, its slices in reverse, and at
    most ``N + K − 1 − s`` units (N: a sequence's slices) hold activations on stage s, against all
    ``micro-batches × N`` in the GPipe order.  Same instructions, same key/value cache.
    """

    dynamic_shape = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int, plan: Plan) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.plan = plan
        self.units = plan_units(plan, micro_batches)
        self.per_micro = sum(len(s) for _, s in plan)

    def _unit(self, op: Op) -> int:
        return op.micro * self.per_micro + op.slice

    def table(self) -> list[list[Op]]:
        sequences: dict[tuple[int, int], list[Op]] = {}
        for u, x in enumerate(self.units):
            sequences.setdefault((x.micro, x.batch_slice), []).append(Op("F", x.micro, u % self.per_micro))
        return sliced_one_f_one_b_timetable(self.stages, list(sequences.values()))

    def cost(self, stage: int, op: Op) -> float:
        """rows × tokens × (attended context + tokens), backward twice the forward."""
        x = self.units[self._unit(op)]
        (r0, r1), (a, b) = x.rows, x.tokens
        return (r1 - r0) * (b - a) * (b + a + 1) * (2.0 if op.kind == "B" else 1.0)

    def compute(self, op: Op, buffer_id: int) -> list:
        x = self.units[self._unit(op)]
        where = dict(buffer_id=buffer_id, micro=x.micro, batch_slice=x.batch_slice, slice=x.slice)
        if op.kind == "B":
            return [BackwardSlice(**where)]
        load = [LoadSlice(buffer_id=buffer_id, micro=x.micro, rows=x.rows, tokens=x.tokens)]
        return (load if self.stage_id in (0, self.stages - 1) else []) + [ForwardSlice(**where)]

    def ops(self) -> list[Op]:
        """This stage's ops in order (the simulator's ``Op(kind, micro, slice)``)."""
        return self.table()[self.stage_id]


__all__ = ["LoadSlice", "ForwardSlice", "BackwardSlice", "TeraPipeSchedule", "TeraPipe1F1B", "Unit", "plan_units",
           "Plan"]
