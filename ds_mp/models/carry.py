"""The carry: per-micro-batch side quantities that travel with the hidden state across pipeline stages.

HF's MoE load-balancing loss (``load_balancing_loss_func``) pools over *every* layer of a forward
before it multiplies: with f_e the share of (layer, token, top-k pick) triples routed to expert e
and P_e the mean router probability of e over (layer, token) pairs, both over the tokens the
attention mask keeps,

    aux = E · Σ_e f_e · P_e = E · Σ_e (C_e / R) · (S_e / R)

where C_e (top-k counts), S_e (probability sums, differentiable) and R (rows: layers × kept tokens)
are *sums over layers*.  A pipeline stage sees only its layers, so the sums travel: one fp32 vector
per micro-batch, ``[S (E) | C (E) | R (1)]`` (:class:`RouterCarry`), that

* the first stage (virtual stage, chunk) starts at zero (:meth:`Carry.zeros`);
* every MoE layer adds its sums to (``add_router_stats(ctx, probs, selected)``: ``ctx.carry``);
* crosses every stage boundary beside the hidden state, as the activation tuple ``(h, carry)``
  (``DsMpPipeline.forward``), so DeepSpeed's p2p sends it forward and its gradient back (``dS`` =
  coef · E · C / R² reaches each stage's routers through the p2p backward, as the hidden state's);
* crosses activation-checkpoint segments as an explicit input and output (:func:`carrying_checkpoint`),
  so a recomputed segment rebuilds the carry's graph too;
* the last stage turns into the loss term (:class:`CarriedLoss`: ``weight · coef · aux``); in an eval
  step the weight is 0 (``eval_batch`` returns the LM part) and the last stage records each micro-batch's
  carry instead (``CarriedLoss.carried``), which ``engine.step_carries()`` hands to every rank: the sums
  are linear, so a caller pools several micro-batches (an HF eval batch cut into the pipeline's rows) by
  adding their carries before :meth:`Carry.loss` (``ds_mp.hf``'s ``evaluate``, the launcher's validation).

The counts and rows are detached where the loss reads them (they carry no gradient, as in HF).
Nothing here names a family: :func:`carry_for` reads HF's own config keys (``output_router_logits``,
``router_aux_loss_coef``, ``num_experts`` / ``num_local_experts``, ``num_experts_per_tok``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ds_mp.losses.spec import BoundLoss, LossSpec


@dataclass(frozen=True)
class Carry:
    """What a micro-batch's carry holds: ``size`` fp32 values, and the loss term they make."""

    size: int

    def zeros(self, device: Any) -> torch.Tensor:
        """The carry a micro-batch enters the first stage with."""
        return torch.zeros(self.size, dtype=torch.float32, device=device)

    def loss(self, carry: torch.Tensor) -> torch.Tensor:
        """The term the last stage adds to the micro-batch's loss (before the run's weight)."""
        raise NotImplementedError


@dataclass(frozen=True)
class RouterCarry(Carry):
    """HF's load-balancing loss pooled over every MoE layer of the micro-batch (module docstring):
    the carry is ``[S (experts) | C (experts) | R]``."""

    experts: int = 0
    coef: float = 0.0  # HF's router_aux_loss_coef

    def loss(self, carry: torch.Tensor) -> torch.Tensor:
        """``coef · E · Σ_e (C_e / R)(S_e / R)``, in HF's order of operations.  R = 0 (every token
        of the micro-batch padding, where HF divides 0 by 0) gives 0."""
        E = self.experts
        probs, counts, rows = carry[:E], carry[E:2 * E].detach(), carry[2 * E].detach().clamp(min=1.0)
        return self.coef * (torch.sum((counts / rows) * (probs / rows)) * E)


def carry_for(hf_config: Any) -> Carry | None:
    """The carry a model's forward needs: HF's router statistics when its config asks for the aux
    loss (``output_router_logits``), else None (nothing travels besides the hidden state)."""
    if not getattr(hf_config, "output_router_logits", False):
        return None
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not experts:
        return None
    return RouterCarry(size=2 * experts + 1, experts=experts, coef=float(hf_config.router_aux_loss_coef))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in forward; its gradient times ``scale`` in backward (a term every TP rank adds whole to a
    gradient that is later summed over TP passes 1/TP)."""
    return _ScaleGrad.apply(x, scale)


def add_router_stats(ctx: Any, routing_weights: torch.Tensor, selected: torch.Tensor,
                     grad_scale: float = 1.0) -> None:
    """Add one MoE layer's router statistics to the running micro-batch's carry (``ctx.carry``;
    nothing when it is None: the aux loss is off).

    ``routing_weights``: ``(B·T, E)`` the router's softmax (HF's ``routing_weights`` before top-k),
    with its graph; ``selected``: ``(B·T, k)`` the top-k expert indices; tokens in the micro-batch's
    ``(B, T)`` row-major order.  Masked as HF masks: with an ``attention_mask`` (``ctx.layout``'s
    padding, ``docs < 0``) padding tokens count nowhere; packed ``position_ids`` without a mask count
    every token (HF passes no mask then).  ``grad_scale``: the probabilities' gradient is multiplied by
    it (a MoE block under TP whose router input sums its gradient over the TP ranks, each of which adds
    the same aux gradient, passes 1/TP)."""
    if ctx.carry is None:
        return
    E = routing_weights.shape[-1]
    probs = routing_weights.float()
    if grad_scale != 1.0:
        probs = scale_grad(probs, grad_scale)
    lay = ctx.layout
    keep = None if lay is None else lay.kept_tokens()
    if keep is None:
        psum = probs.sum(dim=0)
        counts = torch.bincount(selected.reshape(-1), minlength=E).float()
        rows = torch.full((1,), float(probs.shape[0]), device=probs.device)
    else:
        psum = (probs * keep.unsqueeze(-1)).sum(dim=0)
        counts = torch.zeros(E, dtype=torch.float32, device=probs.device).scatter_add_(
            0, selected.reshape(-1), keep.repeat_interleave(selected.shape[-1]))
        rows = keep.sum().reshape(1)
    ctx.carry = ctx.carry + torch.cat([psum, counts.detach(), rows.detach()])


def carrying_checkpoint(checkpoint: Callable, ctx: Any, function: Callable, *args: Any) -> Any:
    """``checkpoint(function, *args)`` with the running carry (``ctx.carry``) as one more input and
    output of the segment: a reentrant checkpoint runs its forward without a graph and rebuilds it
    from the segment's inputs in the backward, so a carry updated as a side effect would lose its
    gradient.  Without a carry: ``checkpoint(function, *args)``."""
    if ctx.carry is None:
        return checkpoint(function, *args)
    n = len(args)

    def segment(*inputs: Any) -> tuple:
        outer, ctx.carry = ctx.carry, inputs[n]  # a recomputation (in a backward) leaves ctx as it was
        try:
            out = function(*inputs[:n])
            carry = ctx.carry
        finally:
            ctx.carry = outer
        return (*(out if isinstance(out, tuple) else (out,)), carry)

    *out, ctx.carry = checkpoint(segment, *args, ctx.carry)
    return out[0] if len(out) == 1 else tuple(out)


class CarriedLoss(BoundLoss):
    """The bound loss plus the carry's term: ``spec.micro_loss + weight · carry.loss(ctx.carry)``.

    DeepSpeed scales a micro-batch loss by 1/M and averages it over the g gradient replicas.  With
    ``ctx.carry_weight`` = 1 (the engine's ``aux_reduction = "mean"``) the step holds the *mean* of
    ``coef · aux`` over its M · g micro-batches: TRL's SFTTrainer (``weighted_aux_loss / steps``, and DDP's
    mean).  With M · g (``"sum"``) it holds their *sum*: HF's Trainer with ``num_items_in_batch``, which
    adds each forward's ``coef · aux`` whole, neither divided by the accumulation nor averaged over
    processes (it multiplies the loss by the process count before DDP's mean).  The LM part is the
    loss spec's, unchanged.

    ``carried``: while a list (the engine's eval steps, ``ds_mp.engine.rows.start``), each call appends
    its micro-batch's carry, detached fp32 ``(size,)``; None: nothing recorded.  ``record_training``: training
    steps record it too (``ds_mp.engine.rows.start``; a caller that logs the aux, ``ds_mp.hf.DPOTrainer``).

    The LM loss adds the term to its per-token loss; the ``"dpo"`` loss (``normalization: "micro_batch"``)
    to its micro-batch's pair mean, ``dpo_mb + coef · aux_mb`` with aux over the micro-batch's
    ``[chosen; rejected]`` rows: TRL's DPOTrainer's ``loss + router_aux_loss_coef * outputs.aux_loss``."""

    def __init__(self, spec: LossSpec, ctx: Any, carry: Carry) -> None:
        super().__init__(spec, ctx)
        self.carry = carry
        self.carried: list[torch.Tensor] | None = None
        self.record_training = False

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        loss = super().__call__(logits, labels)
        if self.ctx.carry is None:
            return loss
        if self.carried is not None:
            self.carried.append(self.ctx.carry.detach().float().clone())
        if self.ctx.carry_weight == 0.0:
            return loss
        return loss + self.ctx.carry_weight * self.carry.loss(self.ctx.carry).to(loss.dtype)


__all__ = ["Carry", "RouterCarry", "carry_for", "add_router_stats", "carrying_checkpoint", "CarriedLoss", "scale_grad"]
