"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

The simple noise scale B_simple = tr(Σ) / |G|² (Σ: per-sample gradient covariance, G:
true gradient) predicts the critical batch size.  A mean gradient G_B over B samples has

    E|G_B|² = |G|² + tr(Σ) / B,

so two measured batch sizes B_small < B_big give unbiased estimates (paper, App. A.1):

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Each single-step estimate is very noisy (|G|² may even come out negative), so, as the
paper does, both are smoothed with exponential moving averages before dividing.

Under data parallelism both sizes come for free: B_small = micro × accumulation (one
replica's samples per step, |G_small|² = its local gradient's norm² before the DP
all-reduce, averaged over replicas) and B_big = B_small × DP (the all-reduced gradient).
Batch sizes are in samples (sequences of ``data.seq_len`` tokens); multiply by seq_len for
tokens.  The norms are of the gradients DeepSpeed's DP reduction averages
(``DsMpPipelineEngine.reduction_grad_norm``): ``p.grad`` in fp32; under bf16 (BF16_Optimizer) its
fp32 gradient buffers, before and after the reduction; under ZeRO-1 ``p.grad`` before and, after,
ZeRO's own norm of the reduced fp32 partitions (the step's gradient norm).  fp16 (loss-scaled
gradients) and Ouroboros (gradients assembled by hand) are refused by ``load_config``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gradient_sq_estimate", "trace_estimate", "NoiseScaleEstimator", "NoiseScaleProbe", "instruction_kind",
           "COMPUTE_KINDS", "bubble", "decoder_flops"]

COMPUTE_KINDS = ("forward", "backward")


def instruction_kind(name: str) -> str:
    """``ForwardPass``/``ForwardSlice``/``ModuleForward`` -> forward, ``*Backward*`` -> backward,
    ``Send*``/``Recv*`` -> comm, ``OptimizerStep``/``UpdateModules`` -> optimizer, anything else
    (loads, grad reductions) -> other: every schedule's instructions by the same substrings."""
    if "Forward" in name:
        return "forward"
    if "Backward" in name:
        return "backward"
    if name.startswith(("Send", "Recv")):
        return "comm"
    if "Optimizer" in name or "Update" in name:
        return "optimizer"
    return "other"


def bubble(instruction_seconds: dict[str, float], step_seconds: float) -> float:
    """The pipeline bubble of one rank: 1 − (forward + backward compute time) / step time.

    The one definition: the training log's ``bubble`` column and ``ds-mp timeline``'s per-rank
    bubble (``tools.viz.bubble_stats``, over a trace's makespan) both count compute this way.
    """
    busy = sum(t for name, t in instruction_seconds.items() if instruction_kind(name) in COMPUTE_KINDS)
    return max(0.0, 1.0 - busy / step_seconds) if step_seconds > 0 else 0.0


def decoder_flops(hf_config: Any, seq_len: int, batch: int) -> float:
    """FLOPs of one step (forward + backward, no recomputation) of a decoder of any ds_mp family:
    F = 6 B s (l P + h V) + 12 B s² l A, with P the block's matmul weights
    (:func:`ds_mp.models.family.block_matmul_parameters`), A = heads × head dim, h the hidden
    size, V the vocab.  For GPT-2 (P = 12 h², A = h) it is Megatron-LM's
    72 B s l h² (1 + s/(6h) + V/(12 l h)); for the Llama family P counts grouped key/value heads
    and the three SwiGLU projections."""
    from ds_mp.models.family import block_matmul_parameters

    s, l, h, V = seq_len, hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.vocab_size
    A = hf_config.num_attention_heads * (getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads)
    return 6.0 * batch * s * (l * block_matmul_parameters(hf_config) + h * V) + 12.0 * batch * s * s * l * A


def _check_sizes(b_small: float, b_big: float) -> None:
    if not 0 < b_small < b_big:
        raise ValueError(f"noise scale: need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}; "
                         "it needs two different batch sizes (data parallelism > 1)")


def gradient_sq_estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
    """Unbiased |G|² = (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)."""
    _check_sizes(b_small, b_big)
    return (b_big * big_sq - b_small * small_sq) / (b_big - b_small)


def trace_estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
    """Unbiased tr(Σ) = (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)."""
    _check_sizes(b_small, b_big)
    return (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)


class NoiseScaleEstimator:
    """EMA-smoothed B_simple = EMA[tr(Σ)] / EMA[|G|²].

    ``ema ← beta·ema + (1 − beta)·x``, bias-corrected by 1 − beta^n after n updates (so
    the first value is the first estimate itself; the correction cancels in the ratio).
    """

    def __init__(self, beta: float = 0.95) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"noise scale: beta must be in [0, 1), got {beta}")
        self.beta = beta
        self.updates = 0
        self._g2 = self._trace = 0.0

    @property
    def gradient_sq(self) -> float | None:
        """Smoothed |G|² (None before the first update)."""
        return self._g2 / (1 - self.beta ** self.updates) if self.updates else None

    @property
    def trace(self) -> float | None:
        """Smoothed tr(Σ) (None before the first update)."""
        return self._trace / (1 - self.beta ** self.updates) if self.updates else None

    @property
    def value(self) -> float | None:
        """B_simple in samples; None until both smoothed estimates are positive."""
        if not self.updates or self._g2 <= 0 or self._trace <= 0:
            return None
        return self._trace / self._g2

    def state_dict(self) -> dict:
        """The smoothing state (raw EMAs and update count): a resumed run continues the same averages."""
        return {"beta": self.beta, "updates": self.updates, "g2": self._g2, "trace": self._trace}

    def load_state_dict(self, state: dict) -> None:
        self.beta, self.updates = float(state["beta"]), int(state["updates"])
        self._g2, self._trace = float(state["g2"]), float(state["trace"])

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float | None:
        """Fold in one measurement; returns :attr:`value`.

        A non-finite measurement (an fp16 overflow step) is ignored.
        """
        g2 = gradient_sq_estimate(small_sq, big_sq, b_small, b_big)
        tr = trace_estimate(small_sq, big_sq, b_small, b_big)
        if math.isfinite(g2) and math.isfinite(tr):
            self._g2 = self.beta * self._g2 + (1 - self.beta) * g2
            self._trace = self.beta * self._trace + (1 - self.beta) * tr
            self.updates += 1
        return self.value


class NoiseScaleProbe:
    """Engine hook around the DP gradient all-reduce, active every ``interval`` steps.

    The engine calls ``before(local_sq)`` with this replica's model-wide gradient norm²
    (each TP shard / tied tensor once, all stages) just before the DP all-reduce and
    ``after(reduced_sq, b_small)`` with the same norm² just after it.  ``before`` averages
    the local norm² over the DP replicas (a collective on the DP group).
    """

    def __init__(self, interval: int, topology: Any, beta: float = 0.95) -> None:
        self.interval, self.topology = interval, topology
        self.estimator = NoiseScaleEstimator(beta)
        self.small_sq: float | None = None  # last measurement, DP-averaged |G_small|²
        self.big_sq: float | None = None  # last measurement, |G_big|²

    @classmethod
    def from_config(cls, cfg: Any, topology: Any) -> "NoiseScaleProbe | None":
        """A probe when ``training.noise_scale_interval`` > 0 (or the ``noise_scale`` batch ramp is on:
        then every step unless that interval is set) and DP > 1, else None."""
        interval = cfg.training.noise_scale_interval if cfg is not None else 0
        if cfg is not None and not interval and cfg.batch_ramp.policy == "noise_scale":
            interval = 1
        if interval <= 0 or topology is None or topology.dp < 2:
            return None
        return cls(interval, topology)

    @property
    def value(self) -> float | None:
        """Current smoothed B_simple in samples (None until defined)."""
        return self.estimator.value

    def due(self, step: int) -> bool:
        """Measure during optimizer step ``step`` (1-based)?"""
        return step % self.interval == 0

    def before(self, local_sq: float, device: torch.device) -> None:
        t = torch.tensor([local_sq], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.topology.dp_group)  # mean over the replicas that read distinct rows
        self.small_sq = float(t) / self.topology.dp

    def after(self, reduced_sq: float, b_small: int) -> float | None:
        self.big_sq = reduced_sq
        # B_big: the rows of the step (CP peers read the same rows: true dp, not the grad group's size)
        return self.estimator.update(self.small_sq, reduced_sq, b_small, b_small * self.topology.dp)
