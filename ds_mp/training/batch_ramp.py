"""The batch-size ramp: which global batch the next optimizer step takes, and its LR factor.

Pure rule and state (no ranks, no engine): the training loop asks :meth:`BatchRamp.before_step`
for the global batch of step ``t`` (in samples), applies it with DeepSpeed's own
``engine.set_train_batch_size`` (more micro-batches per step, never a new engine) and reports
the step's samples with :meth:`BatchRamp.after_step`.

Policies (``ds_mp.batch_ramp.policy``), decided every ``interval`` optimizer steps (before
steps 1, 1 + interval, 1 + 2·interval, ...):

* ``"linear"``:  B(s) = start + (max − start) · min(1, s / ramp_samples), s = samples consumed
  by the steps so far (Megatron-LM's ramp, continuous instead of stepped).
* ``"noise_scale"``: B = B_simple, the EMA-smoothed simple gradient noise scale in samples
  (McCandlish et al. 2018, :mod:`ds_mp.training.metrics`).  Why: B_simple estimates the
  critical batch B_crit, below which a step's progress grows ~linearly with B (each sample
  still counts: the gradient is noise-dominated) and above which extra samples are largely
  wasted (the gradient is already accurate).  Early in training B_simple is small, so a
  small batch makes the most progress per sample; as the loss falls, it grows, and so does
  the batch worth taking.  The smoothed value is trusted once the EMA spans its window
  (⌈1 / (1 − β)⌉ measurements: 20 at β = 0.95); before that the batch stays.

Both: the candidate is rounded *down* to a multiple of ``unit`` = micro-batch × DP (× stages for
the interleaved schedule): the sizes a layout can take (DeepSpeed's ``set_train_batch_size``
requires it); clamped to [start, max], and the batch never decreases (a decrease would undo
what the schedule already paid for, and B_simple's noise would otherwise make the batch
oscillate).

LR scaling (``lr_scaling``): each step's LR is the schedule's × (B / start)^p, p = 0 (``"none"``),
½ (``"sqrt"``), 1 (``"linear"``): :class:`LrScaling` scales the LR only inside the optimizer's
step, so the schedule (any DeepSpeed or torch LR scheduler, or none) never sees the factor.
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import torch

__all__ = ["POLICIES", "LR_SCALINGS", "BatchRamp", "LrScaling", "round_to_unit", "min_estimates", "first_noise_decision"]

POLICIES = ("linear", "noise_scale")
LR_SCALINGS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}  # lr_scaling -> exponent p of (B / start)^p


class NoiseSource(Protocol):
    """What the noise-scale policy reads (``metrics.NoiseScaleEstimator``)."""

    beta: float
    updates: int

    @property
    def value(self) -> float | None: ...


def round_to_unit(batch: float, unit: int, start: int, maximum: int) -> int:
    """``batch`` rounded down to a multiple of ``unit``, clamped to [start, maximum] (both multiples)."""
    return int(min(maximum, max(start, unit * math.floor(batch / unit))))


def min_estimates(beta: float) -> int:
    """Measurements before the noise-scale policy trusts the EMA: its window ⌈1 / (1 − β)⌉."""
    return max(1, math.ceil(1.0 / (1.0 - beta) - 1e-9))


def first_noise_decision(interval: int, measure_every: int, beta: float) -> int:
    """The first step whose batch the noise-scale policy decides.  Decisions come before steps
    1 + k·interval; B_simple is measured at the end of every ``measure_every``-th step and trusted
    after :func:`min_estimates` measurements W, so the first decision is at
    1 + interval·⌈W·measure_every / interval⌉ (step 21 at W = 20, every step, interval 5)."""
    return 1 + interval * math.ceil(min_estimates(beta) * measure_every / interval)


class BatchRamp:
    """The ramp's rule and state: the current global batch, consumed samples, steps taken.

    ``unit`` = micro-batch × DP of the running layout.  State (:meth:`state_dict`) is in
    samples, so it resumes at another layout; a saved batch the new layout cannot take
    (not a multiple of its unit) is rounded up to the next size it can.
    """

    def __init__(self, policy: str, start: int, maximum: int, ramp_samples: int, interval: int, lr_scaling: str,
                 unit: int) -> None:
        if policy not in POLICIES or lr_scaling not in LR_SCALINGS:
            raise ValueError(f"batch ramp: policy {policy!r} / lr_scaling {lr_scaling!r} unknown")
        if not (0 < start <= maximum and start % unit == 0 and maximum % unit == 0 and interval >= 1):
            raise ValueError(f"batch ramp: need unit | start <= max, interval >= 1; got start={start}, max={maximum}, "
                             f"unit={unit}, interval={interval}")
        self.policy, self.start, self.max, self.unit = policy, start, maximum, unit
        self.ramp_samples, self.interval, self.lr_scaling = ramp_samples, interval, lr_scaling
        self.batch = start  # global samples of the next step
        self.consumed = 0  # samples taken by the steps done so far
        self.steps = 0  # optimizer steps done under the ramp

    @classmethod
    def from_config(cls, cfg: Any, micro_batch: int, dp: int, micro_multiple: int = 1) -> "BatchRamp | None":
        """The ramp of a validated ``ds_mp.batch_ramp`` block, None when it is off (policy "").
        ``micro_multiple``: the micro-batches per step must be a multiple of it (the stages for
        the interleaved schedule; see ``ds_mp.config.checks.ramp_micro_multiple``)."""
        if not cfg.policy:
            return None
        return cls(cfg.policy, cfg.start, cfg.max, cfg.ramp_samples, cfg.interval, cfg.lr_scaling,
                   micro_batch * dp * micro_multiple)

    def target(self, noise: NoiseSource | None = None) -> float | None:
        """The policy's unrounded batch now, or None when it has none yet (noise scale not trusted)."""
        if self.policy == "linear":
            frac = min(1.0, self.consumed / self.ramp_samples) if self.ramp_samples > 0 else 1.0
            return self.start + (self.max - self.start) * frac
        if noise is None or noise.updates < min_estimates(noise.beta):
            return None
        return noise.value

    def warm_up_note(self, measure_every: int, beta: float, from_step: int, steps: int) -> str | None:
        """The noise-scale policy's wait for its EMA, as one line for the start of a run (None for
        the linear policy, or once the wait is over): the first step it decides, and whether the
        run reaches it."""
        if self.policy != "noise_scale":
            return None
        first = first_noise_decision(self.interval, measure_every, beta)
        if first <= from_step:
            return None
        note = (f"ds_mp: batch_ramp: the noise-scale policy keeps the batch at {self.start} until step {first}, its "
                f"first decision (it trusts B_simple after {min_estimates(beta)} measurements, one every "
                f"{measure_every} step(s), and decides every {self.interval})")
        if first > steps:
            note += (f"; training.steps={steps} ends before it, so the batch never changes: lower "
                     "training.noise_scale_interval or batch_ramp.interval, or train longer")
        return note

    def before_step(self, step: int, noise: NoiseSource | None = None) -> int:
        """The global batch of optimizer step ``step`` (1-based); re-decided when the step is due."""
        if (step - 1) % self.interval == 0:
            want = self.target(noise)
            if want is not None and math.isfinite(want):
                self.batch = max(self.batch, round_to_unit(want, self.unit, self.start, self.max))
        return self.batch

    def after_step(self) -> None:
        """Step done: its ``batch`` samples are consumed."""
        self.consumed += self.batch
        self.steps += 1

    @property
    def lr_factor(self) -> float:
        """(B / start)^p for the current batch."""
        return (self.batch / self.start) ** LR_SCALINGS[self.lr_scaling]

    def state_dict(self) -> dict:
        return {"policy": self.policy, "batch": self.batch, "consumed": self.consumed, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved ramp (same policy); its batch rounded up to this layout's unit."""
        if state["policy"] != self.policy:
            raise ValueError(f"batch ramp: the checkpoint's policy is {state['policy']!r}, this run's {self.policy!r}; "
                             "resume with the same ds_mp.batch_ramp.policy")
        self.batch = min(self.max, max(self.start, self.unit * math.ceil(state["batch"] / self.unit)))
        self.consumed, self.steps = int(state["consumed"]), int(state["steps"])


class LrScaling:
    """LR used by each optimizer step = the schedule's LR × ``factor``, exactly, with any scheduler.

    Hooks on the torch optimizer that does the update (the one a bf16/ZeRO wrapper holds): just
    before its ``step`` every parameter group's ``lr`` is multiplied by ``factor``, just after
    it the schedule's value is put back (the same float, not divided).  So between steps
    ``group["lr"]`` is always the unscaled schedule: what an LR scheduler reads and writes
    (torch's chainable ones, ExponentialLR or StepLR, compute the next LR from it; DeepSpeed's
    WarmupLR sets absolute values), what ``engine.get_lr()`` and checkpoints hold; the scaling
    never feeds back into the schedule.  ZeRO steps its base optimizer once per group with
    ``param_groups`` narrowed to that group: each call scales and restores what it sees.
    """

    def __init__(self, optimizer: Any) -> None:
        """``optimizer``: the engine's optimizer (a torch optimizer, or a DeepSpeed wrapper of one)."""
        base = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
        self.optimizer = optimizer  # its param_groups: what a scheduler and engine.get_lr() see
        self.factor = 1.0
        self._restore: list[tuple[dict, float]] = []
        base.register_step_pre_hook(self._scale)
        base.register_step_post_hook(self._unscale)

    def _scale(self, opt: Any, *_: Any) -> None:
        self._restore = [(g, g["lr"]) for g in opt.param_groups]
        for g, lr in self._restore:
            g["lr"] = lr * self.factor

    def _unscale(self, *_: Any) -> None:
        for g, lr in self._restore:
            g["lr"] = lr
        self._restore = []

    def apply(self, factor: float) -> list[float]:
        """Scale the next steps by ``factor``; returns the LR per group the next step uses
        (the schedule's LR now × factor, as the pre-step hook computes it)."""
        self.factor = factor
        return [g["lr"] * factor for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"unscaled": True}  # the optimizer's groups (checkpointed with it) hold the schedule

    def load_state_dict(self, state: dict) -> None:
        """Checkpoints from before the hooks saved the scaled LR in the groups and the schedule's
        beside it (``"scheduled"``): put the schedule back."""
        if not state.get("unscaled") and state.get("scheduled") is not None:
            for g, lr in zip(self.optimizer.param_groups, state["scheduled"]):
                g["lr"] = lr
