"""The Llama family's plan: the one table that both builds its layers (``layers.py`` reads it through
``ctx.family``) and shards its checkpoints (``Family.tp_kind``), and the shapes it is applied to.
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` and ``Qwen3ForCausalLM`` share it
(Qwen3 adds ``q_norm``/``k_norm``, RMSNorms over ``head_dim`` applied to each head before the rotation).

The layer table (:func:`pipeline_layers`):

    0        "embed_tokens"  token embedding (vocab-parallel); TiedLayerSpec("embed") when tied
    1..L     "layers.<i>"    Block × L: x + Attn(RMSNorm x), then + MLP(RMSNorm ·), TP plan applied
    L+1      "norm"          FinalNorm (RMSNorm)
    L+2      "lm_head"       LM head on the local vocab block: the tied embedding, or ``lm_head.weight``
    loss                     the run's LossSpec (ds_mp.losses; LMLossSpec by default)

Tensor parallelism (``LLAMA_TP_PLAN``; ``nn.Linear`` stores ``(out, in)``, cuts in
:mod:`ds_mp.tensor_parallel.sharding`): ``q_proj`` column-parallel per head (``linear_out``),
``k_proj``/``v_proj`` by key/value heads (``kv``) — split when TP divides the KV heads; otherwise
every rank holds all of them and uses the ones its query heads read (query head h reads KV head
``h // (n_head / n_kv_head)``), their weight (and bias) entering through ``copy_to_tp`` so autograd
sums each rank's partial gradient over TP (each rank back-propagates only its query heads'
share) — ``o_proj`` row-parallel, ``gate_proj``/``up_proj`` column, ``down_proj`` row,
vocab-parallel embedding and head (tied or not, as ``tie_word_embeddings`` says), RMSNorm and
rotary positions computed exactly as HF does (rotary is per head, so local).  Qwen3's q/k norms
are replicated and see only this rank's heads: their weight enters through ``copy_to_tp``, so
autograd sums their gradient over TP and every copy stays identical (a replicated KV head's
k_norm share likewise: each rank back-propagates only the heads its queries read).  Qwen2's q/k/v
biases (and Llama's ``attention_bias``/``mlp_bias``) follow their weights' cut; a row-parallel
bias is replicated and added once after the reduction.  Sequence parallelism: the residual
stream is split along the sequence between blocks; each block all-gathers on entry and
reduce-scatters on exit; RMSNorm weights see a slice of tokens and sum their gradient over TP.

Init rule (HF's ``_init_weights``): linear and embedding weights ~ N(0, initializer_range²),
biases 0, RMSNorm weights 1.
"""
from __future__ import annotations

from typing import Any

# HF parameter name (suffix after "model.layers.<i>.", or the full name outside blocks) -> how TP shards it.
LLAMA_TP_PLAN: dict[str, str] = {
    "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab", "model.norm.weight": "replicated",
    "input_layernorm.weight": "replicated", "post_attention_layernorm.weight": "replicated",
    "self_attn.q_proj.weight": "linear_out", "self_attn.q_proj.bias": "linear_out",
    "self_attn.k_proj.weight": "kv", "self_attn.k_proj.bias": "kv",
    "self_attn.v_proj.weight": "kv", "self_attn.v_proj.bias": "kv",
    "self_attn.o_proj.weight": "linear_in", "self_attn.o_proj.bias": "replicated",
    "self_attn.q_norm.weight": "replicated", "self_attn.k_norm.weight": "replicated",
    "mlp.gate_proj.weight": "linear_out", "mlp.gate_proj.bias": "linear_out",
    "mlp.up_proj.weight": "linear_out", "mlp.up_proj.bias": "linear_out",
    "mlp.down_proj.weight": "linear_in", "mlp.down_proj.bias": "replicated",
}
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
# LoRA factors in ds_mp's layout (lora_A = Aᵀ (in, r), lora_B = Bᵀ (r, out)): a column-parallel base
# splits lora_B along out, a row-parallel base splits lora_A along in (ds_mp.tensor_parallel.lora).
LLAMA_LORA_PLAN: dict[str, str] = {**{f"{m}.lora_A": "replicated" for m in COLUMN},
                                   **{f"{m}.lora_B": "column" for m in COLUMN},
                                   **{f"{m}.lora_A": "row" for m in ROW}, **{f"{m}.lora_B": "replicated" for m in ROW}}
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies do not change with the input


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def linear_shape(cfg: Any, module: str) -> tuple[int, int]:
    """``(out, in)`` of a block's linear ``module`` (``self_attn.q_proj`` …), as ``nn.Linear`` stores it."""
    C, hd, inner = cfg.hidden_size, head_dim(cfg), cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"self_attn.q_proj": (q, C), "self_attn.k_proj": (kv, C), "self_attn.v_proj": (kv, C),
            "self_attn.o_proj": (C, q), "mlp.gate_proj": (inner, C), "mlp.up_proj": (inner, C),
            "mlp.down_proj": (C, inner)}[module]


def biases(cfg: Any) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP biases) as HF builds them: Llama reads ``attention_bias`` (q/k/v
    and o) and ``mlp_bias``; Qwen3 ``attention_bias`` (q/k/v and o); Qwen2 always has q/k/v biases and
    nothing else; Mistral has none.  A config carrying a flag its class does not read is read as HF
    reads it: ignored."""
    attn = bool(getattr(cfg, "attention_bias", False))
    if cfg.model_type == "llama":
        return attn, attn, bool(getattr(cfg, "mlp_bias", False))
    if cfg.model_type == "qwen3":
        return attn, attn, False
    return cfg.model_type == "qwen2", False, False


def qk_norm(cfg: Any) -> bool:
    """Qwen3 normalises each head's queries and keys (``q_norm``, ``k_norm`` over ``head_dim``)."""
    return cfg.model_type == "qwen3"


def padding_idx(cfg: Any) -> int | None:
    """The embedding row HF never updates: ``nn.Embedding(V, C, padding_idx=pad_token_id)``, a negative
    id counting from the end (``-1`` is row V − 1, as in Llama-1-era configs); None without a pad id.
    An id outside ``[-V, V)`` is refused by :meth:`LlamaFamily.check` (HF cannot build that model)."""
    pad = getattr(cfg, "pad_token_id", None)
    return None if pad is None else pad % cfg.vocab_size


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter (HF name, HF order) and its full shape; ``lm_head.weight`` only when untied."""
    C, V = cfg.hidden_size, cfg.vocab_size
    qkv_bias, o_bias, mlp_bias = biases(cfg)
    has_bias = {**dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv_bias),
                "self_attn.o_proj": o_bias, **dict.fromkeys(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), mlp_bias)}
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, C)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (C,)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            out[p + m + ".weight"] = linear_shape(cfg, m)
            if has_bias[m]:
                out[p + m + ".bias"] = (linear_shape(cfg, m)[0],)
        if qk_norm(cfg):
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (head_dim(cfg),)
        out[p + "post_attention_layernorm.weight"] = (C,)
        for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            out[p + m + ".weight"] = linear_shape(cfg, m)
            if has_bias[m]:
                out[p + m + ".bias"] = (linear_shape(cfg, m)[0],)
    out["model.norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    return out


def pipeline_layers(cfg: Any) -> list[str]:
    """The layer table: ``["embed_tokens", "layers.0", …, "norm", "lm_head"]``."""
    return ["embed_tokens", *(f"layers.{i}" for i in range(cfg.num_hidden_layers)), "norm", "lm_head"]


__all__ = ["LLAMA_TP_PLAN", "LLAMA_LORA_PLAN", "COLUMN", "ROW", "STATIC_ROPE", "head_dim", "linear_shape", "biases",
           "qk_norm",
           "padding_idx", "param_shapes", "pipeline_layers"]
