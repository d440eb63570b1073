"""Pipeline instructions the ds_mp schedules add to DeepSpeed's set.

An instruction is a small value object (DeepSpeed's ``PipeInstruction``: its keyword
arguments become attributes and are passed to the engine method it is mapped to with
``DsMpPipelineEngine.register_instruction``).  Activations and gradients of token slices
travel with DeepSpeed's own ``SendActivation``/``RecvActivation``/``SendGrad``/``RecvGrad``
on the slice's buffer: the module has ``dynamic_shape=True``, so every send re-announces the
(slice-dependent) shape.

TeraPipe names a *unit* of work by ``(micro, batch_slice, slice)``: micro-batch ``micro``,
rows ``rows = (r0, r1)`` of it (its batch-slice), tokens ``tokens = (a, b)`` of its sequence
(its token slice); each unit owns one pipe buffer.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.schedule import BufferOpInstruction


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


__all__ = ["LoadSlice", "ForwardSlice", "BackwardSlice"]
