"""Engine side of Ouroboros: the ring's state and the handlers of its instructions.

Ouroboros runs on ds_mp's pipeline engine like every schedule: the model is ds_mp's GPT-2
pipeline (TP ``Block``s, vocab-parallel tied embedding and loss) built in the ring order of
``ring_pipeline_layout`` (ring rank 0 holds G_0 and G_{K-1}, which share ``wte``; rank r holds
G_r), and ``OuroborosSchedule`` yields ``rank_steps(K, t, rank)`` each ``train_batch``.  The
update is exactly ``OuroborosReference.step`` (``ds_mp.schedules.ouroboros.algorithm``):

    forward with w^t, send h; replay G_m on the stashed input of sample t - d_m with the CURRENT
    weights w^t (``ouroboros.recompute = "current"``; ``"stashed"`` replays with the weights the
    forward used) under the forward's captured RNG state, so dropout masks repeat and no graph
    outlives an optimizer step; send delta; ``UpdateModules``: p.grad = the sum of the module
    gradients of p (the tied V: 1/2 (dV_o + dV_i), or the sum when delay=False), None for a
    parameter whose modules are all still in warm-up (the optimizer skips it), then the
    engine's own DP reduce and optimizer step — DeepSpeed's optimizer and LR scheduler, ds_mp's
    global-norm clipping and NaN skip.

One ``train_batch`` is one iteration (one update).  Ring rank 0 reads
``gradient_accumulation_steps`` micro-batches and concatenates them along the batch into x_t
(the loss is the mean over all its tokens); other ring ranks read nothing.  The stash, the
deltas in flight and t are the engine's schedule state, saved per rank with each checkpoint.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_mp import deepspeed_compat as compat
from ds_mp.engine.pipeline_engine import DsMpPipelineEngine
from ds_mp.schedules.ouroboros.algorithm import grad_holders, module_grad_sum, swapped_weights
from ds_mp.schedules.ouroboros.timetable import (ModuleBackward, ModuleForward, RecvDelta, RecvHidden, SendDelta,
                                                 SendHidden, UpdateModules, config_split, module_owner, ring_layout)
from ds_mp.tensor_parallel.random import rng_state, set_rng_state


@contextlib.contextmanager
def _replayed(state: dict | None) -> Iterator[None]:
    """Run the body on the captured RNG ``state`` (every stream ds_mp draws dropout from); the
    ambient streams are left as they were."""
    if state is None:
        yield
        return
    ambient = rng_state()
    set_rng_state(state)
    try:
        yield
    finally:
        set_rng_state(ambient)


def _leaf(x: Tensor) -> Tensor:
    return x.detach().requires_grad_(x.is_floating_point())


class OuroborosState:
    """One ring rank's Ouroboros state (see the module docstring) and its engine hooks."""

    def __init__(self, engine: Any) -> None:
        cfg = engine.ds_mp_config
        self.engine, self.K, self.delay = engine, engine.num_stages + 1, cfg.ouroboros.delay
        self.tie_scale = 0.5 if self.delay else 1.0  # g_V = tie_scale (dV_o + dV_i)
        self.stash_weights = cfg.ouroboros.recompute == "stashed"
        self.repeat_dropout = cfg.ouroboros.repeat_dropout
        self.iteration = 0
        self.owner = module_owner(self.K)
        funcs = engine.module.forward_funcs
        mine = ring_layout(self.K)[engine.stage_id]
        if engine.stage_id == 0:  # [wte, wpe, G_0 blocks, G_{K-1} blocks, ln_f, head]
            n0 = len(config_split(cfg)[0])
            self.ranges = {0: (0, 2 + n0), self.K - 1: (2 + n0, len(funcs))}
        else:
            self.ranges = {mine[0]: (0, len(funcs))}
        self.params = {m: self._module_params(funcs[a:b]) for m, (a, b) in self.ranges.items()}
        self.holders = grad_holders(self.params)
        # G_m's stash: (sample, input, RNG state of its forward, its weights when recompute="stashed")
        self.stash: dict[int, deque[tuple[int, Tensor, dict, list[Tensor] | None]]] = {m: deque() for m in self.ranges}
        self.acts: dict[tuple[int, int], Tensor] = {}    # (m, s) -> input of G_m for sample s
        self.deltas: dict[tuple[int, int], Tensor] = {}  # (m, s) -> delta_m^s, G_m backprops it
        self.grads: dict[int, list[Tensor]] = {}
        self.loss: Tensor | None = None
        self.labels: Tensor | None = None

    @staticmethod
    def _module_params(funcs: list) -> list[nn.Parameter]:
        """Parameters of the layers ``funcs`` (tied layers are partials over the tied module)."""
        seen: dict[int, nn.Parameter] = {}
        for f in funcs:
            module = f if isinstance(f, nn.Module) else f.args[0]
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def next_iteration(self) -> int:
        t, self.iteration = self.iteration, self.iteration + 1
        return t

    # --- module maths -------------------------------------------------------------------
    def run(self, m: int, x: Any) -> Tensor:
        """G_m(x): token ids -> hidden for G_0, hidden -> hidden, hidden -> local logits for G_{K-1}."""
        a, b = self.ranges[m]
        for f in self.engine.module.forward_funcs[a:b]:
            x = f(x)
        return x

    def forward(self, m: int, s: int) -> None:
        x = self.acts.pop((m, s)) if m > 0 else self._load_batch()
        kept = [p.detach().clone() for p in self.params[m]] if self.stash_weights and m < self.K - 1 else None
        self.stash[m].append((s, x, rng_state(), kept))  # the replay reuses this forward's masks
        if m < self.K - 1:  # G_{K-1} runs forward and backward as one graph in backward()
            with torch.no_grad():
                self.acts[(m + 1, s)] = self.run(m, x)

    def backward(self, m: int, s: int) -> None:
        stashed, x_saved, rng, kept = self.stash[m].popleft()
        assert stashed == s, f"G_{m} replays sample {s} but its oldest stash is sample {stashed}"
        params = self.params[m]
        with torch.enable_grad():
            x = _leaf(x_saved)
            wrt = ([x] if x.requires_grad else []) + params
            if m == self.K - 1:  # on the ambient streams, as its forward is this very call
                out = self.loss = self.engine.module.loss_fn(self.run(m, x), self.labels)
                grads = torch.autograd.grad(out, wrt, materialize_grads=True)
                self.loss = out.detach()
            else:
                with swapped_weights(params, kept):
                    with _replayed(rng if self.repeat_dropout else None):
                        out = self.run(m, x)
                    grads = torch.autograd.grad(out, wrt, grad_outputs=self.deltas.pop((m, s)),
                                                materialize_grads=True)
        if x.requires_grad:
            self.deltas[(m - 1, s)], grads = grads[0], grads[1:]
        self.grads[m] = list(grads)

    def update(self) -> None:
        """p.grad = Σ_m (module m's gradient of p), the tied V scaled by tie_scale, None while all
        of p's modules are in warm-up; then the shared DP reduce and optimizer step."""
        waiting = []
        for p in self.engine.module.parameters():
            p.grad = module_grad_sum(p, self.holders, self.grads, self.tie_scale)
            if p.grad is None:
                waiting.append(p)
        self.grads.clear()
        self.engine.reduce_gradients()
        if compat.uses_bf16_optimizer(self.engine):
            # bf16: DeepSpeed's BF16_Optimizer steps its fp32 master copies as one flat group and needs
            # every gradient, so modules in warm-up step with zeros here (a plain optimizer skips them).
            for p in waiting:
                p.grad = torch.zeros_like(p)
            compat.copy_bf16_grads_to_master(self.engine)
        else:
            for p in waiting:  # DeepSpeed's DP reduce gives gradient-less parameters zeros: skip them again
                p.grad = None
        self.engine.optimizer_step()

    def _load_batch(self) -> Tensor:
        """Ring rank 0: x_t = the concatenation of this iteration's micro-batches."""
        e = self.engine
        pairs = [compat.next_batch(e) for _ in range(e.micro_batches)]
        ids, labels = (torch.cat([pair[i] for pair in pairs]).to(e.device) for i in (0, 1))
        self.labels = labels
        return ids

    # --- ring p2p ------------------------------------------------------------------------
    def _peer(self, ring_rank: int) -> int:
        topo = self.engine.topology
        return topo.rank_of(tp=topo.tp_rank, pp=ring_rank, dp=topo.dp_rank)

    def send(self, x: Tensor, ring_rank: int, header: bool = False) -> None:
        dev = self.engine.device
        if header:  # activations announce their (B, T, C); deltas have the shape of a stashed output
            dist.send(torch.tensor(x.shape, dtype=torch.long, device=dev), self._peer(ring_rank))
        dist.send(x.contiguous(), self._peer(ring_rank))

    def recv(self, ring_rank: int, shape: tuple[int, ...] | None = None) -> Tensor:
        dev = self.engine.device
        if shape is None:
            header = torch.empty(3, dtype=torch.long, device=dev)
            dist.recv(header, self._peer(ring_rank))
            shape = tuple(header.tolist())
        buf = torch.empty(shape, dtype=next(self.engine.module.parameters()).dtype, device=dev)
        dist.recv(buf, self._peer(ring_rank))
        return buf

    # --- engine hooks --------------------------------------------------------------------
    def aggregate_loss(self) -> Tensor:
        """Ring rank 0's f_t, averaged over DP replicas, on every rank of the ring."""
        e, topo = self.engine, self.engine.topology
        first = e.stage_id == 0
        out = self.loss.detach().float().clone() if first else torch.zeros((), device=e.device)
        if first and topo.dp > 1:
            dist.all_reduce(out, group=topo.dp_group)
            out /= topo.dp
        if e.num_stages > 1:
            dist.broadcast(out, src=topo.rank_of(tp=topo.tp_rank, pp=0, dp=topo.dp_rank), group=topo.pp_group)
        return out

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: int | None = None,
                   **kwargs: Any) -> Tensor:
        """Mean loss of ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches
        through the ring with the current weights; the in-flight training state is untouched."""
        e, K, r = self.engine, self.K, self.engine.stage_id
        total = torch.zeros((), device=e.device)
        n = num_micro_batches or e.micro_batches
        e.module.eval()
        try:
            for _ in range(n):
                if r == 0:
                    ids, labels = (t.to(e.device) for t in next(data_iter))
                    h = self.run(0, ids)
                    if self.owner[1] != 0:
                        self.send(h, self.owner[1], header=True)
                        h = self.recv(self.owner[K - 2])
                    total += e.module.loss_fn(self.run(K - 1, h), labels).float()
                else:
                    self.send(self.run(r, self.recv(r - 1)), self.owner[r + 1], header=True)
        finally:
            e.module.train()
        self.loss, saved = total / n, self.loss
        try:
            return self.aggregate_loss()
        finally:
            self.loss = saved

    def state_dict(self) -> dict:
        """The work in flight: t, the stashed inputs (with their forward's RNG state), the deltas."""
        return {"K": self.K, "delay": self.delay, "iteration": self.iteration,
                "stash": [[m, [(s, x.cpu(), rng, None if kept is None else [w.cpu() for w in kept])
                               for s, x, rng, kept in q]] for m, q in self.stash.items()],
                "deltas": [[m, s, d.cpu()] for (m, s), d in self.deltas.items()]}

    def load_state_dict(self, state: dict) -> None:
        if (state["K"], state["delay"]) != (self.K, self.delay):
            raise ValueError(f"Ouroboros state holds K={state['K']}, delay={state['delay']}; this engine has "
                             f"K={self.K}, delay={self.delay}: load it with the same ds_mp.ouroboros settings")
        dev = self.engine.device
        self.iteration = state["iteration"]
        self.stash = {m: deque((s, x.to(dev), rng, None if kept is None else [w.to(dev) for w in kept])
                               for s, x, rng, kept in q) for m, q in state["stash"]}
        self.deltas = {(m, s): d.to(dev) for m, s, d in state["deltas"]}


def attach(engine: Any) -> OuroborosState:
    engine.ouroboros = OuroborosState(engine)
    return engine.ouroboros


def _exec_module_forward(self: Any, module: int, sample: int) -> None:
    self.ouroboros.forward(module, sample)


def _exec_module_backward(self: Any, module: int, sample: int) -> None:
    self.ouroboros.backward(module, sample)


def _exec_send_hidden(self: Any, module: int, sample: int, peer: int) -> None:
    st = self.ouroboros
    st.send(st.acts.pop((module + 1, sample)), peer, header=True)


def _exec_recv_hidden(self: Any, module: int, sample: int, peer: int) -> None:
    st = self.ouroboros
    st.acts[(module + 1, sample)] = st.recv(peer)


def _exec_send_delta(self: Any, module: int, sample: int, peer: int) -> None:
    st = self.ouroboros
    st.send(st.deltas.pop((module - 1, sample)), peer)


def _exec_recv_delta(self: Any, module: int, sample: int, peer: int) -> None:
    st, m = self.ouroboros, module - 1  # delta_m^s has the shape of G_m's output for sample s: (B, T, C)
    x = next(entry[1] for entry in st.stash[m] if entry[0] == sample)
    st.deltas[(m, sample)] = st.recv(peer, (*x.shape[:2], self.module.ds_mp_ctx.n_embd))


def _exec_update_modules(self: Any) -> None:
    self.ouroboros.update()


for _instr, _fn in ((ModuleForward, _exec_module_forward), (ModuleBackward, _exec_module_backward),
                    (SendHidden, _exec_send_hidden), (RecvHidden, _exec_recv_hidden), (SendDelta, _exec_send_delta),
                    (RecvDelta, _exec_recv_delta), (UpdateModules, _exec_update_modules)):
    DsMpPipelineEngine.register_instruction(_instr, _fn)

__all__ = ["OuroborosState", "attach"]
