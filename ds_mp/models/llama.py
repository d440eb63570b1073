"""The Llama family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``): its layer
table, TP and LoRA plans and init rule (its layers, which read the plans through ``ctx.family``:
``ds_mp.models.llama_layers``).

The layer table (:meth:`LlamaFamily.pipeline_layers`):

    0        "embed_tokens"  token embedding (vocab-parallel); TiedLayerSpec("embed") when tied
    1..L     "layers.<i>"    Block × L: x + Attn(RMSNorm x), then + MLP(RMSNorm ·), TP plan applied
    L+1      "norm"          FinalNorm (RMSNorm)
    L+2      "lm_head"       LM head on the local vocab block: the tied embedding, or ``lm_head.weight``
    loss                     LMLoss (ds_mp.models.pipeline)

Tensor parallelism (``LLAMA_TP_PLAN``; ``nn.Linear`` stores ``(out, in)``, cuts in
:mod:`ds_mp.tensor_parallel.sharding`): ``q_proj`` column-parallel per head (``linear_out``),
``k_proj``/``v_proj`` by key/value heads (``kv``) — split when TP divides the KV heads; otherwise
every rank holds all of them and uses the ones its query heads read (query head h reads KV head
``h // (n_head / n_kv_head)``), their weight (and bias) entering through ``copy_to_tp`` so autograd
sums each rank's partial gradient over TP (each rank back-propagates only its query heads'
share) — ``o_proj`` row-parallel, ``gate_proj``/``up_proj`` column, ``down_proj`` row,
vocab-parallel embedding and head (tied or not, as ``tie_word_embeddings`` says), RMSNorm and
rotary positions computed exactly as HF does (rotary is per head, so local).  Qwen2's q/k/v
biases (and Llama's ``attention_bias``/``mlp_bias``) follow their weights' cut; a row-parallel
bias is replicated and added once after the reduction.  Sequence parallelism: the residual
stream is split along the sequence between blocks; each block all-gathers on entry and
reduce-scatters on exit; RMSNorm weights see a slice of tokens and sum their gradient over TP.

Init rule (HF's ``_init_weights``): linear and embedding weights ~ N(0, initializer_range²),
biases 0, RMSNorm weights 1.
"""
from __future__ import annotations

import re
from typing import Any

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_mp.models.family import Family
from ds_mp.models.llama_layers import Block, FinalNorm, LMHead, TokenEmbedding, embed_forward, head_forward
from ds_mp.models.pipeline import Ctx
from ds_mp.models.weights import WeightSource

# HF parameter name (suffix after "model.layers.<i>.", or the full name outside blocks) -> how TP shards it.
LLAMA_TP_PLAN: dict[str, str] = {
    "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab", "model.norm.weight": "replicated",
    "input_layernorm.weight": "replicated", "post_attention_layernorm.weight": "replicated",
    "self_attn.q_proj.weight": "linear_out", "self_attn.q_proj.bias": "linear_out",
    "self_attn.k_proj.weight": "kv", "self_attn.k_proj.bias": "kv",
    "self_attn.v_proj.weight": "kv", "self_attn.v_proj.bias": "kv",
    "self_attn.o_proj.weight": "linear_in", "self_attn.o_proj.bias": "replicated",
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
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies do not change with the input


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
    """(q/k/v bias, o_proj bias, MLP biases) as HF builds them: Qwen2 has q/k/v biases, Llama's
    ``attention_bias`` / ``mlp_bias`` add them, Mistral has none."""
    attn = bool(getattr(cfg, "attention_bias", False))
    return cfg.model_type == "qwen2" or attn, attn and cfg.model_type == "llama", bool(getattr(cfg, "mlp_bias", False))


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
        out[p + "post_attention_layernorm.weight"] = (C,)
        for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            out[p + m + ".weight"] = linear_shape(cfg, m)
            if has_bias[m]:
                out[p + m + ".bias"] = (linear_shape(cfg, m)[0],)
    out["model.norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    return out


class LlamaFamily(Family):
    """The Llama family's tables (module docstring); Qwen2 and Mistral are the same table."""

    name, model_types = "llama", ("llama", "qwen2", "mistral")
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
    tp_plan, lora_plan = LLAMA_TP_PLAN, LLAMA_LORA_PLAN
    lora_modules = (*COLUMN[:3], ROW[0], *COLUMN[3:], ROW[1])  # HF order within a block
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lead_layers, tail_layers, block_prefix = 1, 2, "model.layers."
    checkpointable = ("Block", "FinalNorm", "LMHead")  # not the (untied) embedding: its input is token ids

    def model_class(self, cfg: Any) -> Any:
        import transformers

        return getattr(transformers, self.architecture(cfg))

    def architecture(self, cfg: Any) -> str:
        """The HF class of ``cfg`` (by ``model_type``): the one written to an exported ``config.json``."""
        return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[cfg.model_type]

    def inline_config(self, shape: Any) -> Any:
        return self.config_from_dict(shape.hf_dict())

    def check(self, cfg: Any) -> None:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in _STATIC_ROPE:
            raise ValueError(f"{cfg.model_type} rope_type {rope!r} is not supported by ds_mp (its frequencies change "
                             f"with the input); supported: {', '.join(_STATIC_ROPE)}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{cfg.model_type} option use_sliding_window=True is not supported by ds_mp")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={cfg.num_key_value_heads}")

    def sliding_window(self, cfg: Any) -> int | None:
        """Mistral's ``sliding_window`` (HF applies it whenever it is set; Qwen2's is refused by check)."""
        return getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None

    def pipeline_layers(self, cfg: Any) -> list[str]:
        return ["embed_tokens", *(f"layers.{i}" for i in range(cfg.num_hidden_layers)), "norm", "lm_head"]

    def layer_prefix(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight":
            return "lm_head"
        rest = hf_name.removeprefix("model.")
        return ".".join(rest.split(".")[:2]) if rest.startswith("layers.") else rest.split(".")[0]

    def hf_param_name(self, module_name: str, layer_names: list[str]) -> str:
        head, rest = module_name.split(".", 1)
        if head == "tied_modules":  # tied_modules.embed.embed.weight
            return "model.embed_tokens.weight"
        prefix = layer_names[int(head)]
        if prefix in ("embed_tokens", "lm_head"):
            return "model.embed_tokens.weight" if prefix == "embed_tokens" else "lm_head.weight"
        if prefix == "norm":
            return "model.norm.weight"
        return f"model.{prefix}.{rest}"

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    head_dim, linear_shape, biases = staticmethod(head_dim), staticmethod(linear_shape), staticmethod(biases)

    def head_and_embedding(self) -> tuple[str, str]:
        return "lm_head.weight", "model.embed_tokens.weight"

    def ignored(self, key: str) -> bool:
        return key.endswith("rotary_emb.inv_freq")  # older checkpoints store the (recomputed) buffer

    def plan_key(self, hf_name: str) -> str:
        return re.sub(r"^model\.layers\.\d+\.", "", hf_name)

    def heads(self, hf_name: str, cfg: Any) -> int:
        return cfg.num_key_value_heads if self.tp_kind(hf_name) == "kv" else cfg.num_attention_heads

    def linear_in_out(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        return weight_shape[1], weight_shape[0]  # nn.Linear: (out, in)

    def init_rule(self, hf_name: str, cfg: Any, std: float = 0.02) -> tuple[str, float]:
        if hf_name.endswith(".bias"):
            return "zeros", 0.0
        if hf_name.endswith("norm.weight"):
            return "ones", 0.0
        return "normal", cfg.initializer_range

    def block_parameters(self, cfg: Any) -> int:
        return sum(o * i for o, i in (linear_shape(cfg, m) for m in (*COLUMN, *ROW)))

    def layer_spec(self, prefix: str, src: WeightSource, ctx: Ctx) -> Any:
        tied = ctx.hf.tie_word_embeddings
        if prefix == "embed_tokens":
            return (TiedLayerSpec("embed", TokenEmbedding, src, ctx, forward_fn=embed_forward,
                                  tied_weight_attr=["embed.weight"]) if tied else LayerSpec(TokenEmbedding, src, ctx))
        if prefix == "lm_head":
            return (TiedLayerSpec("embed", TokenEmbedding, src, ctx, forward_fn=head_forward,
                                  tied_weight_attr=["embed.weight"]) if tied else LayerSpec(LMHead, src, ctx))
        if prefix == "norm":
            return LayerSpec(FinalNorm, src, ctx)
        return LayerSpec(Block, src, int(prefix.split(".")[1]), ctx)


FAMILY = LlamaFamily()

__all__ = ["LLAMA_TP_PLAN", "LLAMA_LORA_PLAN", "FAMILY", "LlamaFamily", "param_shapes", "head_dim", "linear_shape",
           "biases"]
