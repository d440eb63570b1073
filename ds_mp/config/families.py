"""The one family registry: HF ``model_type`` -> the ds_mp model family that trains it.

Config reads what it must know before any model is imported (the ``config.json`` keys of a shape,
the LoRA target names it accepts) from here; ``ds_mp.models.family.family_named`` imports the family's
package (``ds_mp/models/<family>/``, which defines ``FAMILY``) on first use, so reading a config
imports no model.  Adding a family: one folder under ``ds_mp/models/`` and one entry here per
``model_type`` it reads (docs/design.md, "How to add a model family").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyEntry:
    """One HF ``model_type`` ds_mp trains."""

    family: str  # the Family's name; its package is ds_mp.models.<family> unless ``module`` says otherwise
    architecture: str  # the HF …ForCausalLM class of this model_type (read, and written by an export)
    shape_keys: tuple[str, ...]  # config.json keys of n_layer, n_embd, n_head, vocab_size, n_positions
    lora_targets: tuple[str, ...]  # the PEFT-style ds_mp.lora.target_modules values accepted
    module: str = ""  # the module defining FAMILY (default ds_mp.models.<family>)

    @property
    def package(self) -> str:
        return self.module or f"ds_mp.models.{self.family}"


_GPT2_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
_GPT2_LORA = ("c_attn", "c_proj", "c_fc", "attn.c_proj", "mlp.c_proj")  # PEFT-style names of GPT-2's Conv1Ds
_LLAMA_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")
_LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # its nn.Linears

FAMILIES: dict[str, FamilyEntry] = {
    "gpt2": FamilyEntry("gpt2", "GPT2LMHeadModel", _GPT2_KEYS, _GPT2_LORA),
    "llama": FamilyEntry("llama", "LlamaForCausalLM", _LLAMA_KEYS, _LLAMA_LORA),
    "qwen2": FamilyEntry("llama", "Qwen2ForCausalLM", _LLAMA_KEYS, _LLAMA_LORA),
    "mistral": FamilyEntry("llama", "MistralForCausalLM", _LLAMA_KEYS, _LLAMA_LORA),
}


def model_types_of(family: str) -> tuple[str, ...]:
    """The ``model_type`` values the family named ``family`` trains, in registry order."""
    return tuple(t for t, e in FAMILIES.items() if e.family == family)


__all__ = ["FAMILIES", "FamilyEntry", "model_types_of"]
