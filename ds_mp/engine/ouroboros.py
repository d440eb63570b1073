"""Engine side of Ouroboros: the ring's state and the handlers of its instructions.

Ouroboros runs on ds_mp's pipeline engine like every schedule: the model is ds_mp's pipeline of
any family (TP blocks, vocab-parallel embedding, head and loss) built in the ring order of
``ring_pipeline_layout`` over the family's layer table (ring rank 0 holds G_0 and G_{K-1}, which
share a tied embedding; rank r holds G_r), and ``OuroborosSchedule`` yields ``rank_steps(K, t, rank)`` each ``train_batch``.  The
update is exactly ``OuroborosReference.step`` (the tests' oracle, ``tests/ouroboros_oracle.py``):

    forward with w^t, send h; replay G_m on the stashed input of sample t - d_m with the CURRENT
    weights w^t (``ouroboros.recompute = "current"``; ``"stashed"`` replays with the weights the
    forward used) under the forward's captured RNG state, so dropout masks repeat and no graph
    outlives an optimizer step (``"none"``: the forward ran against a snapshot of w^s with its graph
    kept, and the delayed backward uses that graph: "stashed" without the replay); send delta; ``UpdateModules``: p.grad = the sum of the module
    gradients of p (the tied V: 1/2 (dV_o + dV_i), or the sum when delay=False), None for a
    parameter whose modules are all still in warm-up (the optimizer skips it), then the
    engine's own DP reduce and optimizer step — DeepSpeed's optimizer and LR scheduler, ds_mp's
    global-norm clipping and NaN skip.

One ``train_batch`` is one iteration (one update).  Ring rank 0 reads
``gradient_accumulation_steps`` = M micro-batches; together they are x_t (the loss is the mean
over the target tokens of the global batch, ``ds_mp.engine.batches``), and the locked forward is
pipelined over them (``rank_steps``): G_m forwards micro-batch j and sends it on while G_{m+1}
works on j-1, G_{K-1} adds micro-batch j's share (its token-loss sum over the global target
count) of f_t and of its gradient, a replay runs each stashed
micro-batch under its own forward's RNG state and sums their gradients: the update is the
whole batch's.  Sends are posted asynchronously (``isend``) and completed before the update, so
a rank computes while its message travels and never waits for its receiver.  The stash, the
deltas in flight and t are the engine's schedule state, saved per rank with each checkpoint.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ds_mp import deepspeed_compat as compat
from ds_mp.engine.p2p import PostedSends
from ds_mp.engine.ouroboros_modules import (ModuleLayers, SampleLayouts, accumulate, grad_holders, leaf, module_grad_sum,
                                           module_ranges, replayed)
from ds_mp.schedules.ouroboros.timetable import (ModuleBackward, ModuleForward, RecvDelta, RecvHidden, SendDelta,
                                                 SendHidden, UpdateModules, module_owner)
from ds_mp.tensor_parallel.layers import sparse_lookups
from ds_mp.tensor_parallel.random import rng_state
from ds_mp.engine_view import RuntimeEngine


class OuroborosState:
    """One ring rank's Ouroboros state (see the module docstring) and its engine hooks."""

    def __init__(self, engine: RuntimeEngine) -> None:
        cfg = engine.ds_mp_config
        self.engine, self.K, self.delay = engine, engine.num_stages + 1, cfg.ouroboros.delay
        self.tie_scale = 0.5 if self.delay else 1.0  # g_V = tie_scale (dV_o + dV_i)
        # "stashed" and "none" keep w^s; "none" also keeps the forward's graph instead of replaying it
        self.stash_weights = cfg.ouroboros.recompute in ("stashed", "none")
        self.keep_graph = cfg.ouroboros.recompute == "none"
        self.repeat_dropout = cfg.ouroboros.repeat_dropout
        ctx = engine.module.ds_mp_ctx
        for lookup in sparse_lookups(engine.module):  # gradients come from torch.autograd.grad, never .grad
            lookup.sparse_grads = False
        # A replay must redraw each micro-batch's own masks only if dropout is on and repeated;
        # otherwise it runs the whole stashed batch as one graph (larger, faster matmuls).
        self.replay_per_micro = self.repeat_dropout and max(ctx.dropout, ctx.embd_dropout, ctx.attn_dropout) > 0
        self.iteration = 0
        self.owner = module_owner(self.K)
        funcs = compat.local_layers(engine.module)
        self.ranges = module_ranges(engine.module, cfg, engine.stage_id)
        self.layers = {m: ModuleLayers(funcs[a:b]) for m, (a, b) in self.ranges.items()}
        # G_m's parameters (each once; the tied wte under its first name) and their names in layers[m]
        self.names = {m: [n for n, _ in mod.named_parameters()] for m, mod in self.layers.items()}
        self.params = {m: list(mod.parameters()) for m, mod in self.layers.items()}
        self.holders = grad_holders(self.params)
        # G_m's stash per sample: (sample, [(micro-batch input, RNG state of its forward, its graph
        # (input leaf, output) when recompute="none")], its weights w^s when recompute="stashed"/"none")
        self.stash: dict[int, deque[tuple[int, list[tuple[Tensor, dict | None, tuple | None]], list[Tensor] | None]]] = {
            m: deque() for m in self.ranges}
        self.acts: dict[tuple[int, int, int], Tensor] = {}    # (m, s, j) -> input of G_m, micro-batch j of x_s
        self.layouts = SampleLayouts(ctx, keep=self.K)  # documents / padding of the samples in flight
        self.deltas: dict[tuple[int, int, int], Tensor] = {}  # (m, s, j) -> delta_m^s of micro-batch j
        self.grads: dict[int, list[Tensor]] = {}
        self.loss: Tensor | None = None
        self.labels: list[tuple] = []  # ring rank 0: the label tuples of x_t's micro-batches read so far
        self.sends = PostedSends()  # posted sends, each buffer kept alive until done (engine/p2p.py)

    def next_iteration(self) -> int:
        t, self.iteration = self.iteration, self.iteration + 1
        return t

    # --- module maths -------------------------------------------------------------------
    def run(self, m: int, x: Any, weights: dict[str, Tensor] | None = None, layout: Any = None) -> Tensor:
        """G_m(x): token ids -> hidden for G_0, hidden -> hidden, hidden -> local logits for G_{K-1};
        with ``weights`` (parameter name in ``self.layers[m]`` -> tensor) in place of the module's
        own parameters (autograd then differentiates with respect to those tensors), attending with
        ``layout`` (``ds_mp.models.batch.Layout``: documents, padding; None = causal)."""
        ctx = self.engine.module.ds_mp_ctx
        saved, ctx.layout = ctx.layout, layout
        try:
            if weights is None:
                return self.layers[m](x)
            return torch.func.functional_call(self.layers[m], weights, (x,))
        finally:
            ctx.layout = saved

    def forward(self, m: int, s: int, micro: int | None = None) -> None:
        j = micro or 0
        x = self.acts.pop((m, s, j)) if m > 0 else self._load_micro_batch(j)
        self.layouts.record(s, self.engine.step_info.layouts)  # forwards run the current step's sample
        layout = self.layouts.of(s, j, [])
        delayed = m < self.K - 1  # G_{K-1} runs forward and backward as one graph in backward()
        if j == 0:
            kept = ([p.detach().clone().requires_grad_() for p in self.params[m]]
                    if self.stash_weights and delayed else None)
            self.stash[m].append((s, [], kept))
        entry = self.stash[m][-1]
        assert entry[0] == s and len(entry[1]) == j, f"G_{m} forwards micro-batch {j} of sample {s} out of order"
        if not delayed:
            entry[1].append((x, None, None))
            return
        rng = rng_state()  # a replay reuses its forward's masks
        if self.keep_graph:  # the graph of G_m(x; w^s) against the snapshot w^s = kept, used at t = s + d_m
            x_leaf = leaf(x)
            with torch.enable_grad():
                out = self.run(m, x_leaf, dict(zip(self.names[m], entry[2])), layout)
            entry[1].append((x, rng, (x_leaf, out)))
            self.acts[(m + 1, s, j)] = out.detach()
        else:
            entry[1].append((x, rng, None))
            with torch.no_grad():
                self.acts[(m + 1, s, j)] = self.run(m, x, layout=layout)

    def backward(self, m: int, s: int, micro: int | None = None) -> None:
        if m == self.K - 1:
            self._head_backward(s, micro or 0)
            return
        stashed, chunks, kept = self.stash[m].popleft()
        assert stashed == s, f"G_{m} replays sample {s} but its oldest stash is sample {stashed}"
        total = None
        deltas = [self.deltas.pop((m, s, j)) for j in range(len(chunks))]
        sizes = [d.shape[0] for d in deltas]
        kept_graphs = all(graph is not None for _, _, graph in chunks)  # False after a resume: replay
        layouts = [self.layouts.of(s, j, []) for j in range(len(chunks))]
        if len(chunks) > 1 and not self.replay_per_micro and not kept_graphs:  # one replay of the whole batch
            chunks, deltas = [(torch.cat([x for x, _, _ in chunks]), chunks[0][1], None)], [torch.cat(deltas)]
            layouts = [self.layouts.of(s, None, sizes)]
        wrt = kept if kept is not None else self.params[m]  # the snapshot's leaves, or the parameters
        replay_with = None if kept is None or kept_graphs else dict(zip(self.names[m], kept))
        with torch.enable_grad():
            for j, ((x_saved, rng, graph), delta) in enumerate(zip(chunks, deltas)):
                if graph is None:
                    x = leaf(x_saved)
                    with replayed(rng if self.repeat_dropout else None):
                        out = self.run(m, x, replay_with, layouts[j])
                else:
                    x, out = graph
                grads = torch.autograd.grad(out, ([x] if x.requires_grad else []) + wrt,
                                            grad_outputs=delta, materialize_grads=True)
                if x.requires_grad:  # delta_{m-1}^s travels per micro-batch
                    parts = grads[0].split(sizes) if len(chunks) < len(sizes) else [grads[0]]
                    for i, part in enumerate(parts):
                        self.deltas[(m - 1, s, j + i)] = part
                    grads = grads[1:]
                total = accumulate(total, grads)
        self.grads[m] = total

    def _head_backward(self, s: int, j: int) -> None:
        """G_{K-1} on micro-batch j of x_s: its share of f_s = (1/N) Σ CE over the N targets of the
        global batch (the sum over j's targets), the gradients of that share, delta_{K-2} of j."""
        m, (stashed, chunks, _) = self.K - 1, self.stash[self.K - 1][0]
        assert stashed == s, f"G_{m} backprops sample {s} but holds sample {stashed}"
        x_saved = chunks[j][0]
        if j == self.engine.micro_batches - 1:
            self.stash[m].popleft()
        with torch.enable_grad():  # on the ambient streams, as its forward is this very call
            x = leaf(x_saved)
            wrt = ([x] if x.requires_grad else []) + self.params[m]
            # labels: the loss spec's (targets, D = N / (M · grad_size), …) (ds_mp.losses.spec): / M makes the M
            # shares sum to this replica's part of the global loss (the grad group averages the replicas)
            out = self.engine.module.loss_fn(self.run(m, x, layout=self.layouts.of(s, j, [])), self.labels[j])
            out = out / self.engine.micro_batches
            grads = torch.autograd.grad(out, wrt, materialize_grads=True)
        if x.requires_grad:
            self.deltas[(m - 1, s, j)], grads = grads[0], grads[1:]
        self.grads[m] = accumulate(self.grads.get(m) if j > 0 else None, grads)
        self.loss = out.detach() if j == 0 else self.loss + out.detach()

    def update(self) -> None:
        """Complete this iteration's sends; p.grad = Σ_m (module m's gradient of p), the tied V
        scaled by tie_scale, None while all of p's modules are in warm-up; then the shared DP
        reduce and optimizer step.

        A parameter in warm-up is left out of the update entirely, as a torch optimizer leaves
        out a parameter whose ``.grad`` is None: no weight decay, no step count.  Under bf16,
        DeepSpeed's BF16_Optimizer steps flat fp32 partitions, one per parameter group, and the
        groups are split per module (:func:`param_group_keys`): the groups of modules in warm-up
        are skipped whole.  Its DP reduce acts on the fp32 master gradients, so the bf16
        gradients are copied into them first."""
        self.flush()
        waiting = []
        for p in self.engine.module.parameters():
            p.grad = module_grad_sum(p, self.holders, self.grads, self.tie_scale)
            if p.grad is None:
                waiting.append(p)
        self.grads.clear()
        bf16 = compat.uses_bf16_optimizer(self.engine)
        if bf16:  # the master gradients need every parameter's: zeros for waiting ones (their groups skip)
            for p in waiting:
                p.grad = torch.zeros_like(p)
            compat.copy_bf16_grads_to_master(self.engine)
        if self.engine.topology.grad_size > 1:  # DeepSpeed's reduction buckets and copies even over one replica
            self.engine.reduce_gradients()
        if not bf16:
            for p in waiting:  # DeepSpeed's DP reduce gives gradient-less parameters zeros: skip them again
                p.grad = None
            self.engine.optimizer_step()
            return
        idle = {id(p) for p in waiting}
        groups = compat.flat_group_params(self.engine.optimizer)
        skip = [i for i, g in enumerate(groups) if g and all(id(p) in idle for p in g)]
        with compat.skipping_flat_groups(self.engine.optimizer, skip):
            self.engine.optimizer_step()

    def _load_micro_batch(self, j: int) -> Tensor:
        """Ring rank 0: micro-batch j of x_t (its labels kept for G_{K-1})."""
        e = self.engine
        inputs, labels = compat.next_batch(e)  # engine/batches.py's form; positions: from the layout
        ids = inputs[0] if isinstance(inputs, tuple) else inputs
        labels = tuple(x.to(e.device) for x in labels)  # the loss spec's label tuple
        self.labels = [labels] if j == 0 else [*self.labels, labels]
        return ids.to(e.device)

    # --- ring p2p ------------------------------------------------------------------------
    def _peer(self, ring_rank: int) -> int:
        topo = self.engine.topology
        return topo.peer(pp=ring_rank)

    def send(self, x: Tensor, ring_rank: int, header: bool = False) -> None:
        """Post the send of ``x`` (and first its (B, T, C) if ``header``) without waiting for the
        receiver; :meth:`flush` completes every posted send."""
        dev = self.engine.device
        bufs = [torch.tensor(x.shape, dtype=torch.long, device=dev)] if header else []
        # deltas have the shape of a stashed micro-batch's output
        self.sends.post([*bufs, x.contiguous()], ring_rank, self._peer(ring_rank))

    def flush(self) -> None:
        """Wait for every posted send (their buffers may then be freed)."""
        self.sends.wait_all()

    def recv(self, ring_rank: int, shape: tuple[int, ...] | None = None) -> Tensor:
        dev = self.engine.device
        if shape is None:
            header = torch.empty(3, dtype=torch.long, device=dev)
            dist.recv(header, self._peer(ring_rank))
            shape = tuple(header.tolist())
        buf = torch.empty(shape, dtype=next(self.engine.module.parameters()).dtype, device=dev)
        dist.recv(buf, self._peer(ring_rank))
        return buf

    # --- instruction handlers (``instructions``: the engine dispatches to these methods) ----
    def module_forward(self, module: int, sample: int, micro: int | None = None) -> None:
        self.forward(module, sample, micro)

    def module_backward(self, module: int, sample: int, micro: int | None = None) -> None:
        self.backward(module, sample, micro)

    def send_hidden(self, module: int, sample: int, peer: int, micro: int | None = None) -> None:
        self.send(self.acts.pop((module + 1, sample, micro or 0)), peer, header=True)

    def recv_hidden(self, module: int, sample: int, peer: int, micro: int | None = None) -> None:
        self.acts[(module + 1, sample, micro or 0)] = self.recv(peer)

    def send_delta(self, module: int, sample: int, peer: int, micro: int | None = None) -> None:
        self.send(self.deltas.pop((module - 1, sample, micro or 0)), peer)

    def recv_delta(self, module: int, sample: int, peer: int, micro: int | None = None) -> None:
        m, j = module - 1, micro or 0  # delta_m^s of micro-batch j: (B_j, T, C) like G_m's output
        x = next(chunks[j][0] for s, chunks, _ in self.stash[m] if s == sample)
        self.deltas[(m, sample, j)] = self.recv(peer, (*x.shape[:2], self.engine.module.ds_mp_ctx.n_embd))

    def update_modules(self) -> None:
        self.update()

    instructions = {ModuleForward: "module_forward", ModuleBackward: "module_backward", SendHidden: "send_hidden",
                    RecvHidden: "recv_hidden", SendDelta: "send_delta", RecvDelta: "recv_delta",
                    UpdateModules: "update_modules"}

    # --- engine hooks --------------------------------------------------------------------
    @staticmethod
    def data_stages() -> set[int]:
        """Ring rank 0 holds G_0 and G_{K-1}: it alone reads micro-batches."""
        return {0}

    def aggregate_loss(self) -> Tensor:
        """Ring rank 0's f_t, averaged over DP replicas, on every rank of the ring."""
        e, topo = self.engine, self.engine.topology
        first = e.stage_id == 0
        out = self.loss.detach().float().clone() if first else torch.zeros((), device=e.device)
        if first and topo.grad_size > 1:  # the copies the gradients are averaged over (engine/batches.py's share)
            dist.all_reduce(out, group=topo.grad_group)
            out /= topo.grad_size
        if e.num_stages > 1:
            dist.broadcast(out, src=topo.peer(pp=0), group=topo.pp_group)
        return out

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator, *args: Any, num_micro_batches: int | None = None,
                   **kwargs: Any) -> Tensor:
        """Mean loss of ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches
        through the ring with the current weights; the in-flight training state is untouched."""
        e, K, r = self.engine, self.K, self.engine.stage_id
        total = torch.zeros((), device=e.device)
        n = num_micro_batches or e.micro_batches
        fed = e._prepare(data_iter, n, training=False)  # the loss spec's labels, D = N / (n · grad_size) (ds_mp.losses.spec)
        e.module.eval()
        try:
            for j in range(n):
                layout = e.step_info.layouts[j]
                if r == 0:
                    inputs, labels = next(fed)
                    ids = (inputs[0] if isinstance(inputs, tuple) else inputs).to(e.device)
                    labels = tuple(x.to(e.device) for x in labels)
                    h = self.run(0, ids, layout=layout)
                    if self.owner[1] != 0:
                        self.send(h, self.owner[1], header=True)
                        h = self.recv(self.owner[K - 2])
                    total += e.module.loss_fn(self.run(K - 1, h, layout=layout), labels).float()
                else:
                    self.send(self.run(r, self.recv(r - 1), layout=layout), self.owner[r + 1], header=True)
                self.flush()
        finally:
            e.module.train()
        self.loss, saved = total / n, self.loss
        try:
            return self.aggregate_loss()
        finally:
            self.loss = saved

    def tp_free(self) -> bool:
        """The in-flight state is whole on every TP rank: stashed inputs and deltas are full
        activations; no weight snapshot (recompute "current") and no dropout, whose replayed masks
        depend on the TP rank's RNG streams."""
        ctx = self.engine.module.ds_mp_ctx
        return not self.stash_weights and max(ctx.dropout, ctx.embd_dropout, ctx.attn_dropout) == 0

    def state_dict(self) -> dict:
        """The work in flight: t, the stashed inputs (with their forward's RNG state), the deltas."""
        return {"K": self.K, "delay": self.delay, "iteration": self.iteration,
                "stash": [[m, [(s, [(x.cpu(), rng) for x, rng, _ in chunks], None if kept is None else [w.cpu() for w in kept])
                               for s, chunks, kept in q]] for m, q in self.stash.items()],
                "deltas": [[m, s, j, d.cpu()] for (m, s, j), d in self.deltas.items()],
                "layouts": self.layouts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state["K"], state["delay"]) != (self.K, self.delay):
            raise ValueError(f"Ouroboros state holds K={state['K']}, delay={state['delay']}; this engine has "
                             f"K={self.K}, delay={self.delay}: load it with the same ds_mp.ouroboros settings")
        if any(kept is not None for _, q in state["stash"] for _, _, kept in q) and not self.stash_weights:
            raise ValueError("Ouroboros state holds weight snapshots (recompute 'stashed' or 'none'); this engine "
                             "replays with the current weights: resume with the same ds_mp.ouroboros.recompute")
        dev = self.engine.device
        self.iteration = state["iteration"]
        self.stash = {m: deque((s, [(x.to(dev), rng, None) for x, rng in chunks],  # graphs are not saved: replay
                                None if kept is None else [w.to(dev).requires_grad_() for w in kept])
                               for s, chunks, kept in q) for m, q in state["stash"]}
        self.deltas = {(m, s, j): d.to(dev) for m, s, j, d in state["deltas"]}
        self.layouts.load_state_dict(state.get("layouts", []), dev)


def attach(engine: RuntimeEngine) -> OuroborosState:
    """The runtime of an Ouroboros engine (made by its spec, ``config.registry.ScheduleSpec.runtime``)."""
    return OuroborosState(engine)


__all__ = ["OuroborosState", "attach"]
