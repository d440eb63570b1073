"""Private DeepSpeed names of the pipeline engine and module: the assumptions checked when an
engine is built (:func:`check`, :func:`check_engine`) and the accessors ds_mp reads them through."""
from __future__ import annotations

from dataclasses import dataclass
import contextlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine


class DeepSpeedIncompatible(RuntimeError):
    """The installed DeepSpeed lacks a private name ds_mp relies on."""


@dataclass(frozen=True)
class Assumption:
    owner: str  # "engine" (PipelineEngine), "module" (PipelineModule), "ops" (deepspeed.ops), "p2p" (pipe.p2p),
    # "bf16" (BF16_Optimizer), "zero" (DeepSpeedZeroOptimizer)
    name: str
    behaviour: str  # what ds_mp relies on


ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption("engine", "_INSTRUCTION_MAP", "dict instruction type -> handler; _exec_schedule dispatches on "
               "type(cmd) exactly, so new instruction types are added to a copy in the subclass"),
    Assumption("engine", "_exec_schedule", "runs one schedule: reserves buffers, resets the list fwd_outputs "
               "that _exec_forward_pass appends to, then runs every step's instructions"),
    Assumption("engine", "_train_schedule", "train_batch builds its PipeSchedule through this hook"),
    Assumption("engine", "_reserve_pipe_buffers", "grows pipe_buffers to num_pipe_buffers() slots"),
    Assumption("engine", "_exec_load_micro_batch", "loads the next micro-batch into inputs/labels[buffer_id]"),
    Assumption("engine", "_exec_recv_activations", "receives the previous stage's activations into a buffer"),
    Assumption("engine", "_exec_recv_grads", "receives the next stage's gradient into the engine's grad_layer"),
    Assumption("engine", "_exec_send_activations", "sends a buffer's outputs to the next stage through p2p.send"),
    Assumption("engine", "_exec_send_grads", "sends a buffer's input gradients to the previous stage through "
               "p2p.send, then drops the buffer's inputs"),
    Assumption("engine", "_exec_forward_pass", "forwards a buffer; on the last stage sets self.loss when "
               "self._compute_loss (set by train_batch/eval_batch)"),
    Assumption("engine", "_exec_backward_pass", "backpropagates self.loss (last stage) or self.grad_layer"),
    Assumption("engine", "_exec_reduce_grads", "DP gradient all-reduce (bf16/ZeRO aware)"),
    Assumption("engine", "_exec_optimizer_step", "DeepSpeed's step: clipping, optimizer, LR scheduler, counters"),
    Assumption("engine", "_aggregate_total_loss", "train_batch's mean loss of the batch, broadcast from the loss "
               "stage to every stage (Ouroboros computes its loss on stage 0 and overrides it)"),
    Assumption("engine", "_next_batch", "next (inputs, labels) pair from the engine's data iterator"),
    Assumption("engine", "reset_activation_shape", "forces the next p2p send to re-announce tensor metadata"),
    Assumption("engine", "clip_fp32_gradients", "fp32 path of _take_model_step clips through this method"),
    Assumption("module", "_recursive_getattr", "resolves a dotted attribute path on a module"),
    Assumption("module", "_set_bounds", "_set_bounds(start, stop) makes layers [start, stop) local"),
    Assumption("engine", "_inference_schedule", "eval_batch builds its PipeSchedule through this hook (interleaved "
               "swaps in its forward-only ring order)"),
    Assumption("module", "_precompute_checkpointable_values", "fills is_checkpointable_results (one flag per "
               "activation-checkpoint segment of forward_funcs) unless is_checkpointable_results_interval is current"),
    Assumption("ops", "__compatible_ops__", "dict op name -> bool; False skips the op's JIT build"),
    Assumption("bf16", "clear_lp_grads", "BF16_Optimizer: drops the bf16 .grad of every parameter"),
    Assumption("bf16", "update_hp_grads", "BF16_Optimizer: adds the bf16 .grad into the fp32 gradient buffers"),
    Assumption("bf16", "accumulate_hp_grads_and_remove_lp", "BF16_Optimizer (immediate_grad_update): moves one "
               "parameter's bf16 gradient into its fp32 buffer"),
    Assumption("zero", "get_gradient_for_reduction", "ZeRO-1/2: a parameter's gradient before the DP reduction"),
    Assumption("p2p", "send", "the engine's send handlers send every message blocking through p2p.send(tensor, "
               "stage), the shape announcement first: activation_messages/grad_messages list the same messages"),
    Assumption("engine", "_send_tensor_meta", "announces a send's type, dtypes and shapes in one int32 buffer of "
               "TENSOR_META_SIZE ([0, dtype, ndim, *shape] or [2, n, (dtype, ndim, *shape)...]): _tensor_meta "
               "builds the same"),
    Assumption("engine", "DTYPE_TO_ID", "dtype -> the id _send_tensor_meta announces"),
)

# Instance attributes, set in PipelineEngine.__init__ (checked on a live engine).
ENGINE_ATTRIBUTES: tuple[Assumption, ...] = (
    Assumption("engine", "_global_grad_norm", "the value get_global_grad_norm() returns"),
    Assumption("engine", "pipe_buffers", "dict 'inputs'/'labels'/'outputs' -> list of per-buffer slots"),
    Assumption("engine", "is_pipe_partitioned", "p2p sends 1/TP of an activation and all-gathers it"),
    Assumption("engine", "using_bf16_optimizer", "True when the optimizer is DeepSpeed's BF16_Optimizer, whose "
               "update_hp_grads() copies bf16 .grad into its fp32 gradient buffers (a no-op with "
               "immediate_grad_update, where accumulate_hp_grads_and_remove_lp(p, group, index) moves one)"),
    Assumption("engine", "is_grad_partitioned", "p2p sends 1/TP of a gradient and all-gathers it"),
    Assumption("engine", "pipe_partition_input_meta_cache", "shape cache of partitioned activations"),
    Assumption("engine", "pipe_partition_output_meta_cache", "shape cache of partitioned outputs"),
    Assumption("engine", "pipe_partition_grad_meta_cache", "shape cache of partitioned gradients"),
    Assumption("engine", "grad_partition_grad_layer_meta_cache", "shape cache of partitioned grad layers"),
    Assumption("engine", "data_iterator", "the iterator _next_batch reads (set by set_dataiterator on the first "
               "and last stage); ds_mp reads a step's micro-batches from it first (engine/batches.py)"),
    Assumption("engine", "batch_fn", "set_batch_fn's post-processing of each micro-batch, or None"),
    Assumption("engine", "first_output_send", "True until the first activation send announced its shape"),
    Assumption("engine", "dynamic_shape", "every activation send announces its shape"),
    Assumption("engine", "has_attention_mask", "the last output/input is a bool mask sent as half, no gradient"),
    Assumption("engine", "has_bool_tensors", "as has_attention_mask"),
    Assumption("engine", "grid", "the PipelineParallelGrid: stage_to_global(stage_id=) gives a stage's rank"),
    Assumption("engine", "torch_autocast_z0_gradscaler", "torch autocast's grad scaler or None; with it, "
               "DeepSpeedEngine.backward scales the loss itself (read by unapplied_loss_scale)"),
    Assumption("engine", "grad_layer", "the gradient the last RecvGrad wrote, what BackwardPass backpropagates "
               "on a non-last stage (one buffer, overwritten by every RecvGrad)"),
    Assumption("engine", "agg_train_loss", "train_batch's reported loss"),
    Assumption("engine", "total_loss", "the last stage's sum of its micro-batch losses of the step (grid.grad_group_loss)"),
    Assumption("engine", "prev_stage", "the stage RecvActivation/SendGrad exchange with"),
    Assumption("engine", "next_stage", "the stage SendActivation/RecvGrad exchange with"),
    Assumption("module", "parts", "the first layer of every stage and the end (stages + 1 entries)"),
    Assumption("module", "tied_modules", "key -> the tied layer this stage holds"),
    Assumption("module", "activation_checkpoint_func", "forward() checkpoints its segments with it"),
    Assumption("module", "tied_comms", "key -> {'module', 'weight_attr', 'group', 'ranks'} of each tied weight"),
    Assumption("module", "_grid", "the PipelineParallelGrid the module created (process groups)"),
    Assumption("module", "_topo", "the ProcessTopology the module was built with"),
    Assumption("module", "forward_funcs", "the local layers forward() runs, in order (interleaved: one chunk's)"),
    Assumption("module", "is_checkpointable_results", "forward() zips these flags with its checkpoint segments"),
    Assumption("module", "is_checkpointable_results_interval", "the interval the flags were computed for"),
)


def _owners() -> dict[str, Any]:
    import deepspeed.ops
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    from deepspeed.runtime.pipe import p2p

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return {"engine": PipelineEngine, "module": PipelineModule, "ops": deepspeed.ops, "p2p": p2p,
            "bf16": BF16_Optimizer, "zero": DeepSpeedZeroOptimizer}


def _fail(a: Assumption, where: str) -> DeepSpeedIncompatible:
    import deepspeed

    return DeepSpeedIncompatible(f"DeepSpeed {deepspeed.__version__}: {where} has no '{a.name}'; ds_mp relies on it "
                                 f"({a.behaviour}); install deepspeed>=0.19,<0.20")


def overridden_private_names(adapter: type, base: type, owner: str) -> list[str]:
    """The private names ``adapter`` (a subclass of DeepSpeed's ``base``) overrides, read off the
    class, not listed by hand; raise :class:`DeepSpeedIncompatible` naming the first one ``base``
    no longer defines (an override of a renamed hook would be silent dead code)."""
    names = [n for n in vars(adapter) if n.startswith("_") and not n.startswith("__")]
    for name in names:
        if not hasattr(base, name):
            raise _fail(Assumption(owner, name, f"{adapter.__name__} overrides it"), base.__name__)
    return names


def check(owners: dict[str, Any] | None = None) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first missing class-level assumption."""
    owners = owners or _owners()
    for a in ASSUMPTIONS:
        if not hasattr(owners[a.owner], a.name):
            raise _fail(a, getattr(owners[a.owner], "__name__", a.owner))
    import inspect

    from deepspeed.runtime.utils import OutputBackwardHookManager

    if HOOK_MANAGERS_ATTR not in inspect.getsource(OutputBackwardHookManager):
        raise _fail(Assumption("utils", HOOK_MANAGERS_ATTR, "the tensor attribute OutputBackwardHookManager keeps "
                               "its managers in (ZB-H1 removes them after B)"), "OutputBackwardHookManager")


def check_engine(engine: PipelineEngine) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first missing instance attribute."""
    for a in ENGINE_ATTRIBUTES:
        target = engine if a.owner == "engine" else engine.module
        if not hasattr(target, a.name):
            raise _fail(a, type(target).__name__)


# --- the accessors ds_mp uses ---------------------------------------------------------------
def uses_bf16_optimizer(engine: PipelineEngine) -> bool:
    """DeepSpeed's ``BF16_Optimizer`` (bf16 with ZeRO 0) keeps fp32 master weights and gradients;
    gradients set on the bf16 parameters reach them only through ``update_hp_grads``."""
    return bool(getattr(engine, "using_bf16_optimizer", False))


def unapplied_loss_scale(engine: PipelineEngine) -> float | None:
    """The fp16 loss scale that ``DeepSpeedEngine.backward`` leaves out, or None.

    DeepSpeed 0.19's ``backward`` scales the loss only for a ``ZeROOptimizer`` (or torch
    autocast's scaler), yet its non-ZeRO fp16 optimizers (``FP16_Optimizer``,
    ``FP16_UnfusedOptimizer``) divide the gradients by ``loss_scale_config.cur_scale`` in
    ``step``: without ZeRO, fp16 gradients reach the update divided by the scale (2^16 by
    default) and the overflow check never sees a scaled gradient.  Measured on a CPU with
    fp16 (oneDNN): a plain ``deepspeed.initialize`` model's fp16 gradients equal the
    unscaled fp32 ones after ``engine.backward``.  The caller multiplies the loss by this."""
    if not engine.fp16_enabled() or engine.torch_autocast_z0_gradscaler is not None:
        return None
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    opt = engine.optimizer
    if isinstance(opt, ZeROOptimizer) or not hasattr(opt, "loss_scale_config"):
        return None
    return float(opt.loss_scale_config.cur_scale)


def set_global_grad_norm(engine: PipelineEngine, norm: float) -> None:
    """What DeepSpeed's public ``get_global_grad_norm()`` returns (its fp32 path leaves it None
    when ds_mp computes the norm)."""
    engine._global_grad_norm = norm


def copy_bf16_grads_to_master(engine: PipelineEngine) -> None:
    """BF16_Optimizer: add the bf16 ``.grad`` of every parameter into its fp32 master gradient.

    With ``"bf16": {"immediate_grad_update": true}`` DeepSpeed's ``update_hp_grads()`` returns at
    once: there hooks on autograd's gradient accumulation move each gradient into its master (and
    drop the bf16 one) as a backward produces it, and a gradient set on ``.grad`` by hand (ZB-H1's
    W pass) never reaches them.  Such gradients go through the hooks' own per-parameter move
    (``accumulate_hp_grads_and_remove_lp``), which leaves ``.grad`` None as the hooks do."""
    opt = engine.optimizer
    if not opt.immediate_grad_update:
        opt.update_hp_grads(clear_lp_grads=False)
        return
    for i, group in enumerate(opt.bf16_groups):
        for j, lp in enumerate(group):
            if lp.grad is not None:
                opt.accumulate_hp_grads_and_remove_lp(lp, i, j)


def output_hook_managers(tensor: Any) -> list:
    """The ``OutputBackwardHookManager``s DeepSpeed 0.19's engine forward attaches to an output
    tensor (``_backward_hook_managers``: hooks that scale its gradient by 1/gradient accumulation
    unless the running graph task is the engine's own backward); [] when it has none.  The name is
    checked where DeepSpeed sets it (:func:`check`: ``OutputBackwardHookManager``'s source), so a
    rename fails there instead of leaving the hooks in place (which halves a TP × PP gradient)."""
    return list(getattr(tensor, HOOK_MANAGERS_ATTR, []))


#: The tensor attribute DeepSpeed's ``OutputBackwardHookManager`` appends itself to.
HOOK_MANAGERS_ATTR = "_backward_hook_managers"


def reserve_pipe_buffers(engine: PipelineEngine, n: int) -> None:
    engine._reserve_pipe_buffers(n)


def reset_forward_outputs(engine: PipelineEngine) -> None:
    """The list ``_exec_forward_pass`` appends each forward's output to, emptied per schedule."""
    engine.fwd_outputs = []


def computing_loss(engine: PipelineEngine) -> bool:
    """True inside train_batch / eval_batch(compute_loss=True): the last stage computes a loss."""
    return bool(engine._compute_loss)


def tied_weights(module: Any) -> list[tuple[str, Any, Any, list[int]]]:
    """``(key, weight, group, ranks)`` of every tied weight a PipelineModule holds on this stage."""
    return [(key, module._recursive_getattr(module.tied_modules[key], attr), comm["group"], comm["ranks"])
            for key, comm in module.tied_comms.items() for attr in comm["weight_attr"]]


def checkpointable_flags(module: Any, funcs: list) -> list[bool]:
    """DeepSpeed's per-segment "is checkpointable" flags of the local layers ``funcs`` (a subset of
    ``module.forward_funcs``: one interleaved chunk); the module's own flags and their cache
    interval are left as they were (DeepSpeed's DualPipeV module recomputes them per phase)."""
    whole, interval, every = module.is_checkpointable_results, module.is_checkpointable_results_interval, \
        module.forward_funcs
    module.forward_funcs, module.is_checkpointable_results_interval = funcs, None
    try:
        module._precompute_checkpointable_values()
        return module.is_checkpointable_results
    finally:
        module.forward_funcs, module.is_checkpointable_results = every, whole
        module.is_checkpointable_results_interval = interval


@contextlib.contextmanager
def inference_schedule(engine: PipelineEngine, build: Any) -> Iterator[None]:
    """Within the body ``eval_batch`` builds its schedule as ``build(micro_batches)``."""
    engine._inference_schedule = build
    try:
        yield
    finally:
        del engine._inference_schedule


def layer_spec_arguments(module: Any) -> list:
    """The constructor arguments (positional and keyword) of every layer spec the ``PipelineModule``
    keeps for all stages in its instance attribute ``_layer_specs`` ([] where a DeepSpeed has none)."""
    return [a for spec in getattr(module, "_layer_specs", [])
            for a in (*getattr(spec, "module_args", ()), *getattr(spec, "module_kwargs", {}).values())]


@contextlib.contextmanager
def instruction_handlers(engine: PipelineEngine, wrap: Any) -> Iterator[None]:
    """Within the body ``engine`` dispatches every pipeline instruction to ``wrap(handler)``: the
    class's ``_INSTRUCTION_MAP`` shadowed on the instance, removed again on exit."""
    engine._INSTRUCTION_MAP = {k: wrap(v) for k, v in type(engine)._INSTRUCTION_MAP.items()}
    try:
        yield
    finally:
        del engine._INSTRUCTION_MAP


def next_batch(engine: PipelineEngine) -> Any:
    return engine._next_batch()


def pipe_buffers(engine: PipelineEngine) -> dict:
    return engine.pipe_buffers


def forget_partitioned_shapes(engine: PipelineEngine) -> None:
    """With TP > 1 DeepSpeed sends activations/gradients partitioned over TP and caches each
    partition's shape once; uneven token slices change shape, so forget the caches."""
    engine.pipe_partition_input_meta_cache = engine.pipe_partition_output_meta_cache = None
    engine.pipe_partition_grad_meta_cache = engine.grad_partition_grad_layer_meta_cache = None


def send_whole_activations(engine: PipelineEngine) -> None:
    """Turn off DeepSpeed's TP-partitioned p2p (it assumes activations equal on all TP ranks;
    sequence-parallel shards differ)."""
    engine.is_pipe_partitioned = engine.is_grad_partitioned = False
