"""Private state of DeepSpeed's optimizer wrappers: the flat fp32 partitions of BF16_Optimizer and
ZeRO 1/2, ZeRO-2's gradient partitions driven from the pipeline, fp16's fp32 copies and loss
scaler, and the fragments layer-wise optimizers read."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from ds_mp.deepspeed_compat.pipeline import Assumption, DeepSpeedIncompatible, _fail

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine


# --- fp32 master weights and optimizer state of DeepSpeed's flat-buffer optimizers -----------
# bf16 (``BF16_Optimizer``) and ZeRO 1/2 (``DeepSpeedZeroOptimizer``) keep, per parameter group,
# one flat fp32 partition per DP rank (the wrapped torch optimizer's only parameter) and link
# every model parameter to its fragment of it: ``p._hp_mapping`` (None when the fragment lies
# in another DP rank's partition) with ``lp_fragment_address`` / ``hp_fragment_address``
# (start, numel in the flattened parameter / in the partition) and ``param_group_index``, and
# ``p._dp_group`` (the group the optimizer partitions over: ``engine.seq_data_parallel_group``,
# on ds_mp's grid the grad group dp × cp, ``ds_mp.deepspeed_compat.grid``).  DeepSpeed's public
# ``safe_get_full_optimizer_state`` needs the optimizer state already created and linked (after a
# first step); these work before it too.
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


# --- BF16_Optimizer's groups and master gradients ----------------------------------------
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


# --- ZeRO-2 (gradient partitioning) in the pipeline engine: see ds_mp/engine/zero2.py ---------
# ``PipelineEngine.__init__``'s assert ``zero_optimization_stage() < 2``: stage_gate.py.
ZERO2_ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption("zero", "overlapping_partition_gradients_reduce_epilogue", "stage 2: reduces the last bucket of "
               "one backward, adds its partition gradients to the step's accumulators (all_grad_tensors) and "
               "clears params_already_reduced; builds averaged_gradients only at a boundary"),
    Assumption("zero", "finalize_gradient_accumulation_boundary", "unmanaged accumulation's boundary: "
               "averaged_gradients from the accumulators of the step's epilogues, no reduction"),
    Assumption("zero", "set_gradient_accumulation_boundary", "the boundary flag the epilogue reads"),
    Assumption("zero_instance", "averaged_gradients", "group index -> this DP rank's partition gradients "
               "(list of tensors) once the step's boundary is finalized"),
)


def check_zero2(engine: PipelineEngine | None = None) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first broken ZeRO-2 assumption."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for a in ZERO2_ASSUMPTIONS:
        if a.owner == "zero":
            ok = hasattr(DeepSpeedZeroOptimizer, a.name)
        else:
            ok = engine is None or hasattr(engine.optimizer, a.name)
        if not ok:
            raise _fail(a, "DeepSpeedZeroOptimizer")


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
