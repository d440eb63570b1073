"""DeepSpeed's pipeline p2p wire format: the messages its send handlers send, listed for ds_mp to
post itself (``ds_mp/engine/p2p.py``) so DeepSpeed's own receive handlers read them unchanged."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine

def activation_messages(engine: PipelineEngine, buffer_id: int) -> list:
    """The tensors DeepSpeed's ``_exec_send_activations`` sends the next stage for ``buffer_id``,
    in order, without sending them: the shape announcement (``_send_tensor_meta``'s buffer) when
    due (the first send, or every send with ``dynamic_shape``), then the outputs, a trailing bool
    mask as half (``has_attention_mask`` / ``has_bool_tensors``).  DeepSpeed's own receive handler
    reads them unchanged."""
    import torch

    outputs = engine.pipe_buffers["outputs"][buffer_id]
    if engine.has_attention_mask or engine.has_bool_tensors:
        outputs = (*outputs[:-1], outputs[-1].half())
    messages = []
    if engine.dynamic_shape or engine.first_output_send:
        engine.first_output_send = False
        messages.append(_tensor_meta(engine, outputs))
    if isinstance(outputs, torch.Tensor):
        return [*messages, outputs]
    if isinstance(outputs, tuple):
        return [*messages, *outputs]
    raise NotImplementedError(f"Could not send output of type {type(outputs)}")


def grad_messages(engine: PipelineEngine, buffer_id: int) -> list:
    """The tensors DeepSpeed's ``_exec_send_grads`` sends the previous stage for ``buffer_id``, in
    order, without sending them (the first input's gradient partitioned over TP when
    ``is_grad_partitioned``: its meta and local part; no bool mask); the buffer's inputs are then
    dropped, as DeepSpeed does."""
    import torch
    from deepspeed.runtime.utils import PartitionedTensor

    inputs = engine.pipe_buffers["inputs"][buffer_id]
    if engine.is_grad_partitioned:
        first, tail = (inputs[0], inputs[1:]) if isinstance(inputs, tuple) else (inputs, ())
        part = PartitionedTensor(tensor=first.grad, group=engine.grid.get_slice_parallel_group())
        inputs = (part.to_meta(), part.data(), *[t.grad for t in tail])
    if engine.has_attention_mask or engine.has_bool_tensors:
        inputs = tuple(inputs)[:-1]
    if isinstance(inputs, torch.Tensor):
        assert inputs.grad is not None
        messages = [inputs.grad]
    elif engine.is_grad_partitioned:  # DeepSpeed sends the partitioned gradient only
        messages = [inputs[0], inputs[1]]
    else:
        messages = []
        for t in inputs:
            if not t.is_floating_point():  # tensors that produce no gradient
                assert t.grad is None
                continue
            assert t.grad is not None
            messages.append(t.grad)
    engine.pipe_buffers["inputs"][buffer_id] = None
    return messages


def _tensor_meta(engine: PipelineEngine, buffer: Any) -> Any:
    """``_send_tensor_meta``'s int32 buffer announcing ``buffer``'s type, dtypes and shapes."""
    import torch
    from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE

    if isinstance(buffer, torch.Tensor):
        meta = [0, engine.DTYPE_TO_ID[buffer.dtype], len(buffer.size()), *buffer.size()]
    elif isinstance(buffer, tuple):
        meta = [2, len(buffer)]
        for t in buffer:
            assert isinstance(t, torch.Tensor)
            meta += [engine.DTYPE_TO_ID[t.dtype], len(t.size()), *t.size()]
    else:
        raise NotImplementedError(f"Could not send meta type {type(buffer)}")
    assert len(meta) <= TENSOR_META_SIZE, f"metadata of {len(meta)} entries exceeds TENSOR_META_SIZE"
    out = torch.zeros(TENSOR_META_SIZE, dtype=torch.int32, device=engine.device)
    out[:len(meta)].copy_(torch.tensor(meta, dtype=torch.int32))
    return out


def stage_rank(engine: PipelineEngine, stage: int) -> int:
    """The global rank of pipeline stage ``stage`` in this rank's pipe (DeepSpeed's grid)."""
    return engine.grid.stage_to_global(stage_id=stage)


__all__ = ["activation_messages", "grad_messages", "stage_rank"]
