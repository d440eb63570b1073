"""Accessors for the DeepSpeed engine, module and optimizer internals the schedules' runtimes read
or set (each name is in ``pipeline.ASSUMPTIONS`` / ``ENGINE_ATTRIBUTES``, checked when an engine is
built, or checked here where it is read)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from ds_mp.deepspeed_compat.pipeline import Assumption, _fail

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine


def neighbours(engine: PipelineEngine) -> tuple[int, int]:
    """``(prev_stage, next_stage)``: the stages this rank's pipe sends/receives exchange with."""
    return engine.prev_stage, engine.next_stage


def set_neighbours(engine: PipelineEngine, prev: int, next_: int) -> None:
    """Point the pipe's p2p at other stages (interleaved: the ring ``s-1, s+1 mod K``)."""
    engine.prev_stage, engine.next_stage = prev, next_


def announce_every_shape(engine: PipelineEngine) -> None:
    """Send the shape announcement with every activation and read one with every receive (what
    ``dynamic_shape`` does): for a rank that receives activations from two peers (ZB-V's middle
    ranks), whose first messages would otherwise each be expected to carry the one announcement."""
    engine.dynamic_shape = True


def set_computing_loss(engine: PipelineEngine, on: bool) -> None:
    """Whether the last stage's forward computes the loss (``_compute_loss``: set by DeepSpeed's
    ``train_batch`` / ``eval_batch``; a runtime running its own evaluation sets it)."""
    engine._compute_loss = on


def received_grad(engine: PipelineEngine) -> Any:
    """The gradient the last ``RecvGrad`` wrote (DeepSpeed's one shared buffer, overwritten by the next)."""
    return engine.grad_layer


def set_received_grad(engine: PipelineEngine, grad: Any) -> None:
    """What the next ``BackwardPass`` of a non-last stage backpropagates."""
    engine.grad_layer = grad


def release_loss_graph(engine: PipelineEngine) -> None:
    """Keep the last stage's loss (``loss``) as a value only: the graph above it may be freed."""
    engine.loss = engine.loss.detach()


def set_train_loss(engine: PipelineEngine, loss: Any) -> Any:
    """``train_batch``'s reported loss (``agg_train_loss``, read by DeepSpeed's logging); returns it."""
    engine.agg_train_loss = loss
    return loss


@contextlib.contextmanager
def batch_fn_done(engine: PipelineEngine) -> Iterator[None]:
    """Inside, DeepSpeed reads the micro-batches as they are (``batch_fn`` None): ds_mp's read already
    applied it."""
    batch_fn, engine.batch_fn = engine.batch_fn, None
    try:
        yield
    finally:
        engine.batch_fn = batch_fn


def set_step_counters(engine: PipelineEngine, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """DeepSpeed's step counters (``global_steps``, ``global_samples``, ``skipped_steps``), as a resume restores them."""
    engine.global_steps, engine.global_samples, engine.skipped_steps = global_steps, global_samples, skipped_steps


def drop_bf16_grads(engine: PipelineEngine) -> None:
    """BF16_Optimizer: drop the bf16 ``.grad`` of every parameter (its masters keep theirs)."""
    engine.optimizer.clear_lp_grads()


def bf16_fp32_gradients(optimizer: Any) -> dict[int, Any]:
    """BF16_Optimizer: id(bf16 parameter) -> its fp32 gradient buffer (``bf16_groups`` zipped with
    ``fp32_groups_gradients``: the micro-batch gradients accumulated in fp32)."""
    for name in ("bf16_groups", "fp32_groups_gradients"):
        if not hasattr(optimizer, name):
            raise _fail(Assumption("bf16", name, "per group, the bf16 parameters and their fp32 gradient "
                                   "buffers, in the same order"), type(optimizer).__name__)
    return {id(lp): g for lps, gs in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients)
            for lp, g in zip(lps, gs)}


def zero_gradient_for_reduction(optimizer: Any, param: Any) -> Any:
    """ZeRO-1/2: the gradient of ``param`` the DP reduction will average (before it)."""
    return optimizer.get_gradient_for_reduction(param)


def use_activation_checkpoint(module: Any, checkpoint: Any) -> None:
    """Make the PipelineModule checkpoint its segments with ``checkpoint(function, *args)``."""
    if not hasattr(module, "activation_checkpoint_func"):
        raise _fail(Assumption("module", "activation_checkpoint_func", "the function forward() checkpoints "
                               "segments with"), type(module).__name__)
    module.activation_checkpoint_func = checkpoint


def local_layers(module: Any) -> list:
    """The layers this stage's ``forward()`` runs, in order (``forward_funcs``)."""
    return module.forward_funcs


@contextlib.contextmanager
def running_layers(module: Any, funcs: list, flags: list[bool]) -> Iterator[None]:
    """Within the body the module's ``forward()`` runs ``funcs`` (a subset of its local layers),
    with ``flags`` (:func:`checkpointable_flags` of them) as its checkpoint-segment flags."""
    every, whole = module.forward_funcs, module.is_checkpointable_results
    module.forward_funcs, module.is_checkpointable_results = funcs, flags
    try:
        yield
    finally:
        module.forward_funcs, module.is_checkpointable_results = every, whole


def stage_bounds(module: Any) -> list[int]:
    """The layer index each pipeline stage starts at, and the end (``parts``: stages + 1 entries)."""
    return list(module.parts)


def tied_parameter_ids(module: Any) -> set[int]:
    """id() of every parameter of the module's tied layers (``tied_modules``; none without)."""
    return {id(p) for m in getattr(module, "tied_modules", {}).values() for p in m.parameters()}


def has_tied_comms(module: Any) -> bool:
    """True for a PipelineModule (it keeps ``tied_comms``, possibly empty)."""
    return hasattr(module, "tied_comms")


__all__ = ["neighbours", "set_neighbours", "announce_every_shape", "set_computing_loss", "received_grad", "set_received_grad", "release_loss_graph", "set_train_loss", "drop_bf16_grads",
           "bf16_fp32_gradients", "zero_gradient_for_reduction", "use_activation_checkpoint", "local_layers",
           "running_layers", "stage_bounds", "tied_parameter_ids", "has_tied_comms"]
