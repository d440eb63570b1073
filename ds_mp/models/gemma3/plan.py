"""Gemma 3's plan (``Gemma3ForCausalLM``; the text model of a ``gemma3`` checkpoint): Llama's layer
table and TP cuts (``ds_mp.models.llama.plan``) with Gemma's differences:

* four RMSNorms per block (input, post-attention, pre- and post-feedforward), each ``(1 + w)``
  computed in fp32 (HF's ``Gemma3RMSNorm``; weights initialised to 0), replicated;
* per-head ``q_norm``/``k_norm`` over ``head_dim`` (replicated, gradient summed over TP: each rank
  sees its own heads, and with replicated key/value heads only the ones its queries read);
* ``head_dim`` of its own, scores scaled by ``query_pre_attn_scalar ** -0.5``;
* per-layer attention (``layer_types``): ``sliding_attention`` layers see the ``sliding_window``
  latest keys and rotate with ``rope_parameters["sliding_attention"]`` (``rope_local_base_freq``),
  ``full_attention`` layers see every earlier key with their own RoPE base (and scaling);
* the embedding scaled by ``sqrt(hidden_size)`` rounded to the weight's dtype, the vocabulary
  (262k in the released models) padded for TP like any other, the head tied unless the config says not;
* GELU-tanh (``hidden_activation``) gated MLP; ``final_logit_softcapping``: ``c · tanh(z / c)`` on the
  logits (elementwise, so on each rank's vocab block).
"""
from __future__ import annotations

from typing import Any

from ds_mp.models.llama.plan import LLAMA_LORA_PLAN, LLAMA_TP_PLAN, head_dim, linear_shape

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
GEMMA3_TP_PLAN: dict[str, str] = {**LLAMA_TP_PLAN, **{f"{n}.weight": "replicated" for n in NORMS}}
GEMMA3_LORA_PLAN: dict[str, str] = dict(LLAMA_LORA_PLAN)
LAYER_TYPES = ("sliding_attention", "full_attention")


def biases(cfg: Any) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP biases): ``attention_bias`` for the four attention linears."""
    attn = bool(getattr(cfg, "attention_bias", False))
    return attn, attn, False


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter (HF name, HF order) and its full shape; ``lm_head.weight`` only when untied."""
    C, V, hd = cfg.hidden_size, cfg.vocab_size, head_dim(cfg)
    bias = biases(cfg)[0]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, C)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            out[p + m + ".weight"] = linear_shape(cfg, m)
            if bias:
                out[p + m + ".bias"] = (linear_shape(cfg, m)[0],)
        out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (hd,)
        for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            out[p + m + ".weight"] = linear_shape(cfg, m)
        for n in NORMS:
            out[p + n + ".weight"] = (C,)
    out["model.norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    return out


__all__ = ["GEMMA3_TP_PLAN", "GEMMA3_LORA_PLAN", "NORMS", "LAYER_TYPES", "biases", "param_shapes"]
