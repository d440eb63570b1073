"""Gradient maths every engine shares: the global norm, clipping, the non-finite check.

Ownership rule of the global norm ‖g‖₂ over a model sharded TP × PP (× DP replicas that
hold identical reduced gradients): each rank adds the squares of the parameters it *owns*
and one all-reduce over the model-parallel group (TP × PP) sums them —

* a TP shard (any other ``tp_kind``): owned by every TP rank (each holds its part);
* a replicated tensor (``replicated``, ``experts_replicated``): owned by TP rank 0 only;
* the tied ``wte`` (on the first and the last stage): owned by the first stage only.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.tensor_parallel.sharding import REPLICATED


def owned_parameters(module: torch.nn.Module, topology: Any) -> list[torch.nn.Parameter]:
    """The parameters whose squares this rank contributes to the global norm (see module doc)."""
    tied_ids = compat.tied_parameter_ids(module)
    tied_first = not (compat.has_tied_comms(module) and topology.pp > 1) or topology.pp_rank == 0
    out = []
    for p in module.parameters():
        if id(p) in tied_ids and not tied_first:
            continue
        if getattr(p, "tp_kind", "replicated") in REPLICATED and topology.tp_rank != 0:
            continue
        out.append(p)
    return out


def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ‖t‖² in fp32 on ``device``, one fused kernel per dtype, no host sync."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([t.detach().float() if t.dtype != torch.float32 else t.detach() for t in tensors])
    return torch.stack(norms).pow(2).sum().to(device)


def global_grad_norm(module: torch.nn.Module, topology: Any, device: torch.device) -> float:
    """‖g‖₂ over the whole model replica (ownership rule above): one all-reduce, one host sync."""
    total = sum_of_squares((p.grad for p in owned_parameters(module, topology) if p.grad is not None), device)
    if topology.tp * topology.pp > 1:
        dist.all_reduce(total, group=topology.model_group)
    return math.sqrt(float(total))


def reduction_grad_norm(module: torch.nn.Module, topology: Any, optimizer: Any, device: torch.device, bf16: bool,
                        zero: bool) -> float:
    """‖g‖₂ (ownership rule above) of the gradients DeepSpeed's DP reduction averages: ``p.grad`` in
    fp32 and under ZeRO (before its reduction), BF16_Optimizer's fp32 gradient buffers
    (``fp32_groups_gradients``: the bf16 micro-batch gradients accumulated in fp32)."""
    owned = owned_parameters(module, topology)
    if bf16:
        fp32 = compat.bf16_fp32_gradients(optimizer)
        tensors = [fp32.get(id(p)) for p in owned]
    elif zero:
        tensors = [compat.zero_gradient_for_reduction(optimizer, p) for p in owned]
    else:
        return global_grad_norm(module, topology, device)
    total = sum_of_squares(tensors, device)
    if topology.tp * topology.pp > 1:
        dist.all_reduce(total, group=topology.model_group)
    return math.sqrt(float(total))


def clip_(params: Iterable[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale gradients by ``max_norm / (norm + 1e-6)`` when that is below 1 (torch's rule)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def any_nonfinite(params: Iterable[torch.nn.Parameter], device: torch.device, group: Any = None) -> bool:
    """True on every rank of ``group`` (default: the world) if any gradient anywhere is NaN/Inf."""
    return any_nonfinite_tensors((p.grad for p in params), device, group)


def any_nonfinite_tensors(tensors: Iterable[torch.Tensor | None], device: torch.device, group: Any = None) -> bool:
    """True on every rank of ``group`` (default: the world) if any of ``tensors`` anywhere holds a NaN/Inf."""
    bad = (~torch.isfinite(sum_of_squares(tensors, device))).float().reshape(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad.item())


__all__ = ["owned_parameters", "sum_of_squares", "global_grad_norm", "reduction_grad_norm", "clip_", "any_nonfinite", "any_nonfinite_tensors"]
