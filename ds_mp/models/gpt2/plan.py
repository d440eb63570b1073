"""GPT-2's plan: the one table that both builds its layers and shards its checkpoints.

The layer table (:func:`pipeline_layers`: pipeline layer ↔ HF name prefix ↔ the class built there,
``ds_mp.models.gpt2.layers``):

    0        "wte"      TiedLayerSpec("wte")  token embedding (vocab-parallel), tied with the head
    1        "wpe"      Positions             + wpe, embedding dropout
    2..L+1   "h.<i>"    Block × L             pre-LN attention + MLP, TP plan applied
    L+2      "ln_f"     FinalNorm             ln_f
    L+3      "lm_head"  TiedLayerSpec("wte")  LM head: logits = h Eᵀ on the local vocab block
    loss                LMLossSpec            fused vocab-parallel cross-entropy, HF label shift (ds_mp.losses)

``GPT2_TP_PLAN`` is the whole TP plan (HF suffix -> shard kind of :mod:`ds_mp.tensor_parallel.sharding`):
``Family.tp_kind`` applies it to checkpoints, and a block's linears are built from it (``row`` ->
``RowParallelLinear``, ``qkv``/``column`` -> ``ColumnParallelLinear`` of that kind: ``layers._linear``),
so changing a row changes both.  ``GPT2_LORA_PLAN`` shards the LoRA factors; :func:`init_rule` is
GPT-2's / Megatron-LM's weight initialisation:

    Linear / Conv1D / Embedding weights   W ~ N(0, std^2)                    (std = 0.02)
    residual output projections           W ~ N(0, (std / sqrt(2 * n_layer))^2)
        (``attn.c_proj.weight`` and ``mlp.c_proj.weight``: each of the 2 * n_layer
        residual branches adds to the stream, so their sum keeps variance ~ std^2)
    biases                                0
    LayerNorm                             weight 1, bias 0
"""
from __future__ import annotations

import math
import re
from typing import Any

# HF parameter name (suffix after "transformer." / "h.<i>.") -> how TP shards it.
GPT2_TP_PLAN: dict[str, str] = {
    "wte.weight": "vocab",
    "wpe.weight": "replicated",
    "ln_1.weight": "replicated", "ln_1.bias": "replicated",
    "attn.c_attn.weight": "qkv", "attn.c_attn.bias": "qkv",
    "attn.c_proj.weight": "row", "attn.c_proj.bias": "replicated",
    "ln_2.weight": "replicated", "ln_2.bias": "replicated",
    "mlp.c_fc.weight": "column", "mlp.c_fc.bias": "column",
    "mlp.c_proj.weight": "row", "mlp.c_proj.bias": "replicated",
    "ln_f.weight": "replicated", "ln_f.bias": "replicated",
}

# LoRA factors (``ds_mp.lora``), stored in the base's Conv1D layout (lora_A = Aᵀ: (in, r), lora_B = Bᵀ:
# (r, out)) and sharded consistently with it (ds_mp.tensor_parallel.lora).  Not part of an HF checkpoint,
# so kept apart from GPT2_TP_PLAN (whose keys are the HF files' tensors).
GPT2_LORA_PLAN: dict[str, str] = {
    "attn.c_attn.lora_A": "replicated", "attn.c_attn.lora_B": "qkv",
    "attn.c_proj.lora_A": "row", "attn.c_proj.lora_B": "replicated",
    "mlp.c_fc.lora_A": "replicated", "mlp.c_fc.lora_B": "column",
    "mlp.c_proj.lora_A": "row", "mlp.c_proj.lora_B": "replicated",
}

#: A block's linears (HF names, HF order): what LoRA may wrap, and the order of their LoRA init seeds.
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

RESIDUAL_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.c_proj\.weight$")
LAYER_NORM = re.compile(r"(^|\.)ln_(1|2|f)\.weight$")


def pipeline_layers(n_layer: int) -> list[str]:
    """THE layer layout: the HF name prefix held by each pipeline layer, in pipeline order.

    ``["wte", "wpe", "h.0", …, "h.<L-1>", "ln_f", "lm_head"]``; the head holds no tensor
    of its own (it is ``wte``, tied), so HF names map to layers 0 … L+2.
    """
    return ["wte", "wpe", *(f"h.{i}" for i in range(n_layer)), "ln_f", "lm_head"]


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every GPT-2 parameter (HF name, HF order) and its full shape for the ``GPT2Config`` ``cfg``."""
    C, inner = cfg.n_embd, getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
    size = {"wte.weight": (cfg.vocab_size, C), "wpe.weight": (cfg.n_positions, C),
            "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C),
            "mlp.c_fc.weight": (C, inner), "mlp.c_fc.bias": (inner,), "mlp.c_proj.weight": (inner, C)}
    top, final = ("wte.weight", "wpe.weight"), ("ln_f.weight", "ln_f.bias")
    out = {f"transformer.{k}": size[k] for k in top}
    for i in range(cfg.n_layer):
        out.update({f"transformer.h.{i}.{k}": size.get(k, (C,)) for k in GPT2_TP_PLAN if k not in top + final})
    out.update({f"transformer.{k}": (C,) for k in final})
    return out


def init_rule(name: str, n_layer: int, std: float = 0.02) -> tuple[str, float]:
    """GPT-2's init of the HF parameter ``name``: ``("zeros"|"ones"|"normal", std)``."""
    if name.endswith(".bias") or name == "bias":
        return "zeros", 0.0
    if LAYER_NORM.search(name):
        return "ones", 0.0
    if RESIDUAL_PROJECTION.search(name):
        return "normal", std / math.sqrt(2 * n_layer)
    return "normal", std


__all__ = ["GPT2_TP_PLAN", "GPT2_LORA_PLAN", "LINEARS", "RESIDUAL_PROJECTION", "LAYER_NORM", "pipeline_layers",
           "param_shapes", "init_rule"]
