"""DPO as a loss spec (``"loss": {"type": "dpo", "beta": 0.1, ...}``): TRL 1.16's ``DPOTrainer`` loss.

A micro-batch is TRL's ``[chosen; rejected]`` rows: rows ``0 … b-1`` are the chosen completions of
``b`` pairs, rows ``b … 2b-1`` the rejected ones in the same pair order (TRL's
``DataCollatorForPreference`` layout), so each pair lies inside one micro-batch.  Targets are the
shifted labels with every non-completion position ``-100`` (prompt and padding); a row's policy
log-prob is the sum of its completion tokens' log-probs, ``-token_losses.sum(1)`` from the
(vocab-parallel) cross-entropy.  The extra ``ref_logps`` ``(B,)`` carries the reference model's same
sums, row for row (precomputed, or from a forward-only pass: ``ds_mp.engine.reference``).

A pair's loss is TRL's ``Σ_k w_k · loss_k`` over ``loss_type`` / ``loss_weights``; the step's loss
is its mean over the global batch's pairs (``units`` = pairs: with equal micro-batches this is TRL's
mean over micro-batches and DP replicas of each micro-batch's pair mean).  ``sft`` is TRL's
micro-batch mean of the chosen completion tokens' losses (counted once per pair of the micro-batch).
``ipo`` divides by each row's completion length, counted on the shifted targets (TRL counts the
unshifted mask: the same unless a completion token is a row's first, e.g. ``keep_end`` truncation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ds_mp.config.registry import schedule_spec
from ds_mp.config.schema import ConfigError, DsMpConfig
from ds_mp.losses.spec import IGNORE, LossSpec

#: TRL 1.16's per-pair loss types that this spec computes.
SUPPORTED = ("sigmoid", "ipo", "hinge", "robust", "sft")
#: TRL arguments with the only value ds_mp accepts, and why the others are refused.
TRL_ARGS = {
    "f_divergence_type": ("reverse_kl", "only the reverse-KL (standard) DPO is built"),
    "ld_alpha": (None, "LD-DPO's length-desensitised log-probs are not built"),
    "use_weighting": (False, "WPO weighting needs per-token log-sum-squared probabilities, not built"),
    "sync_ref_model": (False, "the reference is fixed (initial weights, adapters off, or a sharded ref_model)"),
    "padding_free": (False, "a pair's rows must stay whole rows of one micro-batch"),
}


def refuse_trl_args(prefix: str = "ds_mp.loss", **args: Any) -> None:
    """Refuse, in one line naming the argument, a TRL ``DPOConfig`` value this spec does not
    compute (``TRL_ARGS``); ``prefix`` names where it was given (``DPOConfig`` for the Trainer)."""
    for key, value in args.items():
        want, why = TRL_ARGS[key]
        if value != want:
            raise ConfigError(f"{prefix}.{key}: {value!r} is not supported ({why}); use {want!r}")


def check_loss_types(loss_type: Any, loss_weights: Any, prefix: str = "ds_mp.loss") -> tuple[tuple, tuple | None]:
    """``loss_type`` (a name or a list) and ``loss_weights`` (None or one number per type) as tuples,
    or a one-line refusal naming the key (an ``aot*``, ``exo_pair``, … type is not built)."""
    types = (loss_type,) if isinstance(loss_type, str) else loss_type
    if not isinstance(types, (list, tuple)) or not types or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{prefix}.loss_type: expected a loss name or a list of them, got {loss_type!r}")
    for t in types:
        if t not in SUPPORTED:
            raise ConfigError(f"{prefix}.loss_type: {t!r} is not supported under ds_mp; use one or more of "
                              f"{', '.join(SUPPORTED)}")
    if loss_weights is None:
        return tuple(types), None
    ok = isinstance(loss_weights, (list, tuple)) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in loss_weights)
    if not ok or len(loss_weights) != len(types):
        raise ConfigError(f"{prefix}.loss_weights: expected {len(types)} numbers (one per loss_type), "
                          f"got {loss_weights!r}")
    return tuple(types), tuple(float(w) for w in loss_weights)


@dataclass(frozen=True)
class DPOLossSpec(LossSpec):
    """TRL's DPO loss on ``[chosen; rejected]`` micro-batches (module docstring); options ``beta``,
    ``loss_type``, ``loss_weights``, ``label_smoothing`` as in TRL's ``DPOConfig``.  Rows recorded for
    metrics: ``logps`` (policy), ``ref_logps``, ``chosen`` (1 / 0) and ``targets`` (completion tokens)."""

    name: str = "dpo"
    extras: tuple[str, ...] = ("ref_logps",)
    token_sliceable: bool = False
    row_keys: tuple[str, ...] = ("logps", "ref_logps", "chosen", "targets")
    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0

    def with_options(self, **options: Any) -> "DPOLossSpec":
        """This spec with ``options`` (the ``"loss"`` block's DPO keys and TRL's fixed-value ones)."""
        known = ("beta", "loss_type", "loss_weights", "label_smoothing", *TRL_ARGS)
        for key in options:
            if key not in known:
                raise ConfigError(f"ds_mp.loss.{key}: unknown key for the 'dpo' loss; known keys: type, "
                                  f"normalization, {', '.join(known)}")
        refuse_trl_args(**{k: v for k, v in options.items() if k in TRL_ARGS})
        beta = options.get("beta", self.beta)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
            raise ConfigError(f"ds_mp.loss.beta: expected a number > 0, got {beta!r}")
        smoothing = options.get("label_smoothing", self.label_smoothing)
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 0.5:
            raise ConfigError(f"ds_mp.loss.label_smoothing: expected a number in [0, 0.5), got {smoothing!r}")
        types, weights = check_loss_types(options.get("loss_type", self.loss_type),
                                          options.get("loss_weights", self.loss_weights))
        return dataclasses.replace(self, beta=float(beta), label_smoothing=float(smoothing), loss_type=types,
                                   loss_weights=weights)

    def check(self, cfg: DsMpConfig) -> None:
        """The base checks (TeraPipe's token slices refused), and a schedule with delayed gradients
        (Ouroboros) refused: its steps are not TRL's."""
        super().check(cfg)
        if schedule_spec(cfg.pipeline.schedule).delayed_gradients:
            raise ConfigError(f"ds_mp.pipeline.schedule: {cfg.pipeline.schedule!r} is not supported with the 'dpo' "
                              "loss (its delayed gradients are not TRL's step); use a schedule without them")

    def units(self, targets: torch.Tensor) -> int:
        """The micro-batch's real pairs: those with a target in either row (a padding pair, both rows
        all -100, counts 0 and adds 0); an odd row count is refused."""
        if targets.shape[0] % 2:
            raise ValueError(f"batch: the 'dpo' loss needs [chosen; rejected] rows, an even number per "
                             f"micro-batch; got {targets.shape[0]}")
        return int(real_pairs(targets).sum())

    def pair_losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, token_losses: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
        """Each pair's ``Σ_k w_k · loss_k`` ``(b,)`` from the rows' policy and reference log-probs
        (TRL 1.16's ``_compute_loss`` with ``f_divergence_type="reverse_kl"``)."""
        chosen, rejected = (logps - ref_logps).chunk(2)
        delta, beta = chosen - rejected, self.beta
        counts = (targets != IGNORE).sum(dim=1).clamp(min=1).to(logps.dtype)
        total = torch.zeros_like(chosen)
        for kind, weight in zip(self.loss_type, self.loss_weights or [1.0] * len(self.loss_type)):
            if kind == "sigmoid":
                loss = -F.logsigmoid(beta * delta)
            elif kind == "hinge":
                loss = torch.relu(1 - beta * delta)
            elif kind == "ipo":
                n_chosen, n_rejected = counts.chunk(2)
                loss = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * beta)) ** 2
            elif kind == "robust":
                s = self.label_smoothing
                loss = (-(1 - s) * F.logsigmoid(beta * delta) + s * F.logsigmoid(-beta * delta)) / (1 - 2 * s)
            else:  # "sft": the micro-batch's mean over the chosen completion tokens, for every pair
                mask = (targets != IGNORE).chunk(2)[0]
                loss = (token_losses.chunk(2)[0] * mask).sum() / mask.sum().clamp(min=1)
                loss = loss.expand_as(chosen)
            total = total + weight * loss
        return total

    def numerator(self, token_losses: torch.Tensor, targets: torch.Tensor,
                  extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sum of the micro-batch's real pairs' losses."""
        logps = -token_losses.sum(dim=1)
        losses = self.pair_losses(logps, extras["ref_logps"].to(logps.dtype), token_losses, targets)
        return (losses * real_pairs(targets)).sum()

    def rows(self, token_losses: torch.Tensor, targets: torch.Tensor,
             extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per row: policy and reference completion log-probs, chosen flag, completion tokens."""
        half = targets.shape[0] // 2
        chosen = torch.arange(targets.shape[0], device=targets.device) < half
        return {"logps": -token_losses.sum(dim=1).float(), "ref_logps": extras["ref_logps"].float(),
                "chosen": chosen.float(), "targets": (targets != IGNORE).sum(dim=1).float()}


def real_pairs(targets: torch.Tensor) -> torch.Tensor:
    """``(b,)`` 1.0 for each pair of ``[chosen; rejected]`` rows with a target in either row, else 0."""
    has = (targets != IGNORE).any(dim=1)
    chosen, rejected = has.chunk(2)
    return (chosen | rejected).float()


def dpo_metrics(rows: dict[str, torch.Tensor], beta: float) -> dict[str, float]:
    """TRL's logged DPO metrics (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected``) from a step's rows (any number of
    ``[chosen; rejected]`` micro-batches, in order: ``ds_mp.engine.rows.step_rows``), padding pairs
    (no target in either row) left out: TRL's mean over the pairs."""
    is_chosen = rows["chosen"] > 0.5
    real = (rows["targets"][is_chosen] > 0) | (rows["targets"][~is_chosen] > 0)
    logps, ref = rows["logps"].double(), rows["ref_logps"].double()
    c_logps, r_logps = logps[is_chosen][real], logps[~is_chosen][real]
    c_rew, r_rew = beta * (c_logps - ref[is_chosen][real]), beta * (r_logps - ref[~is_chosen][real])
    return {"rewards/chosen": float(c_rew.mean()), "rewards/rejected": float(r_rew.mean()),
            "rewards/accuracies": float((c_rew > r_rew).double().mean()),
            "rewards/margins": float((c_rew - r_rew).mean()),
            "logps/chosen": float(c_logps.mean()), "logps/rejected": float(r_logps.mean())}


DPO_LOSS = DPOLossSpec()

__all__ = ["DPOLossSpec", "DPO_LOSS", "SUPPORTED", "TRL_ARGS", "refuse_trl_args", "check_loss_types", "real_pairs",
           "dpo_metrics"]
