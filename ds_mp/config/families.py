"""The one family registry: HF ``model_type`` -> the ds_mp model family that trains it.

Each entry names the family's package (``ds_mp/models/<family>/``, which defines ``FAMILY``),
imported on first use by :func:`family_for` (by name, as ``registry.py`` imports a schedule's spec):
the family reads its own ``config.json`` (its shape, dropouts, RoPE, windows, a multimodal
checkpoint's text config) and answers the config checks it needs (``Family.shape``,
``check_inline``, ``check_shape``, ``check_run``), so config validation names no family's keys.
Adding a family: one folder under ``ds_mp/models/`` and one entry here per ``model_type`` it reads
(docs/design.md, "How to add a model family").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FamilyEntry:
    """One HF ``model_type`` ds_mp trains."""

    family: str  # the Family's name; its package is ds_mp.models.<family> unless ``module`` says otherwise
    architecture: str  # the HF …ForCausalLM class of this model_type (read, and written by an export)
    lora_targets: tuple[str, ...]  # the PEFT-style ds_mp.lora.target_modules values accepted
    module: str = ""  # the module defining FAMILY (default ds_mp.models.<family>)
    lora_parameters: tuple[str, ...] = ()  # the PEFT-style ds_mp.lora.target_parameters values accepted

    @property
    def package(self) -> str:
        return self.module or f"ds_mp.models.{self.family}"


_GPT2_LORA = ("c_attn", "c_proj", "c_fc", "attn.c_proj", "mlp.c_proj")  # PEFT-style names of GPT-2's Conv1Ds
_LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # its nn.Linears
_MOE_LORA = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention's linears; the experts are fused 3-D tensors:
# PEFT's target_parameters names them (ParamWrapper), as a parameter's full name or a dotted suffix of it
_MOE_EXPERTS = tuple(f"{p}{t}_proj" for t in ("gate_up", "down") for p in ("mlp.experts.", "experts.", ""))

FAMILIES: dict[str, FamilyEntry] = {
    "gpt2": FamilyEntry("gpt2", "GPT2LMHeadModel", _GPT2_LORA),
    "llama": FamilyEntry("llama", "LlamaForCausalLM", _LLAMA_LORA),
    "qwen2": FamilyEntry("llama", "Qwen2ForCausalLM", _LLAMA_LORA),
    "mistral": FamilyEntry("llama", "MistralForCausalLM", _LLAMA_LORA),
    "qwen3": FamilyEntry("llama", "Qwen3ForCausalLM", _LLAMA_LORA),
    "gemma3_text": FamilyEntry("gemma3", "Gemma3ForCausalLM", _LLAMA_LORA),
    "gemma3": FamilyEntry("gemma3", "Gemma3ForConditionalGeneration", _LLAMA_LORA),  # its text model
    "qwen3_moe": FamilyEntry("moe", "Qwen3MoeForCausalLM", _MOE_LORA, lora_parameters=_MOE_EXPERTS),
    "mixtral": FamilyEntry("moe", "MixtralForCausalLM", _MOE_LORA, lora_parameters=_MOE_EXPERTS),
    "qwen2_moe": FamilyEntry("moe", "Qwen2MoeForCausalLM", _MOE_LORA, lora_parameters=_MOE_EXPERTS),
}


#: what the registry trains, for people (errors name it beside the model_type values)
TRAINED = "GPT-2, Llama, Qwen2, Mistral, Qwen3, Gemma 3, Qwen3-MoE, Mixtral and Qwen2-MoE"


def model_types_of(family: str) -> tuple[str, ...]:
    """The ``model_type`` values the family named ``family`` trains, in registry order."""
    return tuple(t for t, e in FAMILIES.items() if e.family == family)


def family_for(model_type: str) -> Any:
    """The ``Family`` registered for the HF ``model_type`` (its package imported on first use);
    ``ValueError`` naming the model types ds_mp knows for any other."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a model family ds_mp knows; it trains {TRAINED} "
                         f"(model_type {', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[model_type].package).FAMILY


__all__ = ["FAMILIES", "FamilyEntry", "TRAINED", "family_for", "model_types_of"]
