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
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

__all__ = ["RESIDUAL_PROJECTION", "init_gpt2_weights"]

RESIDUAL_PROJECTION = re.compile(r"(^|\.)(attn|mlp)\.c_proj\.weight$")


@torch.no_grad()
def init_gpt2_weights(model: nn.Module, n_layer: int, std: float = 0.02,
                      generator: torch.Generator | None = None) -> dict[str, str]:
    """Re-initialise every parameter of ``model`` in place (see module docstring).

    Args:
        model: a GPT-2 style model (HF ``GPT2LMHeadModel`` or ``GPT2Model``).
        n_layer: number of transformer blocks (scales the residual projections).
        std: standard deviation of the ordinary weights.
        generator: optional RNG for reproducible draws.

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
