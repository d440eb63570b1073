"""GPT-2's HF names: HF parameter name ↔ pipeline layer ↔ the name inside ds_mp's layer, and the
``GPT2Config`` of an inline shape.  Names only: no tensor, no DeepSpeed naming (decoded in
``ds_mp.deepspeed_compat.pipeline_module``)."""
from __future__ import annotations

import re
from typing import Any

# Block submodule (ds_mp name) -> HF name inside ``transformer.h.<i>``.
BLOCK_RENAME: dict[str, str] = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj",
                                "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}

# Buffers older GPT-2 checkpoints carry (causal mask); recomputed by every implementation.
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


def hf_config_from(shape: Any) -> Any:
    """A ``GPT2Config`` for an inline model shape (``ds_mp.config.InlineModel``)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                      vocab_size=shape.vocab_size, n_positions=shape.n_positions,
                      resid_pdrop=shape.dropout, embd_pdrop=shape.dropout, attn_pdrop=shape.dropout,
                      bos_token_id=0, eos_token_id=0)


def canonical_name(name: str) -> str:
    """The full HF name (GPT-2 checkpoints also store names without ``transformer.``)."""
    return name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name


def layer_prefix(hf_name: str) -> str:
    """The pipeline layer row (``h.3``, ``wte``, ``ln_f``) holding the HF parameter ``hf_name``."""
    rest = re.sub(r"^transformer\.", "", hf_name)
    return ".".join(rest.split(".")[:2]) if rest.startswith("h.") else rest.split(".")[0]


def hf_name(prefix: str, name: str) -> str:
    """HF name of the parameter ``name`` of the layer of row ``prefix`` (``("h.3", "attn_proj.weight")``
    -> ``transformer.h.3.attn.c_proj.weight``; the tied embedding/head's ``wte.weight`` -> ``transformer.wte.weight``)."""
    if prefix in ("wte", "lm_head"):
        return "transformer.wte.weight"
    if prefix == "wpe":
        return "transformer.wpe.weight"
    if prefix == "ln_f":
        return "transformer." + name  # ln_f.weight
    first, tail = name.split(".", 1)
    return f"transformer.{prefix}.{BLOCK_RENAME.get(first, first)}.{tail}"


def plan_key(hf_name: str) -> str:
    """``hf_name`` without ``transformer.`` and its block prefix, as the plans key it."""
    return re.sub(r"^(transformer\.)?(h\.\d+\.)?", "", hf_name)


def ignored(key: str) -> bool:
    return bool(_IGNORED.match(key))


__all__ = ["BLOCK_RENAME", "hf_config_from", "canonical_name", "layer_prefix", "hf_name", "plan_key", "ignored"]
