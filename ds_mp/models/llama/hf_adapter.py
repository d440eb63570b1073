"""The Llama family's HF names: HF parameter name ↔ pipeline layer ↔ the name inside ds_mp's layer.
Names only: no tensor, no DeepSpeed naming (decoded in ``ds_mp.deepspeed_compat.pipeline_module``)."""
from __future__ import annotations

import re


def canonical_name(name: str) -> str:
    """The full HF name (Llama-family checkpoints store them whole)."""
    return name


def layer_prefix(hf_name: str) -> str:
    """The pipeline layer row (``layers.3``, ``embed_tokens``, ``norm``, ``lm_head``) holding ``hf_name``."""
    if hf_name == "lm_head.weight":
        return "lm_head"
    rest = hf_name.removeprefix("model.")
    return ".".join(rest.split(".")[:2]) if rest.startswith("layers.") else rest.split(".")[0]


def hf_name(prefix: str, name: str) -> str:
    """HF name of the parameter ``name`` of the layer of row ``prefix``: the token embedding (the tied
    head's parameters are the embedding row's) -> ``model.embed_tokens.weight``, the untied head ->
    ``lm_head.weight``, a block's ``self_attn.q_proj.weight`` -> ``model.layers.<i>.self_attn.q_proj.weight``."""
    if prefix in ("embed_tokens", "lm_head"):
        return "model.embed_tokens.weight" if prefix == "embed_tokens" else "lm_head.weight"
    if prefix == "norm":
        return "model.norm.weight"
    return f"model.{prefix}.{name}"


def plan_key(hf_name: str) -> str:
    """``hf_name`` without its block prefix (``self_attn.q_proj.weight``), as the plans key it."""
    return re.sub(r"^model\.layers\.\d+\.", "", hf_name)


def ignored(key: str) -> bool:
    return key.endswith("rotary_emb.inv_freq")  # older checkpoints store the (recomputed) buffer


__all__ = ["canonical_name", "layer_prefix", "hf_name", "plan_key", "ignored"]
