"""TeraPipe (Li et al., ICML 2021): pipelining one sequence along its tokens.

A causal Transformer's position t depends only on positions ≤ t, so each micro-batch's
sequence of L tokens is cut into slices l_1 … l_M (and its rows into batch-slices) and stage
k forwards slice i while stage k+1 forwards slice i−1.  A *unit* is one (micro-batch,
batch-slice, token slice); units run in the order micro → batch-slice → token slice.

Attention of a slice to the earlier slices' keys/values: ``kv_cache``.  Engine handlers of
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
from typing import Any

from deepspeed.runtime.pipe.schedule import BufferOpInstruction

from ds_mp.schedules.gpipe import FillDrain
from ds_mp.schedules.simulate import Op
from ds_mp.schedules.terapipe.planner import Plan


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
    def from_engine(cls, engine: Any) -> "TeraPipeSchedule":
        return cls(engine.micro_batches, engine.num_stages, engine.stage_id, engine.terapipe.new_batch())

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




__all__ = ["LoadSlice", "ForwardSlice", "BackwardSlice", "TeraPipeSchedule", "Unit", "plan_units", "Plan"]
