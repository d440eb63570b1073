"""The loss slot: a :class:`LossSpec` says, in one place, everything the engine does with a loss.

``"ds_mp": {"loss": {"type": NAME}}`` picks a spec by name (``ds_mp.config.losses``; the default
``"lm"`` is :data:`ds_mp.losses.lm.LM_LOSS`, HF's per-token causal-LM loss).  A spec answers:

* **what travels to the last stage** with each micro-batch (:meth:`LossSpec.labels`): a tuple of
  tensors ``(targets, denominator, *extras)`` -- DeepSpeed moves a label tuple of tensors to the
  device as it is, so the tuple's layout is the spec's to define and read back (:meth:`unpack`);
* **what the last stage computes** from the (vocab-parallel) logits and those labels
  (:meth:`micro_loss`: the micro-batch's numerator :meth:`numerator` over its denominator);
* **how it is normalised** over micro-batches and DP replicas (:meth:`units`, :meth:`denominators`);
* **which per-row values it hands back** for metrics (:meth:`row_values`, :meth:`rows`; the engine
  records them on the last stage when the spec names ``row_keys``, and
  ``ds_mp.engine.rows.step_rows`` hands a step's rows to every rank);
* **its options** from the ``"loss"`` block (:meth:`with_options`: DPO's ``beta``, ...).

The normalisation, whole (``loss.normalization = "tokens"``, the default).  A step reads M
micro-batches on each of dp replicas; micro-batch (d, i) has numerator S_{d,i} (:meth:`numerator`:
for the LM loss the sum of its token losses) and c_{d,i} units (:meth:`units`: its target tokens).
The step's loss is

    L = Σ_{d,i} S_{d,i} / N,        N = Σ_{d,i} c_{d,i}  (all-reduced over DP before the step).

DeepSpeed then does two things to each micro-batch loss l_{d,i}: it scales it by 1/M before its
backward (``gradient_accumulation_steps``: 1/GAS), and it averages the gradients (and the reported
loss, ``_aggregate_total_loss`` or a runtime's ``aggregate_loss``) over the gradient group
(``topology.grad_group``, g = dp × cp ranks; the dp replicas while cp = 1).  So the engine hands
DeepSpeed

    l_{d,i} = S_{d,i} / D,   D = N / (M · g)     (:meth:`denominators`; one D for every micro-batch)

and what DeepSpeed computes is Σ_d (1/g) Σ_i (1/M) S_{d,i} · M · g / N = L, exactly: gradient and
loss.  Every runtime's ``aggregate_loss`` (1F1B/GPipe/ZB-H1/interleaved/TeraPipe: DeepSpeed's; ZB-V,
Ouroboros: their own) is that same mean over M and g, so none of them knows the loss.
``"micro_batch"`` gives each micro-batch D = max(c_{d,i}, 1) instead (DeepSpeed's mean of
micro-batch means).  A global batch with N = 0 skips the step (``warn_no_targets``).

Writing the next loss is one spec, not an engine change:

* a **per-sequence** loss (DPO, ``ds_mp.losses.dpo``: per-pair log-sigmoid of summed completion
  log-probs, each pair's chosen and rejected rows inside one micro-batch) overrides :meth:`units` (pairs or rows with a
  target instead of tokens), :meth:`numerator` (its sum over the micro-batch's pairs, from
  :meth:`token_losses` = -log p of each target, the vocab-parallel cross-entropy) and lists the
  reference log-probs in ``extras`` (``(B,)`` tensors that travel in the label tuple); it sets
  ``token_sliceable = False`` (TeraPipe's token slices cannot see a whole sequence);
* a **policy-gradient** loss (GRPO) lists ``advantages``, ``old_logps``, ``ref_logps`` (``(B, T)``)
  in ``extras``; per-token normalisation keeps :meth:`units` (target tokens), per-sequence
  normalisation counts rows; :meth:`numerator` combines ``-token_losses`` (the log-probs) with them.

The tests' toy spec (tests/test_loss_spec.py: a per-sequence mean of token losses) is such a spec,
registered by ``ds_mp.config.losses.register_loss`` and trained through an unchanged engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ds_mp.config.registry import schedule_spec
from ds_mp.config.schema import ConfigError, DsMpConfig
from ds_mp.tensor_parallel import vocab_parallel_cross_entropy

IGNORE = -100  # a target that is not one (HF's ignore_index)


@dataclass(frozen=True)
class LossSpec:
    """One loss, whole: every hook the engine asks of it (see the module docstring).  The defaults
    are HF's per-token LM loss; a subclass overrides what differs.

    Fields: ``name`` (for messages); ``extras`` (names of the micro-batch's extra tensors that travel
    after the targets and denominator in the label tuple, in this order); ``token_sliceable`` (its
    numerator is a sum over token positions, so TeraPipe's token slices may compute it piecewise);
    ``row_keys`` (the names :meth:`rows` returns, each a ``(B,)`` value per row, recorded by the engine
    for every micro-batch of a step; empty: nothing recorded, the LM loss's default)."""

    name: str = "lm"
    extras: tuple[str, ...] = ()
    token_sliceable: bool = True
    row_keys: tuple[str, ...] = ()

    # --- config: the "loss" block's own keys --------------------------------------------------
    def with_options(self, **options: Any) -> "LossSpec":
        """This spec with the ``"loss"`` block's keys other than ``type`` / ``normalization``
        [none: each is refused in one line]."""
        for key in options:
            raise ConfigError(f"ds_mp.loss.{key}: unknown key for the {self.name!r} loss; known keys: type, "
                              "normalization")
        return self

    # --- config: checked on every rank before any collective --------------------------------
    def check(self, cfg: DsMpConfig) -> None:
        """Its checks of the ``"ds_mp"`` block [a token-slicing schedule refused where the loss needs
        whole sequences]."""
        if not self.token_sliceable and schedule_spec(cfg.pipeline.schedule).token_slices:
            raise ConfigError(f"ds_mp.loss.type: the {self.name!r} loss needs whole sequences, which the "
                              f"{cfg.pipeline.schedule!r} schedule's token slices do not see; use another "
                              "pipeline.schedule")

    # --- before the step: what travels, and the normalisation -------------------------------
    def units(self, targets: torch.Tensor) -> int:
        """What this micro-batch adds to the global denominator N [its target tokens]."""
        return int((targets != IGNORE).sum())

    def denominators(self, counts: list[int], total: int, grad_size: int, normalization: str) -> list[float]:
        """Each micro-batch's denominator D, given its ``counts`` (:meth:`units`) on this replica, the
        global ``total`` N over every micro-batch and replica, and ``grad_size`` g (the gradient
        group's ranks, dp × cp): ``"tokens"`` N / (M · g),
        which DeepSpeed's 1/M and DP mean turn into Σ S / N (module docstring); ``"micro_batch"``
        each micro-batch's own count."""
        if normalization == "micro_batch":
            return [float(max(c, 1)) for c in counts]
        share = max(total, 1) / (len(counts) * grad_size)
        return [float(share)] * len(counts)

    def labels(self, targets: torch.Tensor, denominator: torch.Tensor,
               extras: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """The label tuple that travels to the last stage: ``(targets, denominator, *extras)``."""
        extras = extras or {}
        missing = [n for n in self.extras if n not in extras]
        if missing:
            raise ValueError(f"batch: the {self.name!r} loss needs the extras {missing} in every micro-batch")
        return (targets, denominator, *(extras[n] for n in self.extras))

    def unpack(self, labels: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``labels`` (:meth:`labels`' tuple) as (targets, denominator, extras)."""
        targets, denominator, *rest = labels
        return targets, denominator, dict(zip(self.extras, rest))

    def token_slice(self, labels: Any, rows: slice, cols: slice) -> tuple[torch.Tensor, ...]:
        """The labels of a TeraPipe slice (``rows`` × ``cols`` of the micro-batch): its targets and
        per-token extras cut, per-row extras cut by rows, the denominator the whole micro-batch's
        (slice losses then sum to the micro-batch loss)."""
        targets, denominator, extras = self.unpack(labels)
        cut = {n: (x[rows, cols] if x.dim() == 2 else x[rows]) for n, x in extras.items()}
        return self.labels(targets[rows, cols], denominator, cut)

    # --- on the last stage ---------------------------------------------------------------------
    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor, ctx: Any) -> torch.Tensor:
        """-log p(target) per position ``(B, T)`` (0 where the target is -100), fp32, from this TP
        rank's vocab shard of ``logits`` (the fused vocab-parallel cross-entropy)."""
        if ctx.tp == 1:  # one rank holds every logit: the plain (faster) kernel, padding cut off
            flat = F.cross_entropy(logits[..., :ctx.vocab].reshape(-1, ctx.vocab).float(),
                                   targets.reshape(-1), ignore_index=IGNORE, reduction="none")
            return flat.view(targets.shape)
        start = ctx.tp_rank * (ctx.padded_vocab // ctx.tp)
        flat = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            vocab_start=start, true_vocab=ctx.vocab, group=ctx.group)
        return flat.view(targets.shape)

    def numerator(self, token_losses: torch.Tensor, targets: torch.Tensor,
                  extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """S of this micro-batch (or token slice) [the sum of its token losses]."""
        return token_losses.sum()

    def micro_loss(self, logits: torch.Tensor, labels: Any, ctx: Any,
                   record: list | None = None) -> torch.Tensor:
        """The loss DeepSpeed backpropagates for one micro-batch: S / D; with ``record`` (a list) the
        micro-batch's :meth:`rows` are appended to it, from the same token losses."""
        targets, denominator, extras = self.unpack(labels)
        token_losses = self.token_losses(logits, targets, ctx)
        if record is not None:
            with torch.no_grad():
                record.append(self.rows(token_losses.detach(), targets, extras))
        return self.numerator(token_losses, targets, extras) / denominator

    def rows(self, token_losses: torch.Tensor, targets: torch.Tensor,
             extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-row values for metrics, each ``(B,)`` [the row's token-loss sum and target count]."""
        return {"loss_sum": token_losses.sum(dim=1), "targets": (targets != IGNORE).sum(dim=1)}

    def row_values(self, logits: torch.Tensor, labels: Any, ctx: Any) -> dict[str, torch.Tensor]:
        """:meth:`rows` of one micro-batch from its logits and label tuple (no graph)."""
        targets, _, extras = self.unpack(labels)
        with torch.no_grad():
            return self.rows(self.token_losses(logits, targets, ctx), targets, extras)

    def bind(self, ctx: Any) -> "BoundLoss":
        """The ``loss_fn(logits, labels)`` the pipeline module hands DeepSpeed."""
        return BoundLoss(self, ctx)


class BoundLoss:
    """A spec bound to a stage's ``Ctx``: DeepSpeed's ``loss_fn(outputs, labels)``.  ``recorded``: the
    :meth:`LossSpec.rows` of each call since the engine last cleared it (None: not recording)."""

    def __init__(self, spec: LossSpec, ctx: Any) -> None:
        self.spec, self.ctx = spec, ctx
        self.recorded: list[dict[str, torch.Tensor]] | None = None
        self.__name__ = type(spec).__name__

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        return self.spec.micro_loss(logits, labels, self.ctx, self.recorded)

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.spec.token_losses(logits, targets, self.ctx)


__all__ = ["IGNORE", "LossSpec", "BoundLoss"]
