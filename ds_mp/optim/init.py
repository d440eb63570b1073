"""GPT-2 / Megatron-LM weight initialisation, applied by parameter name.

    Linear / Conv1D / Embedding weights   W ~ N(0, std^2)                    (std = 0.02)
    residual output projections           W ~ N(0, (std / sqrt(2 * n_layer))^2)
        (``attn.c_proj.weight`` and ``mlp.c_proj.weight``: each of the 2 * n_layer
        residual branches adds to the stream, so their sum keeps variance ~ std^2)
    biases                                0
    LayerNorm                             weight 1, bias 0

Works on an HF ``GPT2LMHeadModel`` (tied ``lm_head.weight`` is ``wte.weight`` and is
initialised once) and on anything whose parameter names follow GPT-2's, e.g. a model
after tensor-parallel layer replacement.

Layout-free fresh weights (:func:`fresh_source`): each tensor is drawn by HF name from its
own seeded streams, one per block of :data:`ROWS_PER_DRAW` rows (seed = hash(seed, name,
block)), so the same seed gives the same full tensors whatever the TP × PP layout, and a
rank creates only the rows it keeps (``row``/``vocab`` shards) or one row block at a time
(``column``/``qkv`` shards): no full model, and no full tensor of the big matrices.
``init_gpt2_weights(model, n_layer, seed=s)`` applies the same draws to a whole HF model.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import torch
from torch import nn

from ds_mp.models.gpt2 import WeightSource, param_shapes
from ds_mp.tensor_parallel.sharding import read_shard

__all__ = ["RESIDUAL_PROJECTION", "init_gpt2_weights", "init_rule", "fresh_tensor", "fresh_source"]

RESIDUAL_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.c_proj\.weight$")
LAYER_NORM = re.compile(r"(^|\.)ln_(1|2|f)\.weight$")
ROWS_PER_DRAW = 64  # rows per seeded stream of a fresh tensor (fixed: part of the init's definition)


def init_rule(name: str, n_layer: int, std: float = 0.02) -> tuple[str, float]:
    """GPT-2's init of the HF parameter ``name``: ``("zeros"|"ones"|"normal", std)``."""
    if name.endswith(".bias") or name == "bias":
        return "zeros", 0.0
    if LAYER_NORM.search(name):
        return "ones", 0.0
    if RESIDUAL_PROJECTION.search(name):
        return "normal", std / math.sqrt(2 * n_layer)
    return "normal", std


def _stream_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fresh_tensor(name: str, shape: tuple[int, ...], seed: int, n_layer: int, std: float = 0.02,
                 dim: int = 0, lo: int = 0, hi: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index range ``[lo, hi)`` along ``dim`` of the fresh fp32 tensor ``name`` (whole by default),
    written into ``out`` when given (a view of that shape), else into a new tensor; returned.

    Rows (dim 0) come in blocks of :data:`ROWS_PER_DRAW`, each drawn from its own stream, so
    any row range is produced without the others; each block's part of the range is copied
    into place as it is drawn (peak: the range plus one block)."""
    rule, sd = init_rule(name, n_layer, std)
    hi = shape[dim] if hi is None else hi
    out_shape = list(shape)
    out_shape[dim] = hi - lo
    out = torch.empty(out_shape) if out is None else out
    if rule != "normal":
        return out.fill_(0.0 if rule == "zeros" else 1.0)
    rows = (lo, hi) if dim == 0 else (0, shape[0])
    for b in range(rows[0] // ROWS_PER_DRAW, -(-rows[1] // ROWS_PER_DRAW)):
        b_lo, b_hi = b * ROWS_PER_DRAW, min((b + 1) * ROWS_PER_DRAW, shape[0])
        g = torch.Generator().manual_seed(_stream_seed(seed, name, b))
        block = torch.empty((b_hi - b_lo, *shape[1:])).normal_(0.0, sd, generator=g)
        r_lo, r_hi = max(rows[0], b_lo), min(rows[1], b_hi)
        part = block[r_lo - b_lo: r_hi - b_lo]
        out[r_lo - rows[0]: r_hi - rows[0]] = part if dim == 0 else part.narrow(dim, lo, hi - lo)
    return out


def fresh_source(hf_config: Any, seed: int, std: float = 0.02) -> WeightSource:
    """A :class:`WeightSource` of GPT-2's init for ``hf_config``, layout-free (see module
    docstring): ``get`` creates one full tensor, ``get_shard`` only the shard's ranges."""
    shapes = param_shapes(hf_config)
    L = hf_config.n_layer

    def full_name(name: str) -> str:
        name = name if name.startswith("transformer.") else "transformer." + name
        if name not in shapes:
            raise KeyError(f"{name!r} is not a parameter of this GPT-2 config")
        return name

    def get(name: str) -> torch.Tensor:
        name = full_name(name)
        return fresh_tensor(name, shapes[name], seed, L, std)

    def get_shard(name: str, kind: str, rank: int, size: int, **meta: int) -> torch.Tensor:
        name = full_name(name)
        return read_shard(lambda d, lo, hi, out: fresh_tensor(name, shapes[name], seed, L, std, d, lo, hi, out),
                          shapes[name], kind, rank, size, **meta)

    return WeightSource(get, hf_config, get_shard)


@torch.no_grad()
def init_gpt2_weights(model: nn.Module, n_layer: int, std: float = 0.02,
                      generator: torch.Generator | None = None, seed: int | None = None) -> dict[str, str]:
    """Re-initialise every parameter of ``model`` in place (see module docstring).

    Args:
        model: a GPT-2 style model (HF ``GPT2LMHeadModel`` or ``GPT2Model``).
        n_layer: number of transformer blocks (scales the residual projections).
        std: standard deviation of the ordinary weights.
        generator: optional RNG for reproducible draws (one stream over the whole model).
        seed: instead of ``generator``, the layout-free per-name draws of :func:`fresh_tensor`
            (what ``ds_mp.initialize`` creates for a fresh model with ``training.seed``).

    Returns:
        ``{parameter name: rule}`` with rule one of ``"normal(std)"``,
        ``"normal(std/sqrt(2L))"``, ``"zeros"``, ``"ones"`` — what was done to each.
    """
    if n_layer < 1:
        raise ValueError(f"init_gpt2_weights: n_layer must be >= 1, got {n_layer}")
    residual_std = std / math.sqrt(2 * n_layer)
    layer_norm_params = {id(p) for mod in model.modules() if isinstance(mod, nn.LayerNorm)
                         for p in mod.parameters(recurse=False)}
    plan: dict[str, str] = {}
    for name, p in model.named_parameters():          # tied weights appear once
        if seed is not None:
            hf = name if name.startswith("transformer.") else "transformer." + name
            p.copy_(fresh_tensor(hf, tuple(p.shape), seed, n_layer, std))
            rule = init_rule(hf, n_layer, std)[0]
            plan[name] = ("normal(std/sqrt(2L))" if RESIDUAL_PROJECTION.search(name) else
                          "normal(std)" if rule == "normal" else rule)
            continue
        if name.endswith(".bias") or name == "bias":
            p.zero_()
            plan[name] = "zeros"
        elif id(p) in layer_norm_params:                # LayerNorm weight
            p.fill_(1.0)
            plan[name] = "ones"
        elif RESIDUAL_PROJECTION.search(name):
            p.normal_(0.0, residual_std, generator=generator)
            plan[name] = "normal(std/sqrt(2L))"
        else:                                           # Linear / Conv1D / Embedding
            p.normal_(0.0, std, generator=generator)
            plan[name] = "normal(std)"
    return plan
