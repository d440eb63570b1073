"""Gemma 3's HF names: Llama's (``model.layers.<i>.…``, ``model.norm``, ``lm_head``), read also from a
multimodal ``gemma3`` checkpoint, whose text model is stored under ``language_model.model.`` (the
released checkpoints and transformers' save) or ``model.language_model.`` (transformers 5's module
names) beside a vision tower and projector ds_mp does not train (ignored when reading).  Names only."""
from __future__ import annotations

from ds_mp.models.llama.hf_adapter import hf_name, layer_prefix, plan_key

# a Gemma3ForConditionalGeneration checkpoint's text model: stored prefix -> Gemma3ForCausalLM's
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
NOT_TEXT = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def canonical_name(name: str) -> str:
    """The Gemma3ForCausalLM name (``language_model.model.layers.0…`` -> ``model.layers.0…``)."""
    for stored, ours in TEXT_PREFIXES.items():
        if name.startswith(stored):
            return ours + name.removeprefix(stored)
    return name


def ignored(key: str) -> bool:
    """The vision tower and projector of a multimodal checkpoint, and recomputed rotary buffers."""
    return key.startswith(NOT_TEXT) or key.endswith("inv_freq")


__all__ = ["canonical_name", "layer_prefix", "hf_name", "plan_key", "ignored"]
