"""Gemma 3's layers: Llama's TP-cut linears, attention and MLP (``ds_mp.models.llama.layers``) with
Gemma's maths (``plan.py`` lists it): the ``(1 + w)`` RMSNorm, per-layer RoPE and window, the
``query_pre_attn_scalar`` score scale, four norms per block, the scaled embedding and soft-capped logits."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ds_mp.models.llama import layers as llama_layers
from ds_mp.models.ctx import Ctx
from ds_mp.models.llama.layers import RMSNorm, TokenEmbedding, embed_forward as llama_embed_forward
from ds_mp.models.weights import WeightSource


class GemmaRMSNorm(RMSNorm):
    """HF's ``Gemma3RMSNorm``: ``x / sqrt(mean(x²) + eps) · (1 + w)``, all in fp32, cast back last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.scale().float())).type_as(x)


class Attention(llama_layers.Attention):
    """Llama's attention with Gemma's q/k norms, score scale and this layer's window and RoPE."""

    norm_class = GemmaRMSNorm

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__(src, index, ctx)
        self.scale = ctx.hf.query_pre_attn_scalar ** -0.5
        self.windowed = ctx.hf.layer_types[index] == "sliding_attention"

    def rope(self, cfg: Any, index: int) -> tuple[torch.Tensor, float]:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        rope, kind = Gemma3RotaryEmbedding(cfg), cfg.layer_types[index]
        return getattr(rope, f"{kind}_inv_freq"), getattr(rope, f"{kind}_attention_scaling")


class MLP(llama_layers.MLP):
    @staticmethod
    def activation(cfg: Any) -> str:
        return cfg.hidden_activation  # gelu_pytorch_tanh


class Block(nn.Module):
    """``x + post_attn_norm(Attn(input_norm x))`` then ``+ post_ff_norm(MLP(pre_ff_norm ·))``."""

    is_block = True  # DsMpPipeline.blocks()

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        p = f"model.layers.{index}."
        self.ctx, self.index = ctx, index
        self.input_layernorm = GemmaRMSNorm(src, p + "input_layernorm.weight", ctx)
        self.self_attn = Attention(src, index, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(src, p + "post_attention_layernorm.weight", ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(src, p + "pre_feedforward_layernorm.weight", ctx)
        self.mlp = MLP(src, index, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(src, p + "post_feedforward_layernorm.weight", ctx)
        self.n_head_local = self.self_attn.n_kv_local  # heads of this block's TeraPipe cache entries
        self.kv_extension: Any = None

    _enter = llama_layers.Block._enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.post_attention_layernorm(self.self_attn(self._enter(h), h, self.kv_extension))
        h = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self.mlp(self._enter(h), h))


def embed_forward(module: TokenEmbedding, inputs: Any) -> torch.Tensor:
    """Llama's lookup (the pad row frozen) × ``sqrt(hidden_size)`` rounded to the weight's dtype (HF's)."""
    h = llama_embed_forward(module, inputs)
    scale = torch.tensor(module.ctx.hf.hidden_size ** 0.5).to(module.embed.weight.dtype)
    return h * scale.to(h.device)


def head_forward(module: TokenEmbedding, h: torch.Tensor) -> torch.Tensor:
    """Logits on the local vocab block, soft-capped as HF does when ``final_logit_softcapping`` is set."""
    logits = module.embed.logits(h)
    cap = module.ctx.hf.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Embedding(TokenEmbedding):
    def forward(self, inputs: Any) -> torch.Tensor:
        return embed_forward(self, inputs)


class LMHead(llama_layers.LMHead):
    """An untied ``lm_head.weight`` (vocab-parallel, never looked up), soft-capped as :func:`head_forward`."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return head_forward(self, h)


class FinalNorm(llama_layers.FinalNorm):
    norm_class = GemmaRMSNorm


__all__ = ["GemmaRMSNorm", "Attention", "MLP", "Block", "Embedding", "LMHead", "FinalNorm", "embed_forward",
           "head_forward"]
