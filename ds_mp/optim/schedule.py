"""Linear warm-up then cosine decay of the learning rate (Megatron-LM's GPT-2 recipe).

    lr(s) = max_lr * s / W                                         0 <= s < W
    lr(s) = min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2,    W <= s < S,  p = (s - W) / (S - W)
    lr(s) = min_lr                                                 s >= S

with W = warmup_steps and S = total_steps. lr(0) = 0, lr(W) = max_lr, lr(S) = min_lr.

Megatron-LM trains GPT-2 with max_lr 1.5e-4, 3000 warm-up iterations and cosine decay
to a minimum of 1e-5 over 300k iterations; those are ``MEGATRON_GPT2`` and the defaults
of ``WarmupCosineLR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["MEGATRON_GPT2", "warmup_cosine", "WarmupCosineFactor", "WarmupCosineLR"]

MEGATRON_GPT2: dict[str, float | int] = dict(
    max_lr=1.5e-4,       # peak learning rate
    min_lr=1e-5,         # floor reached at total_steps and kept afterwards
    warmup_steps=3000,   # linear warm-up from 0
    total_steps=300_000, # end of the cosine decay
)


def warmup_cosine(step: int, *, max_lr: float, min_lr: float, warmup_steps: int,
                  total_steps: int) -> float:
    """Learning rate at ``step`` (0-based); see the module docstring for the formula."""
    if warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(f"warmup_cosine: need 0 <= warmup_steps <= total_steps, "
                         f"got warmup_steps={warmup_steps}, total_steps={total_steps}")
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / (total_steps - warmup_steps)   # in [0, 1)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class WarmupCosineFactor:
    """Picklable ``LambdaLR`` multiplier: lr(step) / max_lr.

    A callable object rather than a lambda so that ``LambdaLR.state_dict()`` saves its
    fields and ``load_state_dict()`` restores them.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, max_lr=self.max_lr, min_lr=self.min_lr,
                             warmup_steps=self.warmup_steps,
                             total_steps=self.total_steps) / self.max_lr


class WarmupCosineLR(LambdaLR):
    """``LambdaLR`` whose learning rate follows ``warmup_cosine`` exactly.

    Every param group's base lr is set to ``max_lr`` (the optimizer's own ``lr`` is
    replaced), so after ``k`` calls of ``scheduler.step()`` each group has
    ``lr == warmup_cosine(k, ...)``. ``state_dict()`` carries the schedule's parameters.
    For DeepSpeed pass it as ``lr_scheduler=`` (an instance, or
    ``functools.partial(WarmupCosineLR, total_steps=...)`` as a callable of the optimizer).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 max_lr: float = MEGATRON_GPT2["max_lr"],
                 min_lr: float = MEGATRON_GPT2["min_lr"],
                 warmup_steps: int = MEGATRON_GPT2["warmup_steps"],
                 total_steps: int = MEGATRON_GPT2["total_steps"],
                 last_epoch: int = -1) -> None:
        if max_lr <= 0:
            raise ValueError(f"WarmupCosineLR: max_lr must be > 0, got {max_lr}")
        factor = WarmupCosineFactor(max_lr, min_lr, warmup_steps, total_steps)
        factor(0)  # validates warmup_steps / total_steps
        for group in optimizer.param_groups:
            group["lr"] = max_lr
            group["initial_lr"] = max_lr
        super().__init__(optimizer, factor, last_epoch=last_epoch)
