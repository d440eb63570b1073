"""The adapter between DeepSpeed's ``PipelineEngine`` and ds_mp's engine: the one subclass of it.

DeepSpeed runs a pipeline step through private hooks (``_train_schedule``, ``_exec_schedule``,
one ``_exec_*`` handler per instruction, ``_aggregate_total_loss``).  :class:`PipelineEngineAdapter`
overrides exactly those listed in :data:`HANDLERS` and translates each into a call of a public
method of the engine subclass (``ds_mp.engine.pipeline_engine.DsMpPipelineEngine``); DeepSpeed's own
behaviour stays reachable as ``deepspeed_<method>`` (what ``super()._exec_*`` was).  The engine
subclass therefore names no private DeepSpeed hook; the list of overrides is this table, and
:func:`check_overrides` verifies, from the adapter class itself, that DeepSpeed still defines every
private name the adapter overrides (a rename would otherwise turn an override into dead code).

Instructions dispatch by type through ``_INSTRUCTION_MAP`` (DeepSpeed's own map, copied):
:meth:`PipelineEngineAdapter.register_instruction` adds a schedule's instruction types, and
:meth:`PipelineEngineAdapter.handler_for` is the dispatch the engine's schedule loop uses.
"""
from __future__ import annotations

from typing import Any, Callable

from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_mp.deepspeed_compat.stage_gate import PipelineStageGate

#: DeepSpeed's private hook -> ds_mp's public engine method it is translated into.
HANDLERS: dict[str, str] = {
    "_train_schedule": "train_schedule",           # train_batch builds its PipeSchedule here
    "_exec_schedule": "run_schedule",              # runs one schedule's instruction steps
    "_aggregate_total_loss": "aggregate_loss",     # train_batch's mean loss, broadcast from the loss stage
    "_reduce_outputs": "reduce_outputs",           # eval_batch's mean over micro-batches and replicas
    "_exec_load_micro_batch": "load_micro_batch",  # next micro-batch into inputs/labels[buffer_id]
    "_exec_recv_activations": "recv_activations",  # previous stage's activations into a buffer
    "_exec_send_activations": "send_activations",  # a buffer's outputs to the next stage
    "_exec_recv_grads": "recv_grads",              # next stage's gradient into grad_layer
    "_exec_send_grads": "send_grads",              # a buffer's input gradients to the previous stage
    "_exec_forward_pass": "run_forward",           # forward a buffer (last stage: sets loss)
    "_exec_backward_pass": "run_backward",         # backpropagate loss / grad_layer
    "_exec_reduce_tied_grads": "reduce_tied_gradients",  # sum tied weights' gradients over their group
    "_exec_reduce_grads": "reduce_gradients",      # DP gradient all-reduce (bf16/ZeRO aware)
    "_exec_optimizer_step": "optimizer_step",      # clipping, optimizer, LR scheduler, counters
}


def _by_name(name: str) -> Callable:
    """Dispatch to ``self.<name>`` so an override (of the class or the instance) applies
    (DeepSpeed's own map holds the base-class functions)."""
    def call(self: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(**kwargs)
    call.__name__ = name
    return call


def _translate(public: str) -> Callable:
    def override(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, public)(*args, **kwargs)
    override.__name__ = public
    return override


def _original(private: str) -> Callable:
    def deepspeed(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(PipelineEngine, private)(self, *args, **kwargs)
    deepspeed.__name__ = f"deepspeed_{private}"
    deepspeed.__doc__ = f"DeepSpeed's own ``PipelineEngine.{private}``."
    return deepspeed


class PipelineEngineAdapter(PipelineEngine, PipelineStageGate):
    """``PipelineEngine`` whose private hooks call public methods (:data:`HANDLERS`); the
    ``PipelineStageGate`` base lets ZeRO-2 past ``PipelineEngine.__init__``'s stage assert
    (``stage_gate.py``)."""

    _INSTRUCTION_MAP = {instr: _by_name(fn.__name__) for instr, fn in PipelineEngine._INSTRUCTION_MAP.items()}

    @classmethod
    def register_instruction(cls, instruction: type, method: Callable) -> None:
        """Map a new ``PipeInstruction`` type to ``method(engine, **kwargs)``."""
        cls._INSTRUCTION_MAP[instruction] = method

    def handler_for(self, cmd: Any) -> Callable | None:
        """The function an instruction dispatches to (called as ``handler(engine, **cmd.kwargs)``)."""
        return self._INSTRUCTION_MAP.get(type(cmd))


for _private, _public in HANDLERS.items():  # the overrides, and DeepSpeed's behaviour as the default
    setattr(PipelineEngineAdapter, _private, _translate(_public))
    setattr(PipelineEngineAdapter, _public, _original(_private))
    setattr(PipelineEngineAdapter, f"deepspeed_{_public}", _original(_private))


def check_overrides(adapter: type = PipelineEngineAdapter) -> list[str]:
    """The private names ``adapter`` overrides, each still defined by DeepSpeed's ``PipelineEngine``."""
    from ds_mp.deepspeed_compat.pipeline import overridden_private_names

    return overridden_private_names(adapter, PipelineEngine, "engine")


__all__ = ["HANDLERS", "PipelineEngineAdapter", "check_overrides"]
