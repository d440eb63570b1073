"""ZeRO-2 (gradient partitioning) inside ds_mp's ``PipelineEngine``.

DeepSpeed's stage-2 optimizer (``DeepSpeedZeroOptimizer`` with ``partition_gradients``)
reduces gradients while backward runs: a hook on every parameter copies its gradient into a
bucket, a full bucket is reduced over DP (each rank keeps the averaged slice of its own
partition) and the parameter's ``.grad`` is dropped.  A parameter may be reduced only once
between two *epilogues* (``overlapping_partition_gradients_reduce_epilogue``): the epilogue
reduces the last, partly filled bucket, adds this backward's partition gradients to the
step's accumulators and clears the "already reduced" marks.  At the end of a step the
accumulators become the partition's gradient (``averaged_gradients``), which the optimizer's
``step`` reads (norm, clipping, update).

DeepSpeed's plain engine runs the epilogue from ``backward()`` (``allreduce_gradients``), the
last micro-batch's backward being the boundary.  ``PipelineEngine`` turns that off (it reduces
in its own ``ReduceGrads`` instruction) and asserts stage < 2 in its constructor.  ds_mp drives
the same protocol from the pipeline's instructions, whatever the schedule:

* after **every** backward call (``BackwardPass``; one per micro-batch, or per token slice
  with TeraPipe) the epilogue runs with the boundary *off*: the gradients of that backward are
  reduced over DP and added to the step's partition accumulators;
* ``ReduceGrads`` closes the step: DeepSpeed's ``finalize_gradient_accumulation_boundary``
  (the path of its unmanaged gradient accumulation) turns the accumulators into the
  partition gradients; nothing is reduced twice and no backward needs to know it is the last.

Every gradient is therefore reduced over DP once per backward call, exactly what DeepSpeed's
own ZeRO-2 does per micro-batch.  The tied ``wte`` (first and last pipeline stage) is summed
over its tied group after the step's partitions are final: its full gradient is assembled
from the DP partitions, all-reduced over the tied group, and each DP rank writes back its
own fragment (``deepspeed_compat.zero2_full_grad`` / ``zero2_set_full_grad``).
"""
from __future__ import annotations



import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.engine_view import RuntimeEngine


def partitions_gradients(engine: RuntimeEngine) -> bool:
    """True when the engine's optimizer is DeepSpeed's ZeRO stage 2 (gradient partitioning)."""
    return engine.zero_optimization_partition_gradients()


def close_backward(engine: RuntimeEngine) -> None:
    """After one backward call: reduce its gradients over DP into the step's accumulators."""
    compat.zero2_close_backward(engine.optimizer)


def close_step(engine: RuntimeEngine) -> None:
    """``ReduceGrads``: make the step's partition gradients final, then sum the tied weights'
    gradients over their tied groups (first and last stage)."""
    compat.zero2_close_step(engine.optimizer)
    for _, weight, group, ranks in compat.tied_weights(engine.module):
        if weight.requires_grad and len(ranks) > 1:
            full = compat.zero2_full_grad(weight)  # collective over the DP group
            dist.all_reduce(full, group=group)
            compat.zero2_set_full_grad(weight, full)


def partition_gradients(engine: RuntimeEngine) -> list[torch.Tensor]:
    """This DP rank's partition gradients of the step (after :func:`close_step`)."""
    return compat.zero2_partition_grads(engine.optimizer)


__all__ = ["partitions_gradients", "close_backward", "close_step", "partition_gradients"]
