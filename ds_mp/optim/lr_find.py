"""Learning-rate range test (Smith 2015, "Cyclical Learning Rates"; fastai's lr_find).

Run ``num_steps`` optimizer steps with the learning rate swept exponentially,

    lr_i = lr_min * (lr_max / lr_min) ** (i / (num_steps - 1)),   i = 0 .. num_steps - 1,

and track the loss with an exponential moving average corrected for its zero start:

    a_i = smooth * a_{i-1} + (1 - smooth) * loss_i,   a_{-1} = 0
    s_i = a_i / (1 - smooth ** (i + 1))

The sweep stops early when s_i > diverge_factor * min_{j<=i} s_j, or the loss is not finite.

Suggested learning rate: the lr of steepest descent of the smoothed loss against log(lr),
``argmin_i ds/dlog(lr)``, searched only up to the minimum of s (beyond it the curve
rises). It is usually the largest lr at which the loss still falls quickly. The
alternative rule "lr at the minimum / 10" is returned as ``min_div10_lr``. With fewer
than three recorded points the suggestion falls back to ``min_div10_lr``.

The caller owns the model: ``step_fn(lr)`` sets the lr, does forward/backward/step and
returns the loss *before* the step. Restore the weights afterwards if the run continues.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["LRFindResult", "lr_find"]


@dataclass
class LRFindResult:
    """The recorded sweep and the derived suggestions."""

    lrs: list[float] = field(default_factory=list)       # lr used at each step
    losses: list[float] = field(default_factory=list)    # raw loss returned by step_fn
    smoothed: list[float] = field(default_factory=list)  # bias-corrected EMA of the loss
    diverged: bool = False                               # stopped early on divergence
    suggested_lr: float = float("nan")                   # steepest descent of smoothed
    min_div10_lr: float = float("nan")                   # lr at min(smoothed) / 10

    def save_csv(self, path: str | Path) -> None:
        """Write ``step,lr,loss,smoothed_loss`` rows (header first)."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "lr", "loss", "smoothed_loss"])
            for i, (lr, loss, s) in enumerate(zip(self.lrs, self.losses, self.smoothed)):
                w.writerow([i, repr(lr), repr(loss), repr(s)])

    def plot(self, path_png: str | Path) -> None:
        """Plot raw and smoothed loss against lr (log x) with the suggestion marked."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot(self.lrs, self.losses, alpha=0.3, label="loss")
        ax.plot(self.lrs, self.smoothed, label="smoothed loss")
        if math.isfinite(self.suggested_lr):
            ax.axvline(self.suggested_lr, color="red", linestyle="--",
                       label=f"suggested lr {self.suggested_lr:.2e}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        finite = [s for s in self.smoothed if math.isfinite(s)]
        if finite:  # keep the diverging tail from flattening the interesting part
            lo, hi = min(finite), min(max(finite), 4 * min(finite) if min(finite) > 0 else max(finite))
            if hi > lo:
                ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        ax.legend()
        fig.tight_layout()
        fig.savefig(path_png, dpi=100)


def lr_find(step_fn: Callable[[float], float], lr_min: float, lr_max: float,
            num_steps: int, smooth: float = 0.98, diverge_factor: float = 4.0) -> LRFindResult:
    """Exponential lr sweep with early stop on divergence (see module docstring)."""
    if not (0 < lr_min < lr_max):
        raise ValueError(f"lr_find: need 0 < lr_min < lr_max, got {lr_min}, {lr_max}")
    if num_steps < 2:
        raise ValueError(f"lr_find: num_steps must be >= 2, got {num_steps}")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"lr_find: smooth must lie in [0, 1), got {smooth}")
    res = LRFindResult()
    avg, best = 0.0, math.inf
    for i in range(num_steps):
        lr = lr_min * (lr_max / lr_min) ** (i / (num_steps - 1))
        loss = float(step_fn(lr))
        avg = smooth * avg + (1.0 - smooth) * loss
        s = avg / (1.0 - smooth ** (i + 1))
        res.lrs.append(lr)
        res.losses.append(loss)
        res.smoothed.append(s)
        if not math.isfinite(s) or (i > 0 and s > diverge_factor * best):
            res.diverged = True
            break
        best = min(best, s)
    _suggest(res)
    return res


def _suggest(res: LRFindResult) -> None:
    """Fill ``suggested_lr`` and ``min_div10_lr`` from the recorded curve."""
    s = np.asarray(res.smoothed, dtype=np.float64)
    lrs = np.asarray(res.lrs, dtype=np.float64)
    ok = np.isfinite(s)
    if not ok.any():
        return
    i_min = int(np.argmin(np.where(ok, s, np.inf)))
    res.min_div10_lr = float(lrs[i_min] / 10.0)
    if i_min < 2:
        res.suggested_lr = res.min_div10_lr
        return
    slope = np.gradient(s[: i_min + 1], np.log(lrs[: i_min + 1]))   # ds / dlog(lr)
    res.suggested_lr = float(lrs[int(np.argmin(slope))])
