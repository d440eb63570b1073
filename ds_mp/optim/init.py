"""A family's weight initialisation applied to a whole HF model, by parameter name.

The rules live with each family (``Family.init_rule``; GPT-2's: ``ds_mp.models.gpt2.plan``) and the
layout-free per-name draws in :mod:`ds_mp.models.weights` (``fresh_tensor`` / ``fresh_source``,
what ``ds_mp.initialize`` creates for a fresh model).  :func:`init_gpt2_weights` re-draws an
in-memory GPT-2 (HF ``GPT2LMHeadModel``, or anything whose parameter names follow GPT-2's, e.g.
a model after tensor-parallel layer replacement; the tied ``lm_head.weight`` is ``wte.weight`` and
is initialised once).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ds_mp.models.gpt2.plan import RESIDUAL_PROJECTION, init_rule
from ds_mp.models.weights import fresh_source, fresh_tensor

__all__ = ["init_gpt2_weights", "fresh_source"]


@torch.no_grad()
def init_gpt2_weights(model: nn.Module, n_layer: int, std: float = 0.02,
                      generator: torch.Generator | None = None, seed: int | None = None) -> dict[str, str]:
    """Re-initialise every parameter of ``model`` in place by GPT-2's rule (``ds_mp.models.gpt2.plan``).

    Args:
        model: a GPT-2 style model (HF ``GPT2LMHeadModel`` or ``GPT2Model``).
        n_layer: number of transformer blocks (scales the residual projections).
        std: standard deviation of the ordinary weights.
        generator: optional RNG for reproducible draws (one stream over the whole model).
        seed: instead of ``generator``, the layout-free per-name draws of ``fresh_tensor``
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
            rule = init_rule(hf, n_layer, std)
            p.copy_(fresh_tensor(hf, tuple(p.shape), seed, rule))
            plan[name] = ("normal(std/sqrt(2L))" if RESIDUAL_PROJECTION.search(name) else
                          "normal(std)" if rule[0] == "normal" else rule[0])
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
