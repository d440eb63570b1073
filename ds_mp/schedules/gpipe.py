"""The synchronous micro-batch schedules: 1F1B (DeepSpeed's) and GPipe.

A schedule is DeepSpeed's shape: a ``PipeSchedule`` whose ``steps()`` yields, per step,
the list of instructions this stage executes.  Sends at step ``t`` on stage ``s`` are
matched by receives at step ``t`` on the neighbour, so a barrier between steps cannot
deadlock.  Names are in :mod:`ds_mp.schedules.registry`.
"""
from __future__ import annotations

from typing import Iterator

from deepspeed.runtime.pipe import schedule as ds

class OneFOneB(ds.TrainSchedule):
    """DeepSpeed's own 1F1B ``TrainSchedule`` (PipeDream-flush), unchanged.

    Stage s runs ``K − s − 1`` warm-up forwards, then alternates one forward and one
    backward, then drains; at most ``K − s`` micro-batches are in flight.
    """


class GPipe(ds.PipeSchedule):
    """All forwards, then all backwards (GPipe), as an explicit timetable.

    With K stages and M micro-batches, stage s forwards micro-batch m at step ``s + m``
    and backwards it at step ``P + (K − 1 − s) + m`` with ``P = M + K − 1`` forward
    steps.  Activations of all M micro-batches are alive at once (M buffers)::

        K=3, M=3   step: 0   1   2   3   4 | 5   6   7   8   9
        stage 0         F0  F1  F2         |         B0  B1  B2
        stage 1             F0  F1  F2     |     B0  B1  B2
        stage 2                 F0  F1  F2 | B0  B1  B2
    """

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _forward_step(self, t: int) -> list:
        s, K, M = self.stage_id, self.stages, self.micro_batches
        cmds: list = []
        sent = t - 1 - s  # micro-batch forwarded here at the previous step
        if s < K - 1 and 0 <= sent < M:
            cmds.append(ds.SendActivation(buffer_id=sent))
        m = t - s
        if 0 <= m < M:
            cmds.append(ds.LoadMicroBatch(buffer_id=m) if s == 0 or s == K - 1 else None)
            if s > 0:
                cmds.append(ds.RecvActivation(buffer_id=m))
            cmds.append(ds.ForwardPass(buffer_id=m))
        return [c for c in cmds if c is not None]

    def _backward_step(self, t: int) -> list:
        s, K, M = self.stage_id, self.stages, self.micro_batches
        cmds: list = []
        sent = t - 1 - (K - 1 - s)
        if s > 0 and 0 <= sent < M:
            cmds.append(ds.SendGrad(buffer_id=sent))
        m = t - (K - 1 - s)
        if 0 <= m < M:
            if s < K - 1:
                cmds.append(ds.RecvGrad(buffer_id=m))
            cmds.append(ds.BackwardPass(buffer_id=m))
        return cmds

    def steps(self) -> Iterator[list]:
        phase = self.micro_batches + self.stages - 1
        for t in range(phase):
            yield self._forward_step(t)
        for t in range(phase):
            cmds = self._backward_step(t)
            if t == phase - 1:
                cmds += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield cmds

