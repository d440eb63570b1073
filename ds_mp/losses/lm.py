"""The first spec: HF's per-token causal-LM loss (``"loss": {"type": "lm"}``, the default).

``logits[:, t]`` predicts ``labels[:, t+1]`` (the targets arrive shifted, ``MicroBatch.targets``);
``-100`` is ignored; a step's loss is the sum of every token loss over the global batch's target
count (``ds_mp.losses.spec``: the normalisation and how DeepSpeed's 1/GAS and DP mean are
compensated).  Every hook is :class:`~ds_mp.losses.spec.LossSpec`'s default: the base class states
this loss, and the next ones override what differs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_mp.losses.spec import IGNORE, LossSpec


@dataclass(frozen=True)
class LMLossSpec(LossSpec):
    """Per-token next-token cross-entropy from vocab-parallel logits (the base class's hooks)."""

    name: str = "lm"


LM_LOSS = LMLossSpec()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``targets[:, t] = labels[:, t+1]``, last position ignored (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


__all__ = ["LMLossSpec", "LM_LOSS", "shift_labels"]
