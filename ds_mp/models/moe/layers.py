"""The mixture-of-experts layers: HF's router and experts under TP, on Llama's attention and norms.

:class:`SparseMLP` is HF's ``…SparseMoeBlock`` (``plan.py`` lists each family's rule):

    logits = x Wᵀ_gate                         (N, E), the router replicated on every TP rank
    p      = softmax(logits) in fp32           top-k (k = num_experts_per_tok) of p, renormalised
                                               when the family does, cast to the logits' dtype (Qwen)
    y      = Σ_k w_k · expert_{i_k}(x)         expert(x) = down(act(gate x) · up x)

No token is dropped (no capacity).  The experts' matmuls are batched per expert: the (token, k)
assignments are grouped by expert and each expert multiplies all of its tokens at once, in
expert order, as HF does.  Under TP the tokens are already on every rank (the block's f), so there
is no all-to-all: with ``whole`` experts rank r computes only its experts ``r·E/p …`` (the
others' contributions are zero here), with ``split`` experts every expert on a 1/p slice of its
intermediate dimension; either way each rank holds a partial sum of ``y``, which the row-parallel
all-reduce (or SP's reduce-scatter) sums — the dense MLP's down projection, exactly.

The router weight and the block input are replicated but each rank back-propagates only its
partial ``y``: both enter through ``copy_to_tp`` (the input: the block's f), so their gradient is
the sum over TP.  The aux loss's path (``ds_mp.models.carry.add_router_stats``, ``grad_scale``) is scaled by 1/TP for the same
sum.  Routing is computed from the same fp32 numbers on every rank, so every rank picks the same
experts.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_mp.models.ctx import Ctx
from ds_mp.models.llama import layers as llama_layers
from ds_mp.models.llama.layers import RMSNorm, _linear
from ds_mp.models.carry import add_router_stats
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel import copy_to_tp, reduce_from_tp
from ds_mp.tensor_parallel.layers import tp_parameter
from ds_mp.tensor_parallel.mappings import reduce_scatter_to_sequence
from ds_mp.models.moe.lora import expert_lora, lora_experts_forward
from ds_mp.models.moe.plan import EXPERTS, expert_width, is_sparse, n_experts, renormalises


def route(logits: torch.Tensor, k: int, renormalise: bool, cast: bool) -> tuple[torch.Tensor, ...]:
    """HF's top-k router on ``logits`` (N, E): (fp32 probabilities (N, E), top-k weights (N, k),
    top-k expert indices (N, k)); the weights divided by their sum when ``renormalise``, and cast
    back to the logits' dtype when ``cast`` (Qwen's routers; Mixtral's keep fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, index = torch.topk(probs, k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, (top.to(logits.dtype) if cast else top), index


def experts_forward(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, first: int, act: Any) -> torch.Tensor:
    """``Σ_k w_k · expert_{i_k}(x)`` over the experts ``first … first + len(gate_up) − 1`` held here
    (the others contribute 0), batched per expert: ``x`` (N, H), ``index``/``weights`` (N, k),
    ``gate_up`` (E_l, 2I_l, H) = [gate; up], ``down`` (E_l, H, I_l)."""
    out = torch.zeros_like(x)
    local = index - first  # (N, k): this rank's expert slot, outside [0, E_l) if another rank's
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(local == e)  # every (token, k) routed to expert e
        if token.numel() == 0:
            continue
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(act(g) * u, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


class _Weight(nn.Module):
    """A module holding one replicated ``weight`` (the router, Qwen2-MoE's shared-expert gate), so its
    parameter is named as HF names it (``mlp.gate.weight``)."""

    def __init__(self, src: WeightSource, name: str, ctx: Ctx) -> None:
        super().__init__()
        self.weight = tp_parameter(src.lazy(name), "replicated", ctx.tp_rank, ctx.tp)
        self.group = ctx.group if ctx.tp > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ``, ``W`` entering through ``copy_to_tp`` under TP (its gradient summed over the ranks)."""
        return F.linear(x, self.weight if self.group is None else copy_to_tp(self.weight, self.group))


class Experts(nn.Module):
    """This rank's part of ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (whole experts
    ``first …``, or every expert's slice of the intermediate dimension: ``ds_mp.moe.expert_layout``), and
    their LoRA factors where ``ds_mp.lora.target_parameters`` names them (``lora.<tensor>.lora_A/B``,
    HF-named ``mlp.experts.<tensor>.lora_A/B``: ``ds_mp.models.moe.lora``)."""

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        name = f"model.layers.{index}.mlp.experts."
        p, r, whole = ctx.tp, ctx.tp_rank, ctx.expert_layout == "whole"
        up_kind, down_kind = ("experts", "experts") if whole else ("experts_gate_up", "experts_down")
        self.gate_up_proj = tp_parameter(src.lazy(name + "gate_up_proj"), up_kind, r, p)  # (E_l, 2I_l, H)
        self.down_proj = tp_parameter(src.lazy(name + "down_proj"), down_kind, r, p)  # (E_l, H, I_l)
        self.first = r * self.gate_up_proj.shape[0] if whole else 0  # global index of this rank's first expert
        self.act = ACT2FN[ctx.hf.hidden_act]
        factors = {t.rsplit(".", 1)[1]: expert_lora(src, f"model.layers.{index}.", t, index, ctx) for t in EXPERTS}
        self.lora = nn.ModuleDict({k: v for k, v in factors.items() if v is not None})
        self.group, self.split = ctx.group, (1 if whole else p)  # the TP size each expert is cut over

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                x_pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's partial sum, and the LoRA term added after its reduction (None: nothing)."""
        if not len(self.lora):
            return experts_forward(x, index, weights, self.gate_up_proj, self.down_proj, self.first, self.act), None
        return lora_experts_forward(x, x if x_pre is None else x_pre.reshape(x.shape), index, weights,
                                    self.gate_up_proj, self.down_proj, self.first, self.act,
                                    self.lora["gate_up_proj"] if "gate_up_proj" in self.lora else None,
                                    self.lora["down_proj"] if "down_proj" in self.lora else None,
                                    self.group, self.split)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: gate/up column-parallel, its down projection's partial product
    returned unreduced (it joins the experts' partial sum before the one reduction)."""

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        for m in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, m, _linear(src, index, f"mlp.shared_expert.{m}", ctx))
        self.act = ACT2FN[ctx.hf.hidden_act]

    def forward(self, x_in: torch.Tensor, x_pre: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate_proj(x_in, x_pre)) * self.up_proj(x_in, x_pre)
        return F.linear(h, self.down_proj.weight)  # this rank's partial sum


class SparseMLP(nn.Module):
    """HF's sparse MoE block of layer ``index`` under TP (module docstring), its parameters named as
    HF's: ``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj`` (+ Qwen2-MoE's
    ``shared_expert.*`` and ``shared_expert_gate.weight``)."""

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        cfg, name = ctx.hf, f"model.layers.{index}.mlp."
        self.ctx, self.k = ctx, cfg.num_experts_per_tok
        self.renormalise, self.cast = renormalises(cfg), cfg.model_type != "mixtral"
        self.gate = _Weight(src, name + "gate.weight", ctx)  # (E, H)
        self.experts = Experts(src, index, ctx)
        if cfg.model_type == "qwen2_moe":
            self.shared_expert = SharedExpert(src, index, ctx)
            self.shared_expert_gate = _Weight(src, name + "shared_expert_gate.weight", ctx)

    def forward(self, x_in: torch.Tensor, x_pre: torch.Tensor) -> torch.Tensor:
        """``x_in`` (B, T, H): the replicated input (after the block's f); ``x_pre``: before it (the
        shared expert's column linears read it for LoRA).  Returns the output reduced over TP."""
        B, T, H = x_in.shape
        ctx, x = self.ctx, x_in.reshape(-1, H)
        probs, weights, index = route(self.gate(x), self.k, self.renormalise, self.cast)  # (N, E), (N, k), (N, k)
        add_router_stats(ctx, probs, index, grad_scale=1.0 / ctx.tp)  # the aux loss's sums (models/carry.py)
        y, post = self.experts(x, index, weights, x_pre)
        y = y.view(B, T, H)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x_in)) * self.shared_expert(x_in, x_pre)
        y = reduce_scatter_to_sequence(y, ctx.group, dim=1) if ctx.sp else reduce_from_tp(y, ctx.group)
        return y if post is None else y + post.view(B, T, H)  # split down_proj LoRA: added once, after g


class Block(llama_layers.Block):
    """Llama's decoder layer with HF's MLP of layer ``index``: :class:`SparseMLP` where the family
    makes it sparse, else the dense (column/row-parallel) MLP of ``intermediate_size``."""

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        nn.Module.__init__(self)
        p = f"model.layers.{index}."
        self.ctx, self.index = ctx, index
        self.input_layernorm = RMSNorm(src, p + "input_layernorm.weight", ctx)
        self.self_attn = llama_layers.Attention(src, index, ctx)
        self.post_attention_layernorm = RMSNorm(src, p + "post_attention_layernorm.weight", ctx)
        self.mlp = SparseMLP(src, index, ctx) if is_sparse(ctx.hf, index) else llama_layers.MLP(src, index, ctx)
        self.n_head_local = self.self_attn.n_kv_local
        self.kv_extension: Any = None


def expert_matmul_parameters(cfg: Any) -> int:
    """Weights one token multiplies in a sparse layer: the router and k experts (a dense layer: the MLP)."""
    H, I = cfg.hidden_size, expert_width(cfg)
    return n_experts(cfg) * H + cfg.num_experts_per_tok * 3 * H * I


__all__ = ["Block", "Experts", "SharedExpert", "SparseMLP", "experts_forward", "expert_matmul_parameters", "route"]
