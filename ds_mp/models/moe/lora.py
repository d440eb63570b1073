"""LoRA on the fused expert tensors (PEFT's ``target_parameters``, its ``ParamWrapper``), under TP.

PEFT 0.22 adapts a 3-D expert tensor ``W`` (E, out, in) (``mlp.experts.gate_up_proj`` (E, 2I, H),
``mlp.experts.down_proj`` (E, H, I)) with two ``nn.Linear`` weights, ``lora_A`` (r·E, in) and
``lora_B`` (out, r·E), read per expert as

    A_e = lora_A.reshape(E, r, in)[e]            (r, in)    expert-major rows
    B_e = lora_B.reshape(out, r, E)[:, :, e]     (out, r)   expert-minor columns: column ρ·E + e
    W_e ← W_e + s · B_e A_e,   s = alpha / r                (no dropout, DoRA or bias: PEFT refuses them)

ds_mp stores the factors stacked per expert in that orientation, ``lora_A`` (E, r, in) and ``lora_B``
(E, out, r) (``ds_mp.models.weights.param_factors_from_peft`` / ``…_to_peft`` convert; a merged export
folds ``s · bmm(lora_B, lora_A)`` into W), and never forms ΔW_e: each expert's tokens
take the low-rank side path ``x W_eᵀ + s · (x A_eᵀ) B_eᵀ``, batched per expert as the base.

Under TP the factors follow the base's cut (``ds_mp.moe.expert_layout``; ``plan.EXPERT_LORA_PLAN``):

* ``whole``: rank r holds its experts' A_e and B_e (cut by experts) and adds their update to its partial
  sum; no communication (the block's f sums the input gradient over the ranks, as for the base);
* ``split``, ``gate_up_proj`` (column-parallel: ``out`` cut, gate and up rows apart): B_e's rows cut as
  W_e's, A_e replicated.  ``u_e = x_pre A_eᵀ`` from the block input before f, every expert's ``u``
  through one ``copy_to_tp`` (f: backward sums each rank's partial ``dU``), so ``dA`` is the full
  gradient on every rank and the input gets the LoRA term's gradient once, as
  ``ds_mp.tensor_parallel.lora``'s column-parallel LoRA;
* ``split``, ``down_proj`` (row-parallel: ``in`` cut): A_e's columns cut, B_e replicated.  ``u_e = Σ_r
  h_{e,r} A_{e,r}ᵀ`` by one ``reduce_from_tp`` (g) of every expert's ``u``, and ``s · u_e B_eᵀ ·
  w`` (w: the routing weight) is added after the experts' reduction, identically on every rank (the
  row-parallel LoRA's order); ``dU`` is replicated, so ``dA_{e,r}`` is this rank's columns.  The routing
  weights' gradient is summed over TP (the router's input and weight enter through f), so this term,
  whole on every rank, passes 1/TP of its share back to w.

Only the factors train (``build_pipeline`` freezes the rest).  A factor holder's ``scaling`` set to 0
(``ds_mp.engine.reference.lora_disabled``) leaves the base's forward bit for bit.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_mp.models.carry import scale_grad
from ds_mp.models.ctx import Ctx
from ds_mp.models.family import lora_targeted
from ds_mp.models.moe.plan import EXPERT_LORA_PLAN, EXPERTS, sparse_shapes
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel import copy_to_tp, reduce_from_tp
from ds_mp.tensor_parallel.layers import tp_parameter


class ExpertLoRA(nn.Module):
    """This rank's factors of one fused expert tensor: ``lora_A`` (E_l, r, in_l), ``lora_B`` (E_l, out_l, r)."""

    def __init__(self, a: Any, b: Any, kinds: tuple[str, str], rank: int, size: int, scaling: float) -> None:
        super().__init__()
        self.lora_A = tp_parameter(a, kinds[0], rank, size)
        self.lora_B = tp_parameter(b, kinds[1], rank, size)
        self.scaling = scaling


def expert_lora(src: WeightSource, prefix: str, part: str, index: int, ctx: Ctx) -> ExpertLoRA | None:
    """The factors of block ``index``'s fused tensor ``part`` (``mlp.experts.gate_up_proj`` …) when
    ``ds_mp.lora.target_parameters`` names it: from ``src`` (``<HF name>.lora_A/B`` in ds_mp's layout, a
    PEFT model's) when it holds them, else PEFT's init (A ~ U(±1/√in) drawn as PEFT's (r·E, in) weight,
    B = 0) from a generator seeded by (seed, block, tensor): identical on every rank."""
    lo = ctx.lora
    if lo is None or not lora_targeted(part, lo.target_parameters):
        return None
    name = prefix + part
    if src.has(name + ".lora_A"):
        a, b = src.get(name + ".lora_A").float(), src.get(name + ".lora_B").float()
    else:
        E, n_out, n_in = sparse_shapes(ctx.hf)[part]
        g = torch.Generator().manual_seed(ctx.seed * 1000 + 8 * index + 4 + EXPERTS.index(part))
        a = ((torch.rand(E * lo.r, n_in, generator=g) * 2 - 1) / math.sqrt(n_in)).reshape(E, lo.r, n_in)
        b = torch.zeros(E, n_out, lo.r)
    whole = ctx.expert_layout == "whole"
    kinds = (("experts", "experts") if whole
             else (EXPERT_LORA_PLAN[part + ".lora_A"], EXPERT_LORA_PLAN[part + ".lora_B"]))
    return ExpertLoRA(a, b, kinds, ctx.tp_rank, ctx.tp, lo.alpha / lo.r)


def lora_experts_forward(x: torch.Tensor, x_pre: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                         gate_up: torch.Tensor, down: torch.Tensor, first: int, act: Any,
                         up_lora: ExpertLoRA | None, down_lora: ExpertLoRA | None,
                         group: Any, split: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``experts_forward`` with the LoRA side paths (module docstring): ``x``/``x_pre`` (N, H) the input
    after/before the block's f; ``split``: the TP size every expert is cut over (1: not cut).  Returns this
    rank's partial sum and, for a cut ``down_proj`` with LoRA, the replicated term to add after its
    reduction (else None)."""
    out, local = torch.zeros_like(x), index - first
    split, tp = split > 1, split
    hits = [torch.where(local == e) for e in range(gate_up.shape[0])]  # (token, slot) routed to each expert
    sizes = [int(t.numel()) for t, _ in hits]
    s_up = up_lora.scaling if up_lora is not None else 0.0
    s_down = down_lora.scaling if down_lora is not None else 0.0
    if s_up:
        src = x_pre if split else x
        us = [src[t] @ up_lora.lora_A[e].t() for e, (t, _) in enumerate(hits)]  # (n_e, r) each
        if split:  # f: the ranks' partial dU (each from its rows of B) summed in backward
            us = list(copy_to_tp(torch.cat(us), group).split(sizes))
    vs = []
    for e, (token, slot) in enumerate(hits):
        if not sizes[e]:
            continue
        gu = F.linear(x[token], gate_up[e])
        if s_up:
            gu = gu + (us[e] @ up_lora.lora_B[e].t()) * s_up
        g, u = gu.chunk(2, dim=-1)
        h = act(g) * u
        y = F.linear(h, down[e])
        if s_down:
            v = h @ down_lora.lora_A[e].t()  # (n_e, r): this rank's columns' share under split
            if split:
                vs.append(v)
            else:
                y = y + (v @ down_lora.lora_B[e].t()) * s_down
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    if not (s_down and split):
        return out, None
    hit = [e for e in range(len(hits)) if sizes[e]]
    vs = reduce_from_tp(torch.cat(vs), group).split([sizes[e] for e in hit])  # g: u_e summed over the ranks
    # the routing weights' gradient is summed over TP (each rank adds its partial experts' share); this term
    # is computed whole on every rank, so its share enters at 1/TP
    post, w = torch.zeros_like(x), scale_grad(weights, 1.0 / tp)
    for v, e in zip(vs, hit):
        token, slot = hits[e]
        post.index_add_(0, token, ((v @ down_lora.lora_B[e].t()) * s_down * w[token, slot, None]).to(post.dtype))
    return out, post


__all__ = ["ExpertLoRA", "expert_lora", "lora_experts_forward"]
