"""The routers' statistics of one micro-batch and HF's load-balancing (aux) loss computed from them.

HF (transformers 5.25, ``load_balancing_loss_func`` of ``qwen3_moe``/``mixtral``/``qwen2_moe``) pools
every MoE layer of a micro-batch before it multiplies: with, summed over the sparse layers ``l`` and
the tokens ``t`` that ``attention_mask`` keeps (every token without a mask),

    C_e = Σ_{l,t} [e ∈ top-k(p_{l,t})]    (top-k hits: no gradient)
    P_e = Σ_{l,t} p_{l,t,e}               (router probabilities, softmax of the router logits)
    R   = Σ_{l,t} 1                       (the rows: kept tokens × sparse layers)

the aux loss is ``E · Σ_e (C_e / R) · (P_e / R)``.  So a layer reports three sums
(:class:`RouterStats`) and any set of layers — one pipeline stage's, or every stage's — adds
theirs: the interface a stage boundary carries (``counts`` and ``rows`` are plain numbers; the
gradient flows only through ``probs``).

A run with ``output_router_logits`` keeps a :class:`RouterLog` on its ``Ctx``: each sparse layer
:meth:`RouterLog.record`\\s its sums during the forward, and the loss of the micro-batch
(:class:`AuxBoundLoss`, the loss slot bound to the stage's ``Ctx``) :meth:`RouterLog.take`\\s them
and adds ``router_aux_loss_coef · aux`` as HF adds it to its loss: HF's micro-batch loss is the mean
token loss + coef · aux, and ds_mp's per-token normalisation weighs each micro-batch by its target
count c over the global count N, so the micro-batch adds ``coef · aux · c`` to the numerator
(``(S + coef · aux · c) / D``; ``micro_batch`` normalisation: D = c, HF's own loss).

Under TP every rank computes the same statistics from the replicated router, and the router weight
and its input sum their gradient over TP (each rank's expert path adds a partial gradient): the
aux path's gradient is therefore scaled by 1/TP on each rank (:func:`RouterLog.record`), so the sum
is the one gradient HF computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_mp.losses.spec import BoundLoss, LossSpec


@dataclass
class RouterStats:
    """Sums over some sparse layers of one micro-batch (module docstring): ``counts`` (E,) top-k hits
    and ``probs`` (E,) router probabilities over the kept tokens, ``rows`` () the kept tokens × layers;
    fp32.  Sums, so stages add them (``a + b``)."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.counts + other.counts, self.probs + other.probs, self.rows + other.rows)

    def aux_loss(self) -> torch.Tensor:
        """HF's ``load_balancing_loss_func`` of these sums: ``E · Σ_e (C_e / R)(P_e / R)``."""
        return (self.counts / self.rows * (self.probs / self.rows)).sum() * self.counts.numel()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def layer_stats(probs: torch.Tensor, top_index: torch.Tensor, keep: torch.Tensor | None,
                tp: int = 1) -> RouterStats:
    """One layer's :class:`RouterStats` from its router probabilities ``probs`` (N, E) fp32 (with
    gradient), its top-k expert indices ``top_index`` (N, k) and ``keep`` (N,) the tokens HF's
    ``attention_mask`` keeps (None: all); ``probs`` enters with its gradient scaled by 1/``tp``
    (module docstring)."""
    n, experts = probs.shape
    w = torch.ones(n, device=probs.device) if keep is None else keep.reshape(-1).to(probs.device, torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, top_index.reshape(-1), w.repeat_interleave(top_index.shape[1]))
    p = _ScaleGrad.apply(probs, 1.0 / tp) if tp > 1 else probs
    return RouterStats(counts, (p.float() * w[:, None]).sum(0), w.sum())


class RouterLog:
    """The routers' statistics of the micro-batch being computed on this stage (module docstring):
    :meth:`record` by each sparse layer in the forward, :meth:`take` by the micro-batch's loss.
    ``coef``: ``router_aux_loss_coef``."""

    def __init__(self, coef: float) -> None:
        self.coef = coef
        self.pending: RouterStats | None = None

    def record(self, stats: RouterStats) -> None:
        self.pending = stats if self.pending is None else self.pending + stats

    def take(self) -> RouterStats | None:
        """The sums recorded since the last take (None: no sparse layer ran), and forget them."""
        out, self.pending = self.pending, None
        return out


class AuxBoundLoss(BoundLoss):
    """The loss slot bound to a stage's ``Ctx`` with HF's aux loss added: ``(S + coef · aux · c) / D``
    (module docstring) for the micro-batch whose routers' sums ``ctx.router_log`` holds."""

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        loss = self.spec.micro_loss(logits, labels, self.ctx)
        log: RouterLog = self.ctx.router_log
        stats = log.take()
        if stats is None:
            return loss
        targets, denominator, _ = self.spec.unpack(labels)
        return loss + log.coef * stats.aux_loss() * self.spec.units(targets) / denominator


def bind_loss(spec: LossSpec, ctx: Any) -> BoundLoss:
    """``spec`` bound to the stage's ``ctx``: with the aux loss when the run logs its routers."""
    return AuxBoundLoss(spec, ctx) if getattr(ctx, "router_log", None) is not None else spec.bind(ctx)


__all__ = ["RouterStats", "RouterLog", "AuxBoundLoss", "bind_loss", "layer_stats"]
