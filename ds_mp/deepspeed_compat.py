"""Every use of a private DeepSpeed name, each with the DeepSpeed behaviour it relies on.

ds_mp subclasses DeepSpeed's ``PipelineEngine`` and ``PipelineModule``.  Every private
attribute it *reads, writes or calls* goes through an accessor below.  The subclass hooks it
*overrides* must keep DeepSpeed's names (``_exec_*``, ``_train_schedule``,
``_aggregate_total_loss`` in ``engine/pipeline_engine.py``; ``_build``,
``_partition_layers``, ``_synchronize_tied_weights`` in ``models/gpt2.py``); they are listed
in :data:`ASSUMPTIONS` too, so a DeepSpeed without them fails :func:`check`.  :func:`check` verifies every assumption
against the installed DeepSpeed and fails with a message that names the broken one; it
runs when an engine is built, so an incompatible DeepSpeed fails there, not mid-step.

Measured against DeepSpeed 0.19.x (``pyproject.toml`` pins ``<0.20``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator


class DeepSpeedIncompatible(RuntimeError):
    """The installed DeepSpeed lacks a private name ds_mp relies on."""


@dataclass(frozen=True)
class Assumption:
    owner: str  # "engine" (PipelineEngine), "module" (PipelineModule) or "ops" (deepspeed.ops)
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
    Assumption("module", "_build", "PipelineModule builds its local layers here (after creating _grid)"),
    Assumption("module", "_partition_layers", "sets self.parts and the local layer bounds"),
    Assumption("module", "_synchronize_tied_weights", "called once when the module is built to make tied "
               "copies equal; ds_mp replaces it (checksum, broadcast only on a mismatch)"),
    Assumption("module", "_recursive_getattr", "resolves a dotted attribute path on a module"),
    Assumption("module", "_set_bounds", "_set_bounds(start, stop) makes layers [start, stop) local"),
    Assumption("ops", "__compatible_ops__", "dict op name -> bool; False skips the op's JIT build"),
)

# Instance attributes, set in PipelineEngine.__init__ (checked on a live engine).
ENGINE_ATTRIBUTES: tuple[Assumption, ...] = (
    Assumption("engine", "_global_grad_norm", "the value get_global_grad_norm() returns"),
    Assumption("engine", "pipe_buffers", "dict 'inputs'/'labels'/'outputs' -> list of per-buffer slots"),
    Assumption("engine", "is_pipe_partitioned", "p2p sends 1/TP of an activation and all-gathers it"),
    Assumption("engine", "using_bf16_optimizer", "True when the optimizer is DeepSpeed's BF16_Optimizer, whose "
               "update_hp_grads() copies bf16 .grad into its fp32 gradient buffers"),
    Assumption("engine", "is_grad_partitioned", "p2p sends 1/TP of a gradient and all-gathers it"),
    Assumption("engine", "pipe_partition_input_meta_cache", "shape cache of partitioned activations"),
    Assumption("engine", "pipe_partition_output_meta_cache", "shape cache of partitioned outputs"),
    Assumption("engine", "pipe_partition_grad_meta_cache", "shape cache of partitioned gradients"),
    Assumption("engine", "grad_partition_grad_layer_meta_cache", "shape cache of partitioned grad layers"),
    Assumption("engine", "torch_autocast_z0_gradscaler", "torch autocast's grad scaler or None; with it, "
               "DeepSpeedEngine.backward scales the loss itself (read by unapplied_loss_scale)"),
    Assumption("module", "tied_comms", "key -> {'module', 'weight_attr', 'group', 'ranks'} of each tied weight"),
    Assumption("module", "_grid", "the PipelineParallelGrid the module created (process groups)"),
    Assumption("module", "_topo", "the ProcessTopology the module was built with"),
)


def _owners() -> dict[str, Any]:
    import deepspeed.ops
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    return {"engine": PipelineEngine, "module": PipelineModule, "ops": deepspeed.ops}


def _fail(a: Assumption, where: str) -> DeepSpeedIncompatible:
    import deepspeed

    return DeepSpeedIncompatible(f"DeepSpeed {deepspeed.__version__}: {where} has no '{a.name}'; ds_mp relies on it "
                                 f"({a.behaviour}); install deepspeed>=0.19,<0.20")


def check(owners: dict[str, Any] | None = None) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first missing class-level assumption."""
    owners = owners or _owners()
    for a in ASSUMPTIONS:
        if not hasattr(owners[a.owner], a.name):
            raise _fail(a, getattr(owners[a.owner], "__name__", a.owner))


def check_engine(engine: Any) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first missing instance attribute."""
    for a in ENGINE_ATTRIBUTES:
        target = engine if a.owner == "engine" else engine.module
        if not hasattr(target, a.name):
            raise _fail(a, type(target).__name__)


# --- the accessors ds_mp uses ---------------------------------------------------------------
def skip_op_build(name: str) -> None:
    """Mark a DeepSpeed op incompatible so DeepSpeed never JIT-builds it (``__compatible_ops__``)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


def uses_bf16_optimizer(engine: Any) -> bool:
    """DeepSpeed's ``BF16_Optimizer`` (bf16 with ZeRO 0) keeps fp32 master weights and gradients;
    gradients set on the bf16 parameters reach them only through ``update_hp_grads``."""
    return bool(getattr(engine, "using_bf16_optimizer", False))


def unapplied_loss_scale(engine: Any) -> float | None:
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


def set_global_grad_norm(engine: Any, norm: float) -> None:
    """What DeepSpeed's public ``get_global_grad_norm()`` returns (its fp32 path leaves it None
    when ds_mp computes the norm)."""
    engine._global_grad_norm = norm


def copy_bf16_grads_to_master(engine: Any) -> None:
    """BF16_Optimizer: add the bf16 ``.grad`` of every parameter into its fp32 master gradient."""
    engine.optimizer.update_hp_grads(clear_lp_grads=False)


def flat_group_params(optimizer: Any) -> list[list[Any]]:
    """BF16_Optimizer: the model parameters of each parameter group, in the order of its flat
    fp32 partitions (``bf16_groups``: the groups passed to DeepSpeed, trainable ones only)."""
    return [list(g) for g in optimizer.bf16_groups]


@contextlib.contextmanager
def skipping_flat_groups(optimizer: Any, indices: list[int]) -> Iterator[None]:
    """Within the body, the wrapped torch optimizer's ``step`` skips the flat partitions of the
    groups ``indices``: BF16_Optimizer.step sets each partition's ``.grad`` just before calling
    it, and a torch optimizer leaves a parameter whose ``.grad`` is None untouched (no update,
    no weight decay, no state or step count created)."""
    if not indices:
        yield
        return
    flats = flat_partitions(optimizer)

    def drop_grads(*_: Any) -> None:
        for i in indices:
            flats[i].grad = None

    handle = optimizer.optimizer.register_step_pre_hook(drop_grads)
    try:
        yield
    finally:
        handle.remove()


def master_grad(param: Any) -> Any:
    """BF16_Optimizer: ``param``'s fp32 gradient buffer (``_hp_grad``, its shape), which the bf16
    gradients are accumulated into and DeepSpeed's reductions act on (None for a parameter it
    keeps no master for: a frozen one)."""
    return getattr(param, "_hp_grad", None)


def output_hook_managers(tensor: Any) -> list:
    """The ``OutputBackwardHookManager``s DeepSpeed 0.19's engine forward attaches to an output
    tensor (``_backward_hook_managers``: hooks that scale its gradient by 1/gradient accumulation
    unless the running graph task is the engine's own backward); [] when it has none."""
    return list(getattr(tensor, "_backward_hook_managers", []))


def reserve_pipe_buffers(engine: Any, n: int) -> None:
    engine._reserve_pipe_buffers(n)


def reset_forward_outputs(engine: Any) -> None:
    """The list ``_exec_forward_pass`` appends each forward's output to, emptied per schedule."""
    engine.fwd_outputs = []


def computing_loss(engine: Any) -> bool:
    """True inside train_batch / eval_batch(compute_loss=True): the last stage computes a loss."""
    return bool(engine._compute_loss)


def tied_weights(module: Any) -> list[tuple[str, Any, Any, list[int]]]:
    """``(key, weight, group, ranks)`` of every tied weight a PipelineModule holds on this stage."""
    return [(key, module._recursive_getattr(module.tied_modules[key], attr), comm["group"], comm["ranks"])
            for key, comm in module.tied_comms.items() for attr in comm["weight_attr"]]


def set_local_layers(module: Any, start: int, stop: int) -> None:
    """Make layers ``[start, stop)`` of the PipelineModule's spec list the ones this stage builds."""
    module._set_bounds(start=start, stop=stop)


def next_batch(engine: Any) -> Any:
    return engine._next_batch()


def pipe_buffers(engine: Any) -> dict:
    return engine.pipe_buffers


def forget_partitioned_shapes(engine: Any) -> None:
    """With TP > 1 DeepSpeed sends activations/gradients partitioned over TP and caches each
    partition's shape once; uneven token slices change shape, so forget the caches."""
    engine.pipe_partition_input_meta_cache = engine.pipe_partition_output_meta_cache = None
    engine.pipe_partition_grad_meta_cache = engine.grad_partition_grad_layer_meta_cache = None


def send_whole_activations(engine: Any) -> None:
    """Turn off DeepSpeed's TP-partitioned p2p (it assumes activations equal on all TP ranks;
    sequence-parallel shards differ)."""
    engine.is_pipe_partitioned = engine.is_grad_partitioned = False


def module_grid(module: Any) -> Any:
    return module._grid


def module_topology(module: Any) -> Any:
    return module._topo


__all__ = ["ASSUMPTIONS", "ENGINE_ATTRIBUTES", "Assumption", "DeepSpeedIncompatible", "check", "check_engine",
           "skip_op_build", "set_global_grad_norm", "uses_bf16_optimizer", "copy_bf16_grads_to_master",
           "flat_group_params", "skipping_flat_groups",
           "reserve_pipe_buffers", "reset_forward_outputs", "computing_loss", "tied_weights", "set_local_layers", "next_batch", "pipe_buffers", "forget_partitioned_shapes", "send_whole_activations",
           "module_grid", "module_topology"]


# --- fp32 master weights and optimizer state of DeepSpeed's flat-buffer optimizers -----------
# bf16 (``BF16_Optimizer``) and ZeRO 1/2 (``DeepSpeedZeroOptimizer``) keep, per parameter group,
# one flat fp32 partition per DP rank (the wrapped torch optimizer's only parameter) and link
# every model parameter to its fragment of it: ``p._hp_mapping`` (None when the fragment lies
# in another DP rank's partition) with ``lp_fragment_address`` / ``hp_fragment_address``
# (start, numel in the flattened parameter / in the partition) and ``param_group_index``, and
# ``p._dp_group``.  DeepSpeed's public ``safe_get_full_optimizer_state`` needs the optimizer
# state already created and linked (after a first step); these work before it too.
FLAT_PARTITIONS = ("fp32_groups_flat_partition", "single_partition_of_fp32_groups")


def flat_partitions(optimizer: Any) -> list:
    """The flat fp32 master partitions of a bf16/ZeRO optimizer, one per parameter group."""
    for attr in FLAT_PARTITIONS:
        if hasattr(optimizer, attr):
            return getattr(optimizer, attr)
    raise DeepSpeedIncompatible(f"{type(optimizer).__name__} has none of {FLAT_PARTITIONS}: ds_mp cannot read its "
                                "fp32 master weights; install a DeepSpeed 0.19.x")


def full_flat_state(param: Any, optimizer: Any, key: str) -> Any:
    """Collective over ``param``'s DP group: the optimizer state ``key`` of ``param`` (its
    shape, fp32) assembled from every DP rank's partition (zeros where no rank holds one)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)  # NCCL: device tensors only
    m = param._hp_mapping
    if m is not None:
        state = optimizer.optimizer.state.get(flat_partitions(optimizer)[m.param_group_index], {})
        if key in state:
            lp, hp = m.lp_fragment_address, m.hp_fragment_address
            buf.narrow(0, lp.start, lp.numel).copy_(state[key].narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, group=param._dp_group)
    return buf.view(param.shape)


def set_flat_state(param: Any, optimizer: Any, key: str, value: Any) -> None:
    """Write ``value`` (``param``'s shape) into this DP rank's fragment of the optimizer state
    ``key``, creating the state (zeros) if the optimizer has not stepped yet."""
    import torch

    m = param._hp_mapping
    if m is None:
        return
    flat = flat_partitions(optimizer)[m.param_group_index]
    state = optimizer.optimizer.state[flat]
    if key not in state:
        state[key] = torch.zeros_like(flat)
    lp, hp = m.lp_fragment_address, m.hp_fragment_address
    state[key].narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))


LP_GROUPS = ("bf16_groups", "bit16_groups")  # BF16_Optimizer, DeepSpeedZeroOptimizer: model params per group


def _group_index(param: Any, optimizer: Any) -> int:
    """Index of the parameter group holding ``param`` (also on a DP rank whose partition holds
    no fragment of it, where ``_hp_mapping`` is None)."""
    m = getattr(param, "_hp_mapping", None)
    if m is not None:
        return m.param_group_index
    for attr in LP_GROUPS:
        for i, group in enumerate(getattr(optimizer, attr, ())):
            if any(q is param for q in group):
                return i
    raise DeepSpeedIncompatible(f"{type(optimizer).__name__}: no parameter group holds the parameter "
                                f"(looked in {LP_GROUPS}); install a DeepSpeed 0.19.x")


def _group_state(param: Any, optimizer: Any) -> tuple[Any, dict]:
    flat = flat_partitions(optimizer)[_group_index(param, optimizer)]
    return flat, optimizer.optimizer.state.get(flat, {})


def flat_state_extras(param: Any, optimizer: Any) -> dict:
    """State entries of ``param``'s group partition that are not per-element (Adam's ``step``;
    each group counts its own steps, equal on every DP rank)."""
    flat, state = _group_state(param, optimizer)
    return {k: v.clone() if hasattr(v, "clone") else v for k, v in state.items()
            if not (hasattr(v, "shape") and v.shape == flat.shape)}


def flat_state_keys(param: Any, optimizer: Any) -> list[str]:
    """Per-element state keys of ``param``'s partition (``exp_avg``...; [] before its first step)."""
    flat, state = _group_state(param, optimizer)
    return sorted(k for k, v in state.items() if hasattr(v, "shape") and v.shape == flat.shape)


def set_flat_state_extras(param: Any, optimizer: Any, extras: dict) -> None:
    """Put non-per-element entries (``step``) into the state of ``param``'s group partition."""
    if not extras:
        return
    flat = flat_partitions(optimizer)[_group_index(param, optimizer)]
    state = optimizer.optimizer.state[flat]
    for k, v in extras.items():
        state[k] = v.clone() if hasattr(v, "clone") else v


# --- ZeRO-2 (gradient partitioning) in the pipeline engine: see ds_mp/engine/zero2.py ---------
# ``PipelineEngine.__init__`` asserts ``zero_optimization_stage() < 2`` right after
# ``DeepSpeedEngine.__init__`` has built the stage-2 optimizer; ds_mp drives stage 2's gradient
# reduction from the pipeline's own instructions (engine/zero2.py), so the stage is reported
# as 1 to that one assert (the only read of the stage in PipelineEngine.__init__).
ZERO2_ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption("pipe_init", "zero_optimization_stage(", "PipelineEngine.__init__ reads the ZeRO stage once, in its "
               "assert stage < 2, after DeepSpeedEngine.__init__ built the optimizer"),
    Assumption("zero", "overlapping_partition_gradients_reduce_epilogue", "stage 2: reduces the last bucket of "
               "one backward, adds its partition gradients to the step's accumulators (all_grad_tensors) and "
               "clears params_already_reduced; builds averaged_gradients only at a boundary"),
    Assumption("zero", "finalize_gradient_accumulation_boundary", "unmanaged accumulation's boundary: "
               "averaged_gradients from the accumulators of the step's epilogues, no reduction"),
    Assumption("zero", "set_gradient_accumulation_boundary", "the boundary flag the epilogue reads"),
    Assumption("zero_instance", "averaged_gradients", "group index -> this DP rank's partition gradients "
               "(list of tensors) once the step's boundary is finalized"),
)


def check_zero2(engine: Any = None) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first broken ZeRO-2 assumption."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for a in ZERO2_ASSUMPTIONS:
        if a.owner == "pipe_init":
            ok = inspect.getsource(PipelineEngine.__init__).count(a.name) == 1
        elif a.owner == "zero":
            ok = hasattr(DeepSpeedZeroOptimizer, a.name)
        else:
            ok = engine is None or hasattr(engine.optimizer, a.name)
        if not ok:
            raise _fail(a, "PipelineEngine.__init__" if a.owner == "pipe_init" else "DeepSpeedZeroOptimizer")


def zero_stage_for(stage: int, caller: Any) -> int:
    """The ZeRO stage the engine reports to the code object of frame ``caller``: 1 instead of 2
    to ``PipelineEngine.__init__`` (its assert), the real stage to everything else."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if stage == 2 and caller.f_code is PipelineEngine.__init__.__code__:
        return 1
    return stage


def zero2_close_backward(optimizer: Any) -> None:
    """Stage 2, after one backward call: its gradients reduced over DP and accumulated into the
    step's partition accumulators (boundary off, so nothing is finalized yet)."""
    optimizer.set_gradient_accumulation_boundary(False)
    optimizer.overlapping_partition_gradients_reduce_epilogue()


def zero2_close_step(optimizer: Any) -> None:
    """Stage 2, once per step after every backward: the accumulators become the partition
    gradients the optimizer's step reads (``averaged_gradients``)."""
    optimizer.finalize_gradient_accumulation_boundary()


def zero2_partition_grads(optimizer: Any) -> list:
    """This DP rank's partition gradients of the step, every group (after zero2_close_step)."""
    return [t for group in optimizer.averaged_gradients.values() if group is not None for t in group]


def zero2_full_grad(param: Any) -> Any:
    """Collective over ``param``'s DP group: its full fp32 gradient assembled from the DP
    partitions (DeepSpeed's public ``safe_get_full_grad``: each rank adds its fragment)."""
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def zero2_set_full_grad(param: Any, value: Any) -> None:
    """Write this DP rank's fragment of ``value`` (``param``'s full gradient) into its partition."""
    from deepspeed.utils import safe_set_full_grad

    safe_set_full_grad(param, value)


# --- fp16 without ZeRO: FP16_Optimizer (fused) / FP16_UnfusedOptimizer --------------------------
# Neither has a high-precision mapping (``_hp_mapping``): the fused one keeps per group one flat
# fp32 copy (``fp32_groups_flat[i]``, the parameters of ``fp16_groups[i]`` back to back), the
# unfused one an fp32 copy per parameter (``fp32_groups[i][j]``).  Both are replicated over DP
# (no partitions), and the wrapped torch optimizer's state is keyed by those fp32 tensors.
def fp16_slot(param: Any, optimizer: Any) -> tuple[Any, int] | None:
    """``(fp32 tensor the torch optimizer steps, offset of param in it)`` for a non-ZeRO fp16
    optimizer, None for any other optimizer (or a parameter it does not hold)."""
    groups = getattr(optimizer, "fp16_groups", None)
    if groups is None or hasattr(param, "_hp_mapping"):
        return None
    for i, group in enumerate(groups):
        offset = 0
        for j, q in enumerate(group):
            if q is param:
                if hasattr(optimizer, "fp32_groups_flat"):
                    return optimizer.fp32_groups_flat[i], offset
                return optimizer.fp32_groups[i][j], 0
            offset += q.numel()
    return None


def slot_view(holder: Any, offset: int, param: Any) -> Any:
    """``param``'s part of ``holder`` (a flat fp32 group or a per-parameter fp32 copy), shaped
    like ``param`` (a view: writing it writes the holder)."""
    return holder.view(-1).narrow(0, offset, param.numel()).view(param.shape)


# --- the dynamic loss scaler's state (fp16) ----------------------------------------------------
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _scaler(optimizer: Any) -> Any:
    """ZeRO's ``loss_scaler`` or the non-ZeRO fp16 optimizers' ``loss_scale_config``."""
    for attr in ("loss_scaler", "loss_scale_config"):
        obj = getattr(optimizer, attr, None)
        if obj is not None and hasattr(obj, "cur_scale"):
            return obj
    return None


def loss_scaler_state(optimizer: Any) -> dict | None:
    """The loss scaler's counters (scale, iteration, last overflow, hysteresis) or None."""
    obj = _scaler(optimizer)
    if obj is None:
        return None
    return {k: (float(v) if k == "cur_scale" else int(v)) for k in SCALER_FIELDS
            if (v := getattr(obj, k, None)) is not None}


def set_loss_scaler_state(optimizer: Any, state: dict) -> None:
    obj = _scaler(optimizer)
    if obj is not None:
        for k, v in state.items():
            setattr(obj, k, v)


def master_weights(module: Any, optimizer: Any) -> dict[int, Any]:
    """id(parameter) -> its fp32 master weight (full shape) for every trainable parameter of
    ``module`` whose optimizer wrapper keeps one (bf16, fp16, ZeRO); {} for a plain torch
    optimizer.  Collective over each parameter's DP group for the flat-partition wrappers
    (bf16 / ZeRO): every DP rank calls it."""
    import torch

    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for p in module.parameters():
        if not p.requires_grad:
            continue
        slot = fp16_slot(p, optimizer)
        full = slot_view(*slot, p) if slot is not None else safe_get_full_fp32_param(p)
        if full is not None:
            out[id(p)] = full
    return out


# --- layer-wise optimizers (ds_mp's Lamb) on bf16 / ZeRO flat partitions: engine/layerwise.py ---
FLAT_LP_GROUPS = ("bf16_groups", "bit16_groups")  # BF16_Optimizer, DeepSpeedZeroOptimizer


def flat_fragments(optimizer: Any) -> list[list[tuple[Any, tuple[int, int] | None]]]:
    """Per parameter group of a bf16/ZeRO optimizer, every trainable model parameter with the
    ``(start, numel)`` of its fragment in this DP rank's flat fp32 partition of the group
    (``_hp_mapping.hp_fragment_address``), or None where the partition holds none of it.  The
    parameters come in the group's order (``bf16_groups`` / ``bit16_groups``), the same on every
    DP rank; group ``g`` is the wrapped torch optimizer's ``param_groups[g]``."""
    for attr in FLAT_LP_GROUPS:
        if hasattr(optimizer, attr):
            out = []
            for group in getattr(optimizer, attr):
                rows = []
                for q in group:
                    m = getattr(q, "_hp_mapping", None)
                    rows.append((q, None if m is None else (m.hp_fragment_address.start, m.hp_fragment_address.numel)))
                out.append(rows)
            return out
    raise DeepSpeedIncompatible(f"{type(optimizer).__name__} has none of {FLAT_LP_GROUPS}: ds_mp cannot map its flat "
                                "partitions to model parameters; install a DeepSpeed 0.19.x")
