"""LAMB: layer-wise adaptive moments for large-batch training (You et al., 2019).

DeepSpeed's own ``Lamb`` is a CUDA kernel ("not implemented on CPU backend"); this one is
plain tensor maths, so it runs on CPU and GPU alike and can be handed to
``deepspeed.initialize(optimizer=...)`` as a client optimizer.

For every parameter tensor w with gradient g, at step t (1-based):

    m_t   = beta1 * m_{t-1} + (1 - beta1) * g
    v_t   = beta2 * v_{t-1} + (1 - beta2) * g * g
    m_hat = m_t / (1 - beta1^t)                  (bias correction, optional)
    v_hat = v_t / (1 - beta2^t)
    u     = m_hat / (sqrt(v_hat) + eps) + wd * w  (Adam direction + decoupled decay)
    r     = clip(||w|| / ||u||, 0, max_trust)    (trust ratio; r = 1 if ||w|| = 0 or ||u|| = 0)
    w     = w - lr * r * u

The norms are over the whole *layer* — one parameter tensor of the model.  By default each
tensor the optimizer holds is its own layer.  When the tensors are not the model's (DeepSpeed's
bf16 and ZeRO-1/2 wrappers hand the optimizer one flat fp32 partition per parameter group and
DP rank, cut wherever the group's flat buffer is cut; tensor parallelism holds 1/TP of a
matrix), :meth:`Lamb.set_layers` attaches a :class:`LayerMap`: which ranges of which tensor
belong to which layer, and a collective that sums the per-layer partial squares over the
ranks holding the other pieces.  Then

    ||w||² = Σ_pieces ||w_piece||²,   ||u||² = Σ_pieces ||u_piece||²

and every piece of a layer takes the layer's one trust ratio: the update equals plain LAMB on
the unsharded model, at any TP, DP or ZeRO stage.  The trust ratio is computed with tensor
ops only, so a step never synchronises the device with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

__all__ = ["Lamb", "LayerMap", "param_groups_no_decay"]


@dataclass
class LayerMap:
    """Where the layers lie in the optimizer's tensors.

    ``pieces[id(t)]``: the ``(start, numel, layer)`` ranges of the optimizer's tensor ``t``
    (flattened; keyed by identity: a wrapper may step one group at a time); elements in no
    range (padding) are left as they are.  ``reduce(partial)``
    turns this rank's ``(layers, 2)`` partial sums ``[Σw², Σu²]`` into the totals over every
    rank holding a piece, in place; a collective, called once per step on every rank.
    """

    layers: int
    pieces: dict[int, list[tuple[int, int, int]]]
    reduce: Callable[[torch.Tensor], None]
    device: torch.device  # where the partial sums live (the collective's device)


class Lamb(torch.optim.Optimizer):
    """LAMB optimizer; see the module docstring for the update rule.

    Args:
        params: parameters or param groups (each group may set ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``max_trust``, ``bias_correction``).
        lr: learning rate.
        betas: (beta1, beta2) of the first and second moment averages.
        eps: added to sqrt(v_hat) in the denominator.
        weight_decay: decoupled weight decay wd, added to the update *before* the trust ratio.
        max_trust: upper clip of the trust ratio r (the paper's phi clips at 10).
        bias_correction: divide the moments by (1 - beta^t) as Adam does.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust: float = 10.0,
        bias_correction: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must lie in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0 or max_trust <= 0.0:
            raise ValueError(
                f"Lamb: need eps >= 0, weight_decay >= 0, max_trust > 0; "
                f"got eps={eps}, weight_decay={weight_decay}, max_trust={max_trust}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_trust=max_trust, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.layers: LayerMap | None = None

    def set_layers(self, layers: LayerMap | None) -> None:
        """Take trust ratios per layer of ``layers`` (None: per tensor, the default)."""
        self.layers = layers

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (tensor, its update u, its pieces, max_trust, lr)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                dt = torch.promote_types(p.dtype, torch.float32)   # bf16/fp16 -> fp32 maths
                g_ = p.grad.to(dt)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dt)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dt)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g_, alpha=1.0 - beta1)           # m_t
                v.mul_(beta2).addcmul_(g_, g_, value=1.0 - beta2)    # v_t
                if group["bias_correction"]:
                    m_hat = m / (1.0 - beta1 ** t)
                    v_hat = v / (1.0 - beta2 ** t)
                else:
                    m_hat, v_hat = m, v
                u = m_hat / (v_hat.sqrt() + group["eps"])            # Adam direction
                if group["weight_decay"] != 0.0:
                    u.add_(p.to(dt), alpha=group["weight_decay"])    # + wd * w
                pieces = self._pieces(p, len(work))
                work.append((p, u, pieces, group["max_trust"], group["lr"]))
        ratios = self._trust_ratios(work)
        for p, u, pieces, max_trust, lr in work:
            r = torch.stack([ratios[layer] for _, _, layer in pieces]).clamp(0.0, max_trust)  # r in [0, max_trust]
            self.state[p]["last_trust_ratio"] = r[0] if self.layers is None else r  # for logging / tests
            flat_p, flat_u = p.view(-1), u.view(-1)
            for k, (start, n, _) in enumerate(pieces):                # w -= lr * r * u, per piece
                flat_p.narrow(0, start, n).add_((flat_u.narrow(0, start, n) * (-lr * r[k])).to(p.dtype))
        return loss

    def _pieces(self, p: torch.Tensor, k: int) -> list[tuple[int, int, int]]:
        """The (start, numel, layer) pieces of ``p``, the ``k``-th tensor of this step."""
        if self.layers is None:
            return [(0, p.numel(), k)]  # the whole tensor is its own layer
        return self.layers.pieces.get(id(p), [])

    def _trust_ratios(self, work: list) -> dict[int, torch.Tensor]:
        """Layer -> ||w|| / ||u|| (1 where either is 0), from every piece (reduced across ranks)."""
        views_w, views_u, index = [], [], []
        for p, u, pieces, _, _ in work:
            dt = u.dtype
            for start, n, layer in pieces:
                views_w.append(p.view(-1).narrow(0, start, n).to(dt))
                views_u.append(u.view(-1).narrow(0, start, n))
                index.append(layer)
        n_layers = self.layers.layers if self.layers is not None else len(work)
        device = self.layers.device if self.layers is not None else work[0][0].device if work else None
        dt = torch.float64 if any(u.dtype == torch.float64 for _, u, _, _, _ in work) else torch.float32
        partial = torch.zeros(n_layers, 2, dtype=dt, device=device)
        if index:
            sq_w = torch.stack(torch._foreach_norm(views_w)).to(dt).pow(2)
            sq_u = torch.stack(torch._foreach_norm(views_u)).to(dt).pow(2)
            at = torch.tensor(index, device=device)
            partial[:, 0].index_add_(0, at, sq_w)
            partial[:, 1].index_add_(0, at, sq_u)
        if self.layers is not None:
            self.layers.reduce(partial)  # collective: every rank, every step
        w_norm, u_norm = partial[:, 0].sqrt(), partial[:, 1].sqrt()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(torch.finfo(u_norm.dtype).tiny),
                            torch.ones_like(w_norm))
        return {k: ratio[k] for k in range(n_layers)}


def param_groups_no_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed group and a ``weight_decay=0`` group.

    No decay for: every 1-D parameter (biases, LayerNorm weights and biases), and any
    parameter owned by a ``nn.LayerNorm``. Everything else (matrices, embeddings) decays.
    Tied parameters appear once (``named_parameters`` deduplicates them).

    Returns ``[{"params": decay, "weight_decay": weight_decay},
    {"params": no_decay, "weight_decay": 0.0}]``; an empty group is dropped.
    """
    layer_norm_params = {id(p) for mod in model.modules() if isinstance(mod, nn.LayerNorm)
                         for p in mod.parameters(recurse=False)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith(".bias") or id(p) in layer_norm_params:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
