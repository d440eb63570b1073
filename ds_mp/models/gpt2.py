"""GPT-2 (``GPT2LMHeadModel``): its layer table, TP and LoRA plans, init rule and layers.

The layer table (:meth:`GPT2Family.pipeline_layers`: pipeline layer ↔ HF name prefix ↔ the class
built there):

    0        "wte"      TiedLayerSpec("wte")  token embedding (vocab-parallel), tied with the head
    1        "wpe"      Positions             + wpe, embedding dropout
    2..L+1   "h.<i>"    Block × L             pre-LN attention + MLP, TP plan applied
    L+2      "ln_f"     FinalNorm             ln_f
    L+3      "lm_head"  TiedLayerSpec("wte")  LM head: logits = h Eᵀ on the local vocab block
    loss                LMLoss                fused vocab-parallel cross-entropy, HF label shift

``GPT2_TP_PLAN`` is the whole TP plan (HF suffix -> shard kind, applied by ``Family.tp_kind``);
``GPT2_LORA_PLAN`` shards the LoRA factors; :meth:`GPT2Family.init_rule` is GPT-2's / Megatron-LM's
weight initialisation:

    Linear / Conv1D / Embedding weights   W ~ N(0, std^2)                    (std = 0.02)
    residual output projections           W ~ N(0, (std / sqrt(2 * n_layer))^2)
        (``attn.c_proj.weight`` and ``mlp.c_proj.weight``: each of the 2 * n_layer
        residual branches adds to the stream, so their sum keeps variance ~ std^2)
    biases                                0
    LayerNorm                             weight 1, bias 0
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from transformers.activations import ACT2FN

from ds_mp.models.family import Family, lora_targeted
from ds_mp.models.partition import LayerCosts, balanced_blocks, stage_parts
from ds_mp.models.pipeline import (LAYER_COST_VERSION, Ctx, DsMpPipeline, LMLoss, attending_to, build_pipeline,
                                   hf_param_name, shift_labels)
from ds_mp.models.weights import LazyWeight, WeightSource, peft_to_hf_names
from ds_mp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp
from ds_mp.tensor_parallel.layers import embedding_lookup
from ds_mp.tensor_parallel.random import parallel_region_rng

# HF parameter name (suffix after "transformer." / "h.<i>.") -> how TP shards it.
GPT2_TP_PLAN: dict[str, str] = {
    "wte.weight": "vocab",
    "wpe.weight": "replicated",
    "ln_1.weight": "replicated", "ln_1.bias": "replicated",
    "attn.c_attn.weight": "qkv", "attn.c_attn.bias": "qkv",
    "attn.c_proj.weight": "row", "attn.c_proj.bias": "replicated",
    "ln_2.weight": "replicated", "ln_2.bias": "replicated",
    "mlp.c_fc.weight": "column", "mlp.c_fc.bias": "column",
    "mlp.c_proj.weight": "row", "mlp.c_proj.bias": "replicated",
    "ln_f.weight": "replicated", "ln_f.bias": "replicated",
}


# LoRA factors (``ds_mp.lora``), stored in the base's Conv1D layout (lora_A = Aᵀ: (in, r), lora_B = Bᵀ:
# (r, out)) and sharded consistently with it (ds_mp.tensor_parallel.lora).  Not part of an HF checkpoint,
# so kept apart from GPT2_TP_PLAN (whose keys are the HF files' tensors).
GPT2_LORA_PLAN: dict[str, str] = {
    "attn.c_attn.lora_A": "replicated", "attn.c_attn.lora_B": "qkv",
    "attn.c_proj.lora_A": "row", "attn.c_proj.lora_B": "replicated",
    "mlp.c_fc.lora_A": "replicated", "mlp.c_fc.lora_B": "column",
    "mlp.c_proj.lora_A": "row", "mlp.c_proj.lora_B": "replicated",
}


# Block submodule (ds_mp name) -> HF name inside ``transformer.h.<i>``.
BLOCK_RENAME: dict[str, str] = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj",
                                "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}



RESIDUAL_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.c_proj\.weight$")
LAYER_NORM = re.compile(r"(^|\.)ln_(1|2|f)\.weight$")
# Buffers older GPT-2 checkpoints carry (causal mask); recomputed by every implementation.
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


def pipeline_layers(n_layer: int) -> list[str]:
    """THE layer layout: the HF name prefix held by each pipeline layer, in pipeline order.

    ``["wte", "wpe", "h.0", …, "h.<L-1>", "ln_f", "lm_head"]``; the head holds no tensor
    of its own (it is ``wte``, tied), so HF names map to layers 0 … L+2.
    """
    return ["wte", "wpe", *(f"h.{i}" for i in range(n_layer)), "ln_f", "lm_head"]


def hf_config_from(shape: Any) -> Any:
    """A ``GPT2Config`` for an inline model shape (``ds_mp.config.InlineModel``)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                      vocab_size=shape.vocab_size, n_positions=shape.n_positions,
                      resid_pdrop=shape.dropout, embd_pdrop=shape.dropout, attn_pdrop=shape.dropout,
                      bos_token_id=0, eos_token_id=0)


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every GPT-2 parameter (HF name, HF order) and its full shape for the ``GPT2Config`` ``cfg``."""
    C, inner = cfg.n_embd, getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
    size = {"wte.weight": (cfg.vocab_size, C), "wpe.weight": (cfg.n_positions, C),
            "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C),
            "mlp.c_fc.weight": (C, inner), "mlp.c_fc.bias": (inner,), "mlp.c_proj.weight": (inner, C)}
    top, final = ("wte.weight", "wpe.weight"), ("ln_f.weight", "ln_f.bias")
    out = {f"transformer.{k}": size[k] for k in top}
    for i in range(cfg.n_layer):
        out.update({f"transformer.h.{i}.{k}": size.get(k, (C,)) for k in GPT2_TP_PLAN if k not in top + final})
    out.update({f"transformer.{k}": (C,) for k in final})
    return out


def init_rule(name: str, n_layer: int, std: float = 0.02) -> tuple[str, float]:
    """GPT-2's init of the HF parameter ``name``: ``("zeros"|"ones"|"normal", std)``."""
    if name.endswith(".bias") or name == "bias":
        return "zeros", 0.0
    if LAYER_NORM.search(name):
        return "ones", 0.0
    if RESIDUAL_PROJECTION.search(name):
        return "normal", std / math.sqrt(2 * n_layer)
    return "normal", std


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
        g, r, n = ctx.group, ctx.tp_rank, ctx.tp
        self.ctx, self.index = ctx, index
        self.ln_1 = _layer_norm(src, p + "ln_1", ctx)
        self.c_attn = _lora_layer(src, index, "attn.c_attn", ctx) or ColumnParallelLinear(
            src.lazy(p + "attn.c_attn.weight"), src.lazy(p + "attn.c_attn.bias"), g, r, n, kind="qkv",
            n_head=ctx.n_head, sequence_parallel=ctx.sp, overlap_comm=ctx.overlap_comm)
        self.attn_proj = _lora_layer(src, index, "attn.c_proj", ctx) or RowParallelLinear(
            src.lazy(p + "attn.c_proj.weight"), src.lazy(p + "attn.c_proj.bias"), g, r, n, sequence_parallel=ctx.sp)
        self.ln_2 = _layer_norm(src, p + "ln_2", ctx)
        self.c_fc = _lora_layer(src, index, "mlp.c_fc", ctx) or ColumnParallelLinear(
            src.lazy(p + "mlp.c_fc.weight"), src.lazy(p + "mlp.c_fc.bias"), g, r, n, kind="column",
            sequence_parallel=ctx.sp, overlap_comm=ctx.overlap_comm)
        self.mlp_proj = _lora_layer(src, index, "mlp.c_proj", ctx) or RowParallelLinear(
            src.lazy(p + "mlp.c_proj.weight"), src.lazy(p + "mlp.c_proj.bias"), g, r, n, sequence_parallel=ctx.sp)
        self.act = ACT2FN[ctx.hf.activation_function]
        self.n_head_local = ctx.n_head // n
        self.kv_extension: Any = None  # see attending_to

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3·nh_l·hs)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.n_head_local, -1).permute(2, 0, 3, 1, 4)  # (B, nh_l, T, hs)
        p = self.ctx.attn_dropout if self.training else 0.0
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


def _lora_layer(src: WeightSource, index: int, module: str, ctx: Ctx) -> nn.Module | None:
    """The LoRA variant of block ``index``'s ``module`` (``attn.c_attn`` …) when ``ctx.lora``
    targets it, else None.  Factors come from ``src`` when it holds them (a PEFT model), else
    PEFT's init from a generator seeded by (seed, block, module): identical on every rank."""
    from ds_mp.tensor_parallel.lora import LoRAColumnParallelLinear, LoRARowParallelLinear, lora_init

    lo = ctx.lora
    if lo is None or not lora_targeted(module, lo.target_modules):
        return None
    p = f"transformer.h.{index}.{module}"
    w, b = src.lazy(p + ".weight"), src.lazy(p + ".bias")  # the base: only this rank's shard is read
    if src.has(p + ".lora_A"):
        a, bb = src.get(p + ".lora_A").float(), src.get(p + ".lora_B").float()
    else:
        salt = list(BLOCK_RENAME.values()).index(module)
        fan_in, fan_out = param_shapes(src.config)[p + ".weight"]
        a, bb = lora_init(fan_in, fan_out, lo.r, torch.Generator().manual_seed(ctx.seed * 1000 + 4 * index + salt))
    kw = {"lora_A": a, "lora_B": bb, "scaling": lo.alpha / lo.r, "dropout": lo.dropout}
    kind = GPT2_TP_PLAN[module + ".weight"]
    if kind == "row":
        return LoRARowParallelLinear(w, b, ctx.group, ctx.tp_rank, ctx.tp, **kw)
    return LoRAColumnParallelLinear(w, b, ctx.group, ctx.tp_rank, ctx.tp, kind=kind, n_head=ctx.n_head, **kw)


class TokenEmbedding(nn.Module):
    """``wte`` (vocab-parallel); tied between the first stage (lookup) and the last (head)."""

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.wte = VocabParallelEmbedding(src.lazy("transformer.wte.weight"), ctx.group, ctx.tp_rank, ctx.tp,
                                          ctx.padded_vocab, sequence_parallel=ctx.sp,
                                          overlap_comm=ctx.overlap_comm)


def embed_forward(module: TokenEmbedding, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage: ``ids`` or ``(ids, positions)`` -> ``(wte(ids), positions)``."""
    ids, pos = inputs if isinstance(inputs, (tuple, list)) else (inputs, None)
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


class GPT2Family(Family):
    """GPT-2's tables (module docstring)."""

    name, model_types, architectures = "gpt2", ("gpt2",), ("GPT2LMHeadModel",)
    tp_plan, lora_plan = GPT2_TP_PLAN, GPT2_LORA_PLAN
    lora_modules = tuple(BLOCK_RENAME.values())
    lora_targets = ("c_attn", "c_proj", "c_fc", "attn.c_proj", "mlp.c_proj")
    lead_layers, tail_layers, block_prefix, fan_in_fan_out = 2, 2, "transformer.h.", True

    def config_class(self) -> Any:
        from transformers import GPT2Config

        return GPT2Config

    def config_from_dict(self, raw: dict) -> Any:
        return self.config_class().from_dict(raw)

    def model_class(self, cfg: Any) -> Any:
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel

    def check(self, cfg: Any) -> None:
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(cfg, flag, False):
                raise ValueError(f"GPT-2 option {flag}=True is not supported by ds_mp")
        if not getattr(cfg, "scale_attn_weights", True):
            raise ValueError("GPT-2 option scale_attn_weights=False is not supported by ds_mp")

    def dropouts(self, cfg: Any) -> tuple[float, float, float]:
        return cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop

    def inline_config(self, shape: Any) -> Any:
        return hf_config_from(shape)

    def pipeline_layers(self, cfg: Any) -> list[str]:
        return pipeline_layers(cfg.n_layer)

    def canonical_name(self, name: str) -> str:
        return name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name

    def layer_prefix(self, hf_name: str) -> str:
        rest = re.sub(r"^transformer\.", "", hf_name)
        return ".".join(rest.split(".")[:2]) if rest.startswith("h.") else rest.split(".")[0]

    def hf_param_name(self, module_name: str, layer_names: list[str]) -> str:
        head, rest = module_name.split(".", 1)
        if head == "tied_modules":  # tied_modules.wte.wte.weight
            return "transformer.wte.weight"
        prefix = layer_names[int(head)]
        if prefix == "wpe":
            return "transformer.wpe.weight"
        if prefix == "ln_f":
            return "transformer." + rest  # ln_f.weight
        first, tail = rest.split(".", 1)
        return f"transformer.{prefix}.{BLOCK_RENAME.get(first, first)}.{tail}"

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    def head_and_embedding(self) -> tuple[str, str]:
        return "lm_head.weight", "transformer.wte.weight"

    def ignored(self, key: str) -> bool:
        return bool(_IGNORED.match(key))

    def plan_key(self, hf_name: str) -> str:
        return re.sub(r"^(transformer\.)?(h\.\d+\.)?", "", hf_name)

    def linear_in_out(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        return weight_shape[0], weight_shape[1]  # Conv1D: (in, out)

    def init_rule(self, hf_name: str, cfg: Any, std: float = 0.02) -> tuple[str, float]:
        return init_rule(hf_name, cfg.n_layer, std)

    def block_parameters(self, cfg: Any) -> int:
        return 12 * cfg.n_embd * cfg.n_embd

    def layer_spec(self, prefix: str, src: WeightSource, ctx: Ctx) -> Any:
        if prefix == "wte":
            return TiedLayerSpec("wte", TokenEmbedding, src, ctx, forward_fn=embed_forward,
                                 tied_weight_attr=["wte.weight"])
        if prefix == "lm_head":
            return TiedLayerSpec("wte", TokenEmbedding, src, ctx, forward_fn=head_forward,
                                 tied_weight_attr=["wte.weight"])
        if prefix == "wpe":
            return LayerSpec(Positions, src, ctx)
        if prefix == "ln_f":
            return LayerSpec(FinalNorm, src, ctx)
        return LayerSpec(Block, src, int(prefix.split(".")[1]), ctx)


FAMILY = GPT2Family()
tp_kind = FAMILY.tp_kind  # shard kind of an HF GPT-2 parameter (or LoRA factor) name


def layer_index(hf_name: str, layers: list[str]) -> int:
    """Index in ``layers`` of the layer holding the HF GPT-2 parameter ``hf_name``."""
    return FAMILY.layer_index(hf_name, layers)


def build_gpt2_pipeline(src: WeightSource, topology: Any, **kw: Any) -> DsMpPipeline:
    """:func:`ds_mp.models.pipeline.build_pipeline` for a GPT-2 weight source."""
    return build_pipeline(src, topology, **kw)


GPT2Pipeline = DsMpPipeline  # the pipeline class (family-free since the Llama family)

__all__ = ["GPT2_TP_PLAN", "GPT2_LORA_PLAN", "FAMILY", "GPT2Family", "lora_targeted", "peft_to_hf_names", "tp_kind",
           "param_shapes", "pipeline_layers", "layer_index", "hf_param_name", "hf_config_from", "init_rule",
           "WeightSource", "LazyWeight", "build_gpt2_pipeline", "GPT2Pipeline", "Block", "attending_to", "LMLoss",
           "shift_labels", "stage_parts", "balanced_blocks", "LayerCosts", "Ctx", "LAYER_COST_VERSION"]
