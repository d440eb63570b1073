"""Ouroboros: delayed-gradient model parallelism for a tied-embedding GPT-2 (Algorithm 1), and
for the Llama family (tied or untied head) through the same algebra.

Yang, Huo, Wang, Huang, Carin, "Ouroboros: On Accelerating Training of Transformer-Based
Language Models" (NeurIPS 2019), built on decoupled backprop / features replay (Huo et al. 2018).
Module ids here are 0-based: G_m, m = 0..K-1, is the paper's module k = m + 1.

Split and layout
    G_0     = input embedding V_i (wte) + wpe + first blocks
    G_m     = blocks only, 0 < m < K-1
    G_{K-1} = last blocks + ln_f + output projection V_o = V_i = V (tied: logits = h V^T)
    K modules on K-1 ranks, a ring: rank 0 holds G_0 and G_{K-1} (so V lives on one rank and
    needs no tied-gradient all-reduce), rank r holds G_r for r = 1..K-2.
    Any family: G_0 holds the layers its table puts before the first block, G_{K-1} those after
    the last (Llama: embed_tokens; norm + lm_head, tied to embed_tokens or an own weight, which
    then takes only df_t/dV_o undelayed and no 1/2).  The reference cuts HF's unmodified model
    (``hf_modules``).

Contract (what OuroborosReference.step computes). Notation: w^t = all weights at the start of
iteration t (after t updates); x_t, y_t = batch of iteration t; h_m^s = input of G_m for sample s
(h_0^s = token ids); d_m = K-1-m = delay of G_m (paper: K-k).  Iteration t:
  1. Forward, locked, current weights: h_{m+1}^t = G_m(h_m^t; w^t) for m = 0..K-2; G_m stashes h_m^t.
  2. G_{K-1}: f_t = CE(G_{K-1}(h_{K-1}^t; w^t), y_t) (returned by step());
     g_{K-1} = df_t/dw_{K-1} (undelayed) and delta_{K-2}^t = df_t/dh_{K-1}^t goes to G_{K-2}.
  3. Every m < K-1 with s = t - d_m >= 0 replays G_m on its stash h_m^s with the CURRENT weights
     w^t (features replay; the forward of sample s used w^s) and backpropagates the delta_m^s it
     received at iteration t-1:
        g_m = (dG_m(h_m^s; w^t)/dw_m)^T delta_m^s,  delta_{m-1}^s = (dG_m(h_m^s; w^t)/dh)^T delta_m^s,
     and delta_{m-1}^s is used by G_{m-1} at iteration t+1 (sample (t+1) - d_{m-1} = s).
     Warm-up, t < d_m: G_m has no sample yet and g_m = 0.
  4. Tied embedding: g_V = 1/2 (df_t/dV_o + df_{t-K+1}/dV_i)      (tied_rule="mean", the paper's rule
     as read here; "sum" drops the 1/2). The V_i term is 0 for t < K-1. wpe belongs to G_0.
  5. Every parameter with a gradient steps (one optimizer over all).  A parameter all of whose
     modules are still in warm-up has no gradient (None), so the optimizer skips it: no Adam
     step count, no weight decay, no momentum on a gradient that does not exist.  Under plain
     SGD this is the paper's zero-gradient update; under Adam-type optimizers a zero-gradient
     step would advance the bias correction and decay weights, which the algorithm never asks for.
recompute="current" (the default, features replay as the paper's memory paragraph describes)
replays G_m with w^t; recompute="stashed" keeps the weights the forward of sample s used (w^s,
PipeDream-2BW-style weight stashing, the literal reading of eq. (8)) and replays with them,
costing d_m + 1 copies of G_m's weights.
delay=False sets d_m = 0 (delta used within the iteration) and tied_rule="sum": the replay then
recomputes the very forward of step 1, so this is exact backprop of the HF model.

Zero gradients in warm-up: SGD without momentum/weight decay does not move; SGD momentum buffers
and Adam's m, v start at 0, so the update 0 or 0/(sqrt(0)+eps) = 0 does not move either, but
Adam's step counter advances, so G_m's first real update is bias-corrected with count d_m + 1.
Weight decay (SGD weight_decay, AdamW) does move weights on zero gradients.

Memory: G_m keeps d_m + 1 = K - m stashed inputs (paper: K-k+1) and the last delta it received.
Dropout: a replay must apply the masks its forward drew, so the RNG state is captured before
each locked forward and restored (in a forked stream) for its replay: module_backward(rng=...).
The reference refuses dropout unless replay_dropout=True (the distributed engine always replays).

Where the rest lives: the split, ring layout and per-rank timetable in
``ds_mp.schedules.ouroboros.timetable``; the distributed engine on K-1 ranks in
``ds_mp.engine.ouroboros``, which shares this reference's gradient assembly
(``ds_mp.engine.ouroboros_modules.grad_holders``/``module_grad_sum``).  This module is the
tests' oracle, not part of the package; the HF modules it cuts are in ``ouroboros_hf_modules``.
"""
from __future__ import annotations

import copy
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_mp.engine.ouroboros_modules import grad_holders, module_grad_sum
from ds_mp.models.family import family_of
from ds_mp.schedules.ouroboros.timetable import (ModuleBackward, ModuleForward, RecvDelta, RecvHidden, SendDelta,
                                                  SendHidden, Step, UpdateModules, format_timetable,
                                                  ouroboros_timetable, rank_steps, ring_layout, split_modules)
from ouroboros_hf_modules import OuroborosModule

__all__ = ["split_modules", "ring_layout", "ModuleForward", "ModuleBackward", "SendHidden", "RecvHidden", "SendDelta",
           "RecvDelta", "UpdateModules", "Step", "rank_steps", "ouroboros_timetable", "format_timetable", "OuroborosModule",
           "build_modules", "lm_loss", "RngState", "capture_rng", "replay_rng", "module_forward", "module_backward",
           "loss_backward", "OuroborosReference", "module_grad_sum", "grad_holders", "swapped_weights"]


# ----------------------------------------------------------------------------- module maths
def build_modules(model: nn.Module, K: int, split: list[range] | None = None) -> list[OuroborosModule]:
    """Cut the HF causal LM `model` (any family of ``ds_mp.models.family``) into G_0..G_{K-1}
    (``split``, default ``split_modules(n_layer, K)``), sharing its parameters."""
    split = split or split_modules(model.config.num_hidden_layers, K)
    return [OuroborosModule(m, K, model, blocks) for m, blocks in enumerate(split)]


@contextmanager
def swapped_weights(params: list[nn.Parameter], values: list[Tensor] | None) -> Iterator[None]:
    """Inside the block ``params`` hold ``values`` (stashed weights); restored afterwards.
    ``values=None``: the current weights (nothing swapped).  Backpropagate inside the block."""
    if values is None:
        yield
        return
    current = [p.data for p in params]
    for p, v in zip(params, values):
        p.data = v
    try:
        yield
    finally:
        for p, c in zip(params, current):
            p.data = c


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """HF causal-LM loss: mean CE of logits[:, :-1] against labels[:, 1:], ignoring -100."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


RngState = Tuple[Tensor, Optional[Tensor]]  # (CPU generator state, CUDA state of the device or None)


def capture_rng(device: torch.device) -> RngState:
    """The RNG state a forward on `device` is about to draw its dropout masks from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def replay_rng(state: RngState | None, device: torch.device) -> Iterator[None]:
    """Run the body on `state` (the same masks as the captured forward); the ambient stream is
    left as it was. state=None: run on the ambient stream."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def module_forward(module: OuroborosModule, x: Tensor) -> Tensor:
    """Locked forward of step 1, no graph kept: h_{m+1} = G_m(h_m; current weights)."""
    with torch.no_grad():
        return module(x)


def _grads(module: nn.Module, out: Tensor, x: Tensor, grad_out: Tensor | None) -> tuple[Tensor | None, list[Tensor]]:
    params = list(module.parameters())
    inputs = [x] + params if x.requires_grad else params
    grads = torch.autograd.grad(out, inputs, grad_outputs=grad_out, materialize_grads=True)
    return (grads[0], list(grads[1:])) if x.requires_grad else (None, list(grads))


def _leaf(x: Tensor) -> Tensor:
    return x.detach().requires_grad_(x.is_floating_point())


def module_backward(module: OuroborosModule, x_saved: Tensor, delta: Tensor,
                    rng: RngState | None = None) -> tuple[Tensor | None, list[Tensor]]:
    """Replay backward of step 3 with the module's current weights w (and, given `rng` from
    capture_rng before the forward, that forward's dropout masks):
    returns (dG(x; w)/dx)^T delta (None for G_0, whose input is ids) and
    [(dG(x; w)/dp)^T delta for p in module.parameters()]."""
    with torch.enable_grad(), replay_rng(rng, x_saved.device):
        x = _leaf(x_saved)
        return _grads(module, module(x), x, delta)


def loss_backward(module: OuroborosModule, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """Step 2 for G_{K-1}: (f, df/dx, [df/dp for p in module.parameters()]), f = lm_loss(G(x), labels)."""
    with torch.enable_grad():
        x = _leaf(x)
        loss = lm_loss(module(x), labels)
        grad_x, grads = _grads(module, loss, x, None)
    return loss.detach(), grad_x, grads


# ----------------------------------------------------------------------------- reference
class OuroborosReference:
    """Single-process Ouroboros (the module docstring's contract), one step() per iteration.

    Owns a deep copy of `model`; `self.model` is that copy (HF layout, tied), `self.parts` its
    modules. `backward_samples[m]` is the sample G_m backpropagated at the last step (None in
    warm-up), for checking against ouroboros_timetable.
    """

    def __init__(self, model: nn.Module, K: int,
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 delay: bool = True, tied_rule: Literal["mean", "sum"] | None = None,
                 replay_dropout: bool = False, split: list[range] | None = None,
                 recompute: Literal["current", "stashed"] = "current") -> None:
        if max(family_of(model.config).dropouts(model.config)) > 0 and not replay_dropout:
            raise ValueError("OuroborosReference needs every dropout probability 0 (GPT-2's *_pdrop, the Llama "
                             "family's attention_dropout: the replay would draw a new mask), or replay_dropout=True")
        self.model = copy.deepcopy(model)
        self.K, self.delay, self.t = K, delay, 0
        self.tie_scale = 0.5 if (tied_rule or ("mean" if delay else "sum")) == "mean" else 1.0
        self.parts = build_modules(self.model, K, split)
        self._holders = grad_holders(self.parts)
        self.recompute = recompute
        self.optimizer = make_optimizer(self.model.parameters())
        self.delays = [K - 1 - m if delay else 0 for m in range(K)]
        # G_m's stash: (sample, input, RNG state of its forward, its weights if recompute="stashed")
        self._stash: list[deque[tuple[int, Tensor, RngState, list[Tensor] | None]]] = [deque() for _ in range(K)]
        self._inbox: dict[int, tuple[int, Tensor]] = {}  # m -> (s, delta_m^s) received last iteration
        self.backward_samples: list[int | None] = [None] * K

    def step(self, input_ids: Tensor, labels: Tensor) -> float:
        """Run iteration t = self.t on batch (input_ids, labels); returns f_t."""
        K, t = self.K, self.t
        h = input_ids
        for m in range(K - 1):  # 1. locked forward with w^t
            kept = [p.detach().clone() for p in self.parts[m].parameters()] if self.recompute == "stashed" else None
            self._stash[m].append((t, h, capture_rng(h.device), kept))
            assert len(self._stash[m]) <= self.delays[m] + 1
            h = module_forward(self.parts[m], h)
        loss, delta, grads_last = loss_backward(self.parts[K - 1], h, labels)  # 2.
        grads: dict[int, list[Tensor]] = {K - 1: grads_last}
        outbox = {K - 2: (t, delta)}
        self.backward_samples = [None] * (K - 1) + [t]
        for m in reversed(range(K - 1)):  # 3. replay backward, delayed or not
            received = self._inbox.get(m) if self.delay else outbox.get(m)
            if received is None:  # warm-up: nothing to backprop yet
                continue
            s, delta_m = received
            s_stash, x, rng, kept = self._stash[m].popleft()
            assert s_stash == s == t - self.delays[m], (m, s_stash, s, t)
            with swapped_weights(list(self.parts[m].parameters()), kept):
                grad_x, grads[m] = module_backward(self.parts[m], x, delta_m, rng)
            self.backward_samples[m] = s
            if m > 0:
                outbox[m - 1] = (s, grad_x)
        self._inbox = outbox
        self._apply(grads)  # 4. and 5.
        self.t += 1
        return loss.item()

    def _apply(self, grads: dict[int, list[Tensor]]) -> None:
        """p.grad = sum of the module gradients of p (a module in warm-up contributes zero); the
        tied V (in G_0 and G_{K-1}) gets tie_scale * (g_Vo + g_Vi); a parameter whose modules are
        all in warm-up gets None and is skipped. Then one optimizer step."""
        for p in self.model.parameters():
            p.grad = module_grad_sum(p, self._holders, grads, self.tie_scale)
        self.optimizer.step()
