"""The synchronous micro-batch schedules: 1F1B (DeepSpeed's) and GPipe.

A schedule is DeepSpeed's shape: a ``PipeSchedule`` whose ``steps()`` yields, per step,
the list of instructions this stage executes.  Sends at step ``t`` on stage ``s`` are
matched by receives at step ``t`` on the neighbour, so a barrier between steps cannot
deadlock.  Their specs (``ONE_F_ONE_B``, ``GPIPE``) are registered in :mod:`ds_mp.config.registry`.
"""
from __future__ import annotations

from typing import Iterator

from deepspeed.runtime.pipe import schedule as ds

from ds_mp.config.registry import ALL_FAMILIES, ScheduleSpec


class OneFOneB(ds.TrainSchedule):
    """DeepSpeed's own 1F1B ``TrainSchedule`` (PipeDream-flush), unchanged.

    Stage s runs ``K − s − 1`` warm-up forwards, then alternates one forward and one
    backward, then drains; at most ``K − s`` micro-batches are in flight.
    """


class FillDrain(ds.PipeSchedule):
    """All forwards, then all backwards, over ``num_items()`` work items (GPipe's micro-batches,
    TeraPipe's token-slice units); each item owns one pipe buffer.

    With K stages, U items and P = U + K − 1 steps per phase, stage s forwards item ``t − s``
    at forward step t and backwards item ``order(t − (K − 1 − s))`` at backward step t, where
    ``order`` is ascending (GPipe) or descending (``reverse_backward``: TeraPipe, whose later
    slices must backpropagate first).  A result is sent one step after it is computed and
    received at that same step by the neighbour (sends before receives inside a step), so
    blocking p2p never deadlocks.  Subclasses say which instruction loads, forwards and
    backwards an item.
    """

    reverse_backward = False

    def num_items(self) -> int:
        return self.micro_batches

    def load(self, u: int) -> ds.PipeInstruction:
        return ds.LoadMicroBatch(buffer_id=u)

    def forward(self, u: int) -> ds.PipeInstruction:
        return ds.ForwardPass(buffer_id=u)

    def backward(self, u: int) -> ds.PipeInstruction:
        return ds.BackwardPass(buffer_id=u)

    def num_pipe_buffers(self) -> int:
        return self.num_items()

    def forward_item(self, t: int) -> int:
        return t - self.stage_id

    def backward_item(self, t: int) -> int:
        k = t - (self.stages - 1 - self.stage_id)
        return self.num_items() - 1 - k if self.reverse_backward else k

    def _valid(self, u: int) -> bool:
        return 0 <= u < self.num_items()

    def _forward_step(self, t: int) -> list:
        cmds: list = []
        sent = self.forward_item(t - 1)  # forwarded here at the previous step
        if not self.is_last_stage and self._valid(sent):
            cmds.append(ds.SendActivation(buffer_id=sent))
        u = self.forward_item(t)
        if self._valid(u):
            if self.is_first_stage or self.is_last_stage:
                cmds.append(self.load(u))
            if not self.is_first_stage:
                cmds.append(ds.RecvActivation(buffer_id=u))
            cmds.append(self.forward(u))
        return cmds

    def _backward_step(self, t: int) -> list:
        cmds: list = []
        sent = self.backward_item(t - 1)
        if not self.is_first_stage and self._valid(sent):
            cmds.append(ds.SendGrad(buffer_id=sent))
        u = self.backward_item(t)
        if self._valid(u):
            if not self.is_last_stage:
                cmds.append(ds.RecvGrad(buffer_id=u))
            cmds.append(self.backward(u))
        return cmds

    def steps(self) -> Iterator[list]:
        phase = self.num_items() + self.stages - 1
        for t in range(phase):
            yield self._forward_step(t)
        for t in range(phase):
            cmds = self._backward_step(t)
            if t == phase - 1:
                cmds += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield cmds


class GPipe(FillDrain):
    """All forwards, then all backwards (GPipe), as an explicit timetable.

    With K stages and M micro-batches, stage s forwards micro-batch m at step ``s + m``
    and backwards it at step ``P + (K − 1 − s) + m`` with ``P = M + K − 1`` forward
    steps.  Activations of all M micro-batches are alive at once (M buffers)::

        K=3, M=3   step: 0   1   2   3   4 | 5   6   7   8   9
        stage 0         F0  F1  F2         |         B0  B1  B2
        stage 1             F0  F1  F2     |     B0  B1  B2
        stage 2                 F0  F1  F2 | B0  B1  B2
    """


# Plain timetables of DeepSpeed's instructions: no runtime; tested with every family and a batch ramp.
ONE_F_ONE_B = ScheduleSpec(timetable=OneFOneB, families=ALL_FAMILIES, batch_ramp=True, context_parallel=True)
GPIPE = ScheduleSpec(timetable=GPipe, families=ALL_FAMILIES, batch_ramp=True, context_parallel=True)
