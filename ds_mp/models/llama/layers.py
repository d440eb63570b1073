"""The Llama family's layers (``ds_mp.models.llama.plan`` holds its tables and explains the TP plan).

Each layer reads its cut from the family's plan through ``ctx.family`` (``tp_plan``, ``linear_shape``,
``biases``), so this file holds the maths only: RMSNorm, a TP-cut ``nn.Linear`` with LoRA, grouped-query
attention with rotary positions, SwiGLU, the decoder block, the vocab-parallel embedding and head.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_mp.context_parallel.attention import grouped_kv
from ds_mp.models.family import lora_targeted
from ds_mp.models.ctx import Ctx
from ds_mp.models.token_ids import check_input_ids
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel import VocabParallelEmbedding, copy_to_tp, gather_from_sequence, reduce_from_tp
from ds_mp.tensor_parallel.layers import tp_parameter
from ds_mp.tensor_parallel.mappings import reduce_scatter_to_sequence
from ds_mp.tensor_parallel.random import parallel_region_rng


class RMSNorm(nn.Module):
    """HF's ``LlamaRMSNorm``: ``w · (x / sqrt(mean(x²) + eps))`` in fp32, cast back before the weight.
    The weight is replicated; where each rank sees only part of what it normalises, ``copy_to_tp``
    sums its gradient over TP: a slice of tokens (sequence parallelism), or this rank's heads
    (``per_head``: Qwen3's and Gemma 3's q/k norms over ``head_dim``; with replicated key/value heads
    each rank back-propagates only the heads its queries read), so every TP copy stays identical."""

    def __init__(self, src: WeightSource, name: str, ctx: Ctx, per_head: bool = False) -> None:
        super().__init__()
        self.weight = tp_parameter(src.get(name).detach(), "replicated", ctx.tp_rank, ctx.tp)
        self.eps, self.group = ctx.hf.rms_norm_eps, ctx.group
        self.sum_grad = ctx.sp or (per_head and ctx.tp > 1)

    def scale(self) -> torch.Tensor:
        """The weight, entering through ``copy_to_tp`` where its gradient is summed over TP."""
        return copy_to_tp(self.weight, self.group) if self.sum_grad else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale() * h.to(x.dtype)


class Linear(nn.Module):
    """One HF ``nn.Linear`` of a block, cut by the TP plan, with optional LoRA factors.

    Column-parallel (``column=True``: ``y_r = x_in W_rᵀ + b_r``, ``x_in`` already replicated by the
    block's f or SP gather) or row-parallel (``y = Σ_r x_r W_rᵀ`` reduced over TP, + the replicated
    bias once).  ``sum_grad``: the weight is replicated but each rank uses part of its output (GQA
    key/value heads TP does not divide), so it enters through ``copy_to_tp`` (gradient summed).
    LoRA (``y += s · dropout(x) Aᵀ Bᵀ``, PEFT's) follows ``ds_mp.tensor_parallel.lora``: the column
    branch reads the block input before f and sums its rank-partial ``dU`` through ``copy_to_tp``;
    the row branch all-reduces ``u`` (r values per token)."""

    def __init__(self, src: WeightSource, name: str, ctx: Ctx, *, column: bool, kind: str, bias: bool,
                 heads: int = 0, lora: tuple[torch.Tensor, torch.Tensor, float, float] | None = None) -> None:
        super().__init__()
        r, p = ctx.tp_rank, ctx.tp
        self.weight = tp_parameter(src.lazy(name + ".weight"), kind, r, p, n_head=heads)
        self.bias = (tp_parameter(src.lazy(name + ".bias"), kind if column else "replicated", r, p, n_head=heads)
                     if bias else None)
        self.column, self.group, self.sp = column, ctx.group, ctx.sp
        self.sum_grad = kind == "replicated" and column and p > 1
        self.scaling = self.lora_dropout = 0.0
        if lora is not None:
            a, b, self.scaling, self.lora_dropout = lora
            self.lora_A = tp_parameter(a, "replicated" if column else "row", r, p)
            self.lora_B = tp_parameter(b, "column" if column else "replicated", r, p)

    def forward(self, x: torch.Tensor, x_pre: torch.Tensor | None = None) -> torch.Tensor:
        """Column: ``x`` = the replicated input, ``x_pre`` = the block input before f (LoRA). Row: ``x`` local."""
        w, b = self.weight, self.bias
        if self.sum_grad:
            w, b = copy_to_tp(w, self.group), (copy_to_tp(b, self.group) if b is not None else None)
        if self.column:
            y = F.linear(x, w, b)
            if self.scaling:
                u = F.dropout(x_pre, self.lora_dropout, self.training) @ self.lora_A  # same mask on every rank
                y = y + (copy_to_tp(u, self.group) @ self.lora_B) * self.scaling
            return y
        y = F.linear(x, w)
        y = reduce_scatter_to_sequence(y, self.group, dim=1) if self.sp else reduce_from_tp(y, self.group)
        if b is not None:
            y = y + (copy_to_tp(b, self.group) if self.sp else b)
        if self.scaling:
            with parallel_region_rng():  # each rank drops its own slice of the input
                xd = F.dropout(x, self.lora_dropout, self.training)
            y = y + (reduce_from_tp(xd @ self.lora_A, self.group) @ self.lora_B) * self.scaling
        return y


def _linear(src: WeightSource, index: int, module: str, ctx: Ctx, heads: int = 0) -> Linear:
    """Block ``index``'s ``module`` (``self_attn.q_proj`` …) by the TP plan, with LoRA factors when
    ``ctx.lora`` targets it (from ``src`` when it holds them, a PEFT model; else PEFT's init from a
    generator seeded by (seed, block, module): identical on every rank)."""
    from ds_mp.tensor_parallel.lora import lora_init

    family = ctx.family
    name, kind = f"model.layers.{index}.{module}", family.tp_plan[module + ".weight"]
    column = kind != "linear_in"
    if kind == "kv" and heads % ctx.tp:
        kind = "replicated"  # GQA: TP does not divide the key/value heads
    lora, lo = None, ctx.lora
    if lo is not None and lora_targeted(module, lo.target_modules):
        if src.has(name + ".lora_A"):
            a, b = src.get(name + ".lora_A").float(), src.get(name + ".lora_B").float()
        else:
            n_out, n_in = family.linear_shape(ctx.hf, module)
            salt = family.lora_modules.index(module)
            a, b = lora_init(n_in, n_out, lo.r, torch.Generator().manual_seed(ctx.seed * 1000 + 8 * index + salt))
        lora = (a, b, lo.alpha / lo.r, lo.dropout)
    qkv_bias, o_bias, mlp_bias = family.biases(ctx.hf)
    bias = mlp_bias if module.startswith("mlp.") else o_bias if module == "self_attn.o_proj" else qkv_bias
    return Linear(src, name, ctx, column=column, kind=kind, bias=bias, heads=heads, lora=lora)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions on this rank's query heads (module docstring);
    with the family's q/k norms (Qwen3: RMSNorm over ``head_dim`` of each head, before the rotation).
    A family's variant overrides the class hooks: ``norm_class`` (its q/k norm's maths), :meth:`rope`
    (this layer's frequencies), ``scale`` (SDPA's score scale, None: 1/sqrt(head_dim)) and
    ``windowed`` (whether the sliding window, ``ctx.window``, applies to this layer)."""

    norm_class: type = RMSNorm
    scale: float | None = None
    windowed: bool = True

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        cfg, p, r = ctx.hf, ctx.tp, ctx.tp_rank
        self.index, self.hd, self.ctx = index, ctx.family.head_dim(cfg), ctx
        n_head_local, n_kv = cfg.num_attention_heads // p, cfg.num_key_value_heads
        group_size = cfg.num_attention_heads // n_kv
        self.q_proj = _linear(src, index, "self_attn.q_proj", ctx, cfg.num_attention_heads)
        self.k_proj = _linear(src, index, "self_attn.k_proj", ctx, n_kv)
        self.v_proj = _linear(src, index, "self_attn.v_proj", ctx, n_kv)
        self.o_proj = _linear(src, index, "self_attn.o_proj", ctx)
        first = r * n_head_local if n_kv % p else 0  # all KV heads here (global index), or this rank's
        # local query head j reads local key/value head kv_index[j] (HF's repeat_kv, restricted to this rank)
        self.register_buffer("kv_index", (torch.arange(n_head_local) + first) // group_size, persistent=False)
        self.n_kv_local = n_kv if n_kv % p else n_kv // p  # the key/value heads this rank computes (and caches)
        self.grouped = grouped_kv(self.kv_index, self.n_kv_local)  # HF's order over this rank's heads (CP: SDPA groups)
        self.q_norm = self.k_norm = None
        if ctx.family.qk_norm(cfg):
            name = f"model.layers.{index}.self_attn."
            self.q_norm = self.norm_class(src, name + "q_norm.weight", ctx, per_head=True)
            self.k_norm = self.norm_class(src, name + "k_norm.weight", ctx, per_head=True)
        inv_freq, self.rope_scaling = self.rope(cfg, index)
        self.inv_freq = inv_freq.float()  # fp32, not a buffer

    def rope(self, cfg: Any, index: int) -> tuple[torch.Tensor, float]:
        """Block ``index``'s rotary inverse frequencies and attention scaling, as HF computes them."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(cfg)
        return rope.inv_freq, rope.attention_scaling

    def rotate(self, x: torch.Tensor, first: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """HF's rotary embedding of ``x`` (B, h, T, hd) at positions ``first … first+T-1``, or at
        ``positions`` (B, T) (packed documents restart at 0)."""
        from transformers.models.llama.modeling_llama import rotate_half

        pos = torch.arange(first, first + x.shape[2], device=x.device) if positions is None else positions
        freqs = pos.float()[..., None] * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd) or (B, T, hd)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)  # (B, 1, T, hd): one angle per row and token, shared by the heads
        cos, sin = (emb.cos() * self.rope_scaling).to(x.dtype), (emb.sin() * self.rope_scaling).to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def forward(self, x_in: torch.Tensor, x_pre: torch.Tensor, kv_extension: Any) -> torch.Tensor:
        B, T, _ = x_in.shape
        q = self.q_proj(x_in, x_pre).view(B, T, -1, self.hd).transpose(1, 2)  # (B, nh_l, T, hd)
        k = self.k_proj(x_in, x_pre).view(B, T, -1, self.hd).transpose(1, 2)  # (B, nkv_l, T, hd)
        v = self.v_proj(x_in, x_pre).view(B, T, -1, self.hd).transpose(1, 2)
        if self.q_norm is not None:  # per head, before the rotation (and before TeraPipe caches k)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ctx.cp > 1:  # this rank's tokens of the row; the layout's full-row positions and mask
            assert kv_extension is None, "TeraPipe with context parallelism (refused at load_config)"
            pos = self.ctx.layout.local_positions()
            q, k = self.rotate(q, 0, pos), self.rotate(k, 0, pos)
            p = self.ctx.attn_dropout if self.training else 0.0
            with parallel_region_rng():  # each rank's own heads (and, inside, each CP rank's own seed)
                y = self.ctx.cp_attention(q, k, v, None if self.grouped else self.kv_index, windowed=self.windowed,
                                          dropout_p=p, scale=self.scale)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        mask = None
        if kv_extension is not None:  # TeraPipe: earlier slices' keys (cached before rotation) and values
            k, v, mask = kv_extension.extend(self.index, k, v)  # (B, nkv_l, c+T, hd): grouped heads
        offset = k.shape[2] - T  # this slice's first position in the sequence (0 without a cache)
        lay = self.ctx.layout
        if lay is not None:  # documents / padding / sliding window: positions per token, the layout's mask
            mask = lay.mask(T, k.shape[2], windowed=self.windowed)
            q = self.rotate(q, 0, lay.positions[:, offset:offset + T])
            k = self.rotate(k, 0, lay.positions[:, :k.shape[2]])
        else:
            q, k = self.rotate(q, offset), self.rotate(k, 0)  # every key at its own position, as HF rotates it
        k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)  # (B, nh_l, ·, hd)
        p = self.ctx.attn_dropout if self.training else 0.0
        with parallel_region_rng():  # each rank's own heads: its own dropout mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                               scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate x) · up x)``; gate/up column-parallel, down row-parallel."""

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        self.gate_proj = _linear(src, index, "mlp.gate_proj", ctx)
        self.up_proj = _linear(src, index, "mlp.up_proj", ctx)
        self.down_proj = _linear(src, index, "mlp.down_proj", ctx)
        self.act = ACT2FN[self.activation(ctx.hf)]

    @staticmethod
    def activation(cfg: Any) -> str:
        """The name of the gate's activation in ``cfg`` (HF's ``hidden_act``)."""
        return cfg.hidden_act

    def forward(self, x_in: torch.Tensor, x_pre: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x_in, x_pre)) * self.up_proj(x_in, x_pre))


class Block(nn.Module):
    """One decoder layer, ``x + Attn(RMSNorm x)`` then ``+ MLP(RMSNorm ·)``, heads split over TP.
    ``kv_extension`` (:func:`ds_mp.models.pipeline.attending_to`) adds earlier tokens' keys/values."""

    is_block = True  # DsMpPipeline.blocks()

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        p = f"model.layers.{index}."
        self.ctx, self.index = ctx, index
        self.input_layernorm = RMSNorm(src, p + "input_layernorm.weight", ctx)
        self.self_attn = Attention(src, index, ctx)
        self.post_attention_layernorm = RMSNorm(src, p + "post_attention_layernorm.weight", ctx)
        self.mlp = MLP(src, index, ctx)
        self.n_head_local = self.self_attn.n_kv_local  # heads of this block's TeraPipe cache entries
        self.kv_extension: Any = None

    def _enter(self, h: torch.Tensor) -> torch.Tensor:
        """f (identity forward, all-reduce backward), or the SP all-gather along the sequence."""
        return gather_from_sequence(h, self.ctx.group, dim=1) if self.ctx.sp else copy_to_tp(h, self.ctx.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn(self._enter(h), h, self.kv_extension)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(self._enter(h), h)


class TokenEmbedding(nn.Module):
    """``embed_tokens`` (vocab-parallel); with ``tie_word_embeddings`` also the head (tied)."""

    def __init__(self, src: WeightSource, ctx: Ctx, name: str = "model.embed_tokens.weight") -> None:
        super().__init__()
        self.ctx = ctx
        self.embed = VocabParallelEmbedding(src.lazy(name), ctx.group, ctx.tp_rank, ctx.tp, ctx.padded_vocab,
                                            sequence_parallel=ctx.sp, overlap_comm=ctx.overlap_comm)
        self.pad_id = ctx.family.padding_idx(ctx.hf)

    def forward(self, inputs: Any) -> torch.Tensor:
        return embed_forward(self, inputs)


def embed_forward(module: TokenEmbedding, inputs: Any) -> torch.Tensor:
    """First stage: ``ids`` (or ``(ids, positions)``) -> ``embed_tokens(ids)``.  HF's embedding has
    ``padding_idx = pad_token_id`` (``-1``: row V − 1): that row gets no gradient from the lookup, so
    neither does it here (the lookups of that id are cut from the graph, on whichever TP rank holds it)."""
    ids = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    check_input_ids(ids, module.ctx.vocab)
    h = module.embed(ids)
    if module.pad_id is not None and h.requires_grad:
        pad = ids == module.pad_id
        if module.ctx.sp:  # h is this rank's sequence shard
            pad = pad.chunk(module.ctx.tp, dim=1)[module.ctx.tp_rank]
        h = torch.where(pad.unsqueeze(-1), h.detach(), h)
    return h


def head_forward(module: TokenEmbedding, h: torch.Tensor) -> torch.Tensor:
    """Last stage: logits on the local vocab block, ``(B, T, V_p/p)``."""
    return module.embed.logits(h)


class LMHead(TokenEmbedding):
    """An untied ``lm_head.weight`` (vocab-parallel like the embedding, never looked up)."""

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__(src, ctx, "lm_head.weight")

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return head_forward(self, h)


class FinalNorm(nn.Module):
    """The last norm (``model.norm``); a family with another norm sets ``norm_class``."""

    norm_class: type = RMSNorm

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.norm = self.norm_class(src, "model.norm.weight", ctx)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


__all__ = ["RMSNorm", "Linear", "Attention", "MLP", "Block", "TokenEmbedding", "LMHead", "FinalNorm",
           "embed_forward", "head_forward"]
