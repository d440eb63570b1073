"""The GPT-2 family (``GPT2LMHeadModel``), one folder: ``plan.py`` (the layer table, the TP and LoRA
plans that build the layers and shard checkpoints, the init rule), ``layers.py`` (the layers),
``hf_adapter.py`` (HF names), and here :class:`GPT2Family`, which bundles them as the
:class:`~ds_mp.models.family.Family` that ``ds_mp.config.families`` registers for ``model_type`` gpt2.
"""
from __future__ import annotations

from typing import Any

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_mp.config.schema import ConfigError
from ds_mp.models.ctx import Ctx
from ds_mp.models.family import Family
from ds_mp.models.gpt2 import hf_adapter
from ds_mp.models.gpt2.hf_adapter import BLOCK_RENAME, hf_config_from
from ds_mp.models.gpt2.layers import Block, FinalNorm, Positions, TokenEmbedding, embed_forward, head_forward
from ds_mp.models.gpt2.plan import (GPT2_LORA_PLAN, GPT2_TP_PLAN, LINEARS, init_rule, param_shapes,
                                    pipeline_layers)
from ds_mp.models.weights import WeightSource


class GPT2Family(Family):
    """GPT-2's tables (``plan.py``), layers (``layers.py``) and names (``hf_adapter.py``)."""

    name = "gpt2"
    hf_adapter = hf_adapter  # HF names: canonical_name, layer_prefix, hf_name, plan_key, ignored
    tp_plan, lora_plan, lora_modules = GPT2_TP_PLAN, GPT2_LORA_PLAN, LINEARS
    lead_layers, tail_layers, block_prefix, fan_in_fan_out = 2, 2, "transformer.h.", True
    # Not the token lookup (fed token ids; a tied layer's forward is a partial, never in the list), so a
    # segment starting at it runs plainly (DeepSpeed's default checkpoints any segment with parameters)
    checkpointable = ("Block", "Positions", "FinalNorm")

    shape_keys = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")

    def shape_dropout(self, hf: dict) -> float:
        return hf.get("resid_pdrop", 0.1)

    def check_inline(self, shape: Any) -> None:
        if (shape.n_kv_head, shape.intermediate_size, shape.tie_word_embeddings) != (0, 0, True):
            raise ConfigError("ds_mp.model.model_type: n_kv_head, intermediate_size and tie_word_embeddings shape "
                              "other families' models; set model_type to llama, qwen2, mistral, qwen3 or gemma3_text, "
                              "or remove them")

    def cost_shape(self, cfg: Any) -> dict:
        return {"n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "vocab": cfg.vocab_size,
                "n_inner": getattr(cfg, "n_inner", None), "act": cfg.activation_function}

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
        if not getattr(cfg, "tie_word_embeddings", True):  # HF then trains lm_head apart from wte
            raise ValueError("GPT-2 option tie_word_embeddings=False (an lm_head of its own) is not supported by ds_mp, "
                             "whose GPT-2 head is wte; use a tied GPT-2 or a Llama-family model")

    def dropouts(self, cfg: Any) -> tuple[float, float, float]:
        return cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop

    def inline_config(self, shape: Any) -> Any:
        return hf_config_from(shape)

    def pipeline_layers(self, cfg: Any) -> list[str]:
        return pipeline_layers(cfg.n_layer)




    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    def head_and_embedding(self) -> tuple[str, str]:
        return "lm_head.weight", "transformer.wte.weight"



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


__all__ = ["GPT2_TP_PLAN", "GPT2_LORA_PLAN", "BLOCK_RENAME", "FAMILY", "GPT2Family", "tp_kind", "param_shapes",
           "pipeline_layers", "layer_index", "hf_config_from", "init_rule", "Block"]
