"""GPT-2's layers: pre-LN blocks whose linears are cut by the plan (``plan.GPT2_TP_PLAN``), the
vocab-parallel token embedding tied with the head, learned positions, the final LayerNorm.

Every layer reads its cut from ``ctx.family``'s plan, so this file holds the maths: attention over
this rank's heads (``# (B, nh_l, T, hs)``), GELU MLP, residual dropout, sequence-parallel LayerNorm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_mp.models.ctx import Ctx
from ds_mp.models.family import lora_targeted
from ds_mp.models.token_ids import check_input_ids
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp
from ds_mp.tensor_parallel.layers import embedding_lookup
from ds_mp.tensor_parallel.random import parallel_region_rng


class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm whose (replicated) weight and bias sum their gradients over the TP group in
    backward when sequence parallelism shards its input (``copy_to_tp``: identity forward,
    all-reduce backward): each rank saw only its part of the sequence.  Done inside autograd, so
    every optimizer wrapper (bf16 master gradients, ZeRO) sees the summed gradient."""

    def __init__(self, n: int, eps: float, group: Any) -> None:
        super().__init__(n, eps=eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, copy_to_tp(self.weight, self.group),
                            copy_to_tp(self.bias, self.group), self.eps)


def _layer_norm(src: WeightSource, prefix: str, ctx: Ctx) -> nn.LayerNorm:
    eps = ctx.hf.layer_norm_epsilon
    ln = SequenceParallelLayerNorm(ctx.n_embd, eps, ctx.group) if ctx.sp else nn.LayerNorm(ctx.n_embd, eps=eps)
    with torch.no_grad():
        ln.weight.copy_(src.get(prefix + ".weight"))
        ln.bias.copy_(src.get(prefix + ".bias"))
    for p in ln.parameters():
        p.tp_kind = "replicated"
    return ln


class Block(nn.Module):
    """One GPT-2 block, ``x + Attn(LN1 x)`` then ``+ MLP(LN2 ·)``, heads split over TP.

    ``kv_extension`` (set with :func:`attending_to`, e.g. by TeraPipe) supplies keys/values of
    earlier tokens of the same sequence: ``extend(index, k, v) -> (K̃, Ṽ, mask)``; the tokens
    attend to all of them plus causally to themselves.
    """

    is_block = True  # DsMpPipeline.blocks()

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        p = f"transformer.h.{index}."
        self.ctx, self.index = ctx, index
        self.ln_1 = _layer_norm(src, p + "ln_1", ctx)
        self.c_attn = _linear(src, index, "attn.c_attn", ctx)
        self.attn_proj = _linear(src, index, "attn.c_proj", ctx)
        self.ln_2 = _layer_norm(src, p + "ln_2", ctx)
        self.c_fc = _linear(src, index, "mlp.c_fc", ctx)
        self.mlp_proj = _linear(src, index, "mlp.c_proj", ctx)
        self.act = ACT2FN[ctx.hf.activation_function]
        self.n_head_local = ctx.n_head // ctx.tp
        self.kv_extension: Any = None  # see attending_to

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3·nh_l·hs)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.n_head_local, -1).permute(2, 0, 3, 1, 4)  # (B, nh_l, T, hs)
        p = self.ctx.attn_dropout if self.training else 0.0
        if self.ctx.cp > 1:  # this rank's tokens of the row against the whole row's (the layout's mask)
            assert self.kv_extension is None, "TeraPipe with context parallelism (refused at load_config)"
            with parallel_region_rng():  # each rank's own heads (and, inside, each CP rank's own seed)
                y = self.ctx.cp_attention(q, k, v, None, dropout_p=p)  # MHA: head j reads head j
            return self.attn_proj(y.transpose(1, 2).reshape(B, T, -1))
        if self.kv_extension is not None:
            k, v, mask = self.kv_extension.extend(self.index, k, v)  # (B, nh_l, ctx+T, hs)
        else:
            mask = None
        if self.ctx.layout is not None:  # documents / padding: (B, 1, T, ctx+T), causality included
            mask = self.ctx.layout.mask(T, k.shape[2])
        with parallel_region_rng():  # each rank's own heads: its own dropout mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh_l·hs)
        return self.attn_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.ln_1(x))
        with self.ctx.dropout_rng():
            x = x + F.dropout(a, self.ctx.dropout, self.training)
        h = self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))
        with self.ctx.dropout_rng():
            return x + F.dropout(h, self.ctx.dropout, self.training)


def _linear(src: WeightSource, index: int, module: str, ctx: Ctx) -> nn.Module:
    """Block ``index``'s Conv1D ``module`` (``attn.c_attn`` …) as the TP plan cuts it: ``row`` ->
    row-parallel, ``qkv``/``column`` -> column-parallel of that kind (the checkpoint side shards by the
    same table, ``Family.tp_kind``).  With LoRA factors when ``ctx.lora`` targets it: from ``src`` when
    it holds them (a PEFT model), else PEFT's init from a generator seeded by (seed, block, module):
    identical on every rank.  Only this rank's shard of the base is read."""
    from ds_mp.tensor_parallel.lora import LoRAColumnParallelLinear, LoRARowParallelLinear, lora_init

    family, p = ctx.family, f"transformer.h.{index}.{module}"
    kind, heads = family.tp_plan[module + ".weight"], family.heads(p + ".weight", ctx.hf)
    w, b = src.lazy(p + ".weight"), src.lazy(p + ".bias")
    g, r, n, lo = ctx.group, ctx.tp_rank, ctx.tp, ctx.lora
    if lo is None or not lora_targeted(module, lo.target_modules):
        if kind == "row":
            return RowParallelLinear(w, b, g, r, n, sequence_parallel=ctx.sp)
        return ColumnParallelLinear(w, b, g, r, n, kind=kind, n_head=heads, sequence_parallel=ctx.sp,
                                    overlap_comm=ctx.overlap_comm)
    if src.has(p + ".lora_A"):
        a, bb = src.get(p + ".lora_A").float(), src.get(p + ".lora_B").float()
    else:
        salt = family.lora_modules.index(module)
        fan_in, fan_out = family.param_shapes(src.config)[p + ".weight"]
        a, bb = lora_init(fan_in, fan_out, lo.r, torch.Generator().manual_seed(ctx.seed * 1000 + 4 * index + salt))
    kw = {"lora_A": a, "lora_B": bb, "scaling": lo.alpha / lo.r, "dropout": lo.dropout}
    if kind == "row":
        return LoRARowParallelLinear(w, b, g, r, n, **kw)
    return LoRAColumnParallelLinear(w, b, g, r, n, kind=kind, n_head=heads, **kw)


class TokenEmbedding(nn.Module):
    """``wte`` (vocab-parallel); tied between the first stage (lookup) and the last (head)."""

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.wte = VocabParallelEmbedding(src.lazy("transformer.wte.weight"), ctx.group, ctx.tp_rank, ctx.tp,
                                          ctx.padded_vocab, sequence_parallel=ctx.sp,
                                          overlap_comm=ctx.overlap_comm)


def embed_forward(module: TokenEmbedding, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage: ``ids`` or ``(ids, positions)`` -> ``(wte(ids), positions)`` (without positions:
    the running micro-batch's layout's, of this CP rank's tokens under CP, else 0 … T-1)."""
    ids, pos = inputs if isinstance(inputs, (tuple, list)) else (inputs, None)
    check_input_ids(ids, module.ctx.vocab)
    if pos is None and module.ctx.layout is not None:  # under CP: the positions of this rank's tokens
        pos = module.ctx.layout.local_positions()
    if pos is not None and pos.shape[-1] != ids.shape[1]:
        raise ValueError(f"GPT-2 embedding: {pos.shape[-1]} positions for {ids.shape[1]} tokens (under context "
                         "parallelism both are this rank's: input_ids[:, q_index], layout.local_positions())")
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return module.wte(ids), pos


def head_forward(module: TokenEmbedding, h: torch.Tensor) -> torch.Tensor:
    """Last stage: logits on the local vocab block, ``(B, T, V_p/p)``."""
    return module.wte.logits(h)


class Positions(nn.Module):
    """``h = dropout(wte(ids) + wpe(pos))`` (positions absolute, also for token slices).
    ``sparse_grads``: as :class:`ds_mp.tensor_parallel.VocabParallelEmbedding`'s."""

    sparse_grads = True

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.wpe = nn.Parameter(src.get("transformer.wpe.weight").detach().clone())
        self.wpe.tp_kind = "replicated"

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tok, pos = inputs
        if self.ctx.sp:  # tok is the local sequence shard: take the matching positions
            pos = pos.expand(tok.shape[0], -1).chunk(self.ctx.tp, dim=1)[self.ctx.tp_rank]
        wpe = copy_to_tp(self.wpe, self.ctx.group) if self.ctx.sp else self.wpe  # SP: sum its grad over TP
        h = tok + embedding_lookup(pos, wpe, self.sparse_grads)
        with self.ctx.dropout_rng():
            return F.dropout(h, self.ctx.embd_dropout, self.training)


class FinalNorm(nn.Module):
    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ln_f = _layer_norm(src, "transformer.ln_f", ctx)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h)


__all__ = ["SequenceParallelLayerNorm", "Block", "TokenEmbedding", "Positions", "FinalNorm", "embed_forward",
           "head_forward"]
