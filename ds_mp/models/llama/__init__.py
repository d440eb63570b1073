"""The Llama family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``), one folder:
``plan.py`` (the layer table, the TP and LoRA plans that build the layers and shard checkpoints,
and the shapes), ``layers.py`` (the layers, reading the plan through ``ctx.family``),
``hf_adapter.py`` (HF names), and here :class:`LlamaFamily`, which bundles them as the
:class:`~ds_mp.models.family.Family` that ``ds_mp.config.families`` registers for ``model_type``
llama, qwen2 and mistral.
"""
from __future__ import annotations

from typing import Any

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_mp.models.ctx import Ctx
from ds_mp.models.family import Family
from ds_mp.models.llama import hf_adapter
from ds_mp.models.llama.layers import Block, FinalNorm, LMHead, TokenEmbedding, embed_forward, head_forward
from ds_mp.models.llama.plan import (COLUMN, LLAMA_LORA_PLAN, LLAMA_TP_PLAN, ROW, STATIC_ROPE, biases, head_dim,
                                     linear_shape, padding_idx, param_shapes, pipeline_layers)
from ds_mp.models.weights import WeightSource


class LlamaFamily(Family):
    """The Llama family's tables (module docstring); Qwen2 and Mistral are the same table."""

    name = "llama"
    hf_adapter = hf_adapter  # HF names: canonical_name, layer_prefix, hf_name, plan_key, ignored
    tp_plan, lora_plan = LLAMA_TP_PLAN, LLAMA_LORA_PLAN
    lora_modules = (*COLUMN[:3], ROW[0], *COLUMN[3:], ROW[1])  # HF order within a block
    lead_layers, tail_layers, block_prefix = 1, 2, "model.layers."
    checkpointable = ("Block", "FinalNorm", "LMHead")  # not the (untied) embedding: its input is token ids

    def model_class(self, cfg: Any) -> Any:
        import transformers

        return getattr(transformers, self.architecture(cfg))

    def inline_config(self, shape: Any) -> Any:
        return self.config_from_dict(shape.hf_dict())

    def check(self, cfg: Any) -> None:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE:
            raise ValueError(f"{cfg.model_type} rope_type {rope!r} is not supported by ds_mp (its frequencies change "
                             f"with the input); supported: {', '.join(STATIC_ROPE)}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{cfg.model_type} option use_sliding_window=True is not supported by ds_mp")
        pad, V = getattr(cfg, "pad_token_id", None), cfg.vocab_size
        if pad is not None and not -V <= pad < V:
            raise ValueError(f"{cfg.model_type} pad_token_id={pad} is not a row of the {V}-token embedding (HF's "
                             "padding_idx refuses it too); set pad_token_id to a token id below vocab_size, or null")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={cfg.num_key_value_heads}")

    def sliding_window(self, cfg: Any) -> int | None:
        """Mistral's ``sliding_window`` (HF applies it whenever it is set; Qwen2's is refused by check)."""
        return getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None

    def pipeline_layers(self, cfg: Any) -> list[str]:
        return pipeline_layers(cfg)



    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    head_dim, linear_shape, biases = staticmethod(head_dim), staticmethod(linear_shape), staticmethod(biases)
    padding_idx = staticmethod(padding_idx)

    def head_and_embedding(self) -> tuple[str, str]:
        return "lm_head.weight", "model.embed_tokens.weight"



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
           "biases", "padding_idx"]
