"""The Gemma 3 family (``Gemma3ForCausalLM``, model_type ``gemma3_text``; and the text model of a
multimodal ``gemma3`` checkpoint, ``Gemma3ForConditionalGeneration``, whose ``config.json`` nests it
under ``text_config`` and whose weights sit under ``model.language_model.``), one folder: ``plan.py``
(the tables: Llama's with Gemma's norms), ``layers.py`` (Gemma's maths on Llama's TP layers),
``hf_adapter.py`` (HF names), and here :class:`Gemma3Family`.  A ``gemma3`` checkpoint trains and
exports as ``Gemma3ForCausalLM`` (its text model; the vision tower is not read).

Refused in one line: ``attn_logit_softcapping`` (SDPA has no score cap), bidirectional attention,
a ``layer_types`` entry other than sliding/full attention, a RoPE type whose frequencies change with
the input (Llama's rule), a ``pad_token_id`` outside the vocabulary.
"""
from __future__ import annotations

from typing import Any


from ds_mp.models.family import Family
from ds_mp.models.gemma3 import hf_adapter
from ds_mp.models.gemma3.layers import Block, Embedding, FinalNorm, LMHead, embed_forward, head_forward
from ds_mp.models.gemma3.plan import GEMMA3_LORA_PLAN, GEMMA3_TP_PLAN, LAYER_TYPES, biases, param_shapes
from ds_mp.models.llama import LlamaFamily
from ds_mp.models.llama.plan import STATIC_ROPE


class Gemma3Family(LlamaFamily):
    """Gemma 3's tables (``plan.py``), layers and names; Llama's where they are the same."""

    name = "gemma3"
    hf_adapter = hf_adapter
    tp_plan, lora_plan = GEMMA3_TP_PLAN, GEMMA3_LORA_PLAN
    biases = staticmethod(biases)

    def text_config(self, raw: dict) -> dict:
        """A ``gemma3`` config.json's ``text_config`` (as ``gemma3_text``); a ``gemma3_text`` one as it is."""
        if raw.get("model_type") != "gemma3":
            return raw
        return {**(raw.get("text_config") or {}), "model_type": "gemma3_text"}

    def config_from_dict(self, raw: dict) -> Any:
        from transformers import Gemma3TextConfig

        raw = {k: v for k, v in self.text_config(raw).items() if k != "model_type"}
        return Gemma3TextConfig(**raw)

    def model_class(self, cfg: Any) -> Any:
        from transformers import Gemma3ForCausalLM

        return Gemma3ForCausalLM

    def inline_hf(self, shape: Any) -> dict:
        hd = shape.n_embd // shape.n_head
        return {**super().inline_hf(shape), "model_type": "gemma3_text", "query_pre_attn_scalar": hd,
                "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}

    def check(self, cfg: Any) -> None:
        for key in ("attn_logit_softcapping",):
            if getattr(cfg, key, None) is not None:
                raise ValueError(f"gemma3 option {key}={getattr(cfg, key)} is not supported by ds_mp (SDPA has no "
                                 f"score cap); set it null")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("gemma3 option use_bidirectional_attention=True is not supported by ds_mp (a causal "
                             "LM); set it false")
        odd = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
        if odd:
            raise ValueError(f"gemma3 layer_types {odd} are not supported by ds_mp; use {' or '.join(LAYER_TYPES)}")
        for kind in sorted(set(cfg.layer_types)):
            rope = cfg.rope_parameters[kind].get("rope_type", "default")
            if rope not in STATIC_ROPE:
                raise ValueError(f"gemma3 rope_parameters[{kind!r}] rope_type {rope!r} is not supported by ds_mp "
                                 f"(its frequencies change with the input); supported: {', '.join(STATIC_ROPE)}")
        self.check_pad_and_heads(cfg)

    def sliding_window(self, cfg: Any) -> int | None:
        """The window of the ``sliding_attention`` layers (None when every layer is full attention)."""
        return cfg.sliding_window if "sliding_attention" in cfg.layer_types else None

    def qk_norm(self, cfg: Any) -> bool:
        return True

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    def init_rule(self, hf_name: str, cfg: Any, std: float = 0.02) -> tuple[str, float]:
        if hf_name.endswith("norm.weight"):  # (1 + w): HF initialises w to 0
            return "zeros", 0.0
        return super().init_rule(hf_name, cfg, std)

    cost_shape = Family.cost_shape  # every config entry (Llama's short list lacks Gemma's)

    embedding_class, head_class, norm_class, block_class = Embedding, LMHead, FinalNorm, Block
    embed_forward = staticmethod(embed_forward)
    head_forward = staticmethod(head_forward)


FAMILY = Gemma3Family()

__all__ = ["FAMILY", "Gemma3Family"]
