"""TeraPipe (Li et al., ICML 2021): pipelining one sequence along its tokens.

A causal Transformer's position t depends only on positions ≤ t, so each micro-batch's
sequence of L tokens is cut into slices l_1 … l_M (and its rows into batch-slices) and stage
k forwards slice i while stage k+1 forwards slice i−1.  A *unit* is one (micro-batch,
batch-slice, token slice); units run in the order micro → batch-slice → token slice.

Attention of slice i (tokens [c, c+l), c = l_1 + … + l_{i−1}) in one block, per TP rank
(its own heads), against the keys/values of the earlier slices of the same sequence:

    K̃_i = [K̂_1; …; K̂_{i−1}; K_i]   Ṽ_i likewise            (B, nh_l, c+l, hs)
    Y_i = softmax(Q_i K̃_iᵀ/√hs + M_i) Ṽ_i,   M_i[q, k] = 0 if k ≤ c + q else −∞

K̂_j is K_j *detached* into a leaf that requires grad, so slice i's graph ends at K̂_j and
each graph is backpropagated exactly once.  Backward runs slices in reverse, so when slice
j's backward runs, K̂_j.grad = Σ_{i>j} ∂L/∂K̂_j is complete; _AddCachedGrad (the identity on
K_j in slice j's own graph) adds it, giving dK_j = ∂L/∂K_j|own + K̂_j.grad — the gradient of
unsliced training.  Memory: the cached K/V of a sequence plus the usual stashed activations.

Loss: slice i's targets are ``shift_labels(labels)[:, c:c+l]`` (the last token of slice i
predicts the first of slice i+1) and its loss is Σ token losses / (valid targets of the whole
micro-batch), so the slices' losses sum to the micro-batch's HF loss.

Timetable (K stages, U units, P = U + K − 1 steps per phase; the paper's figure)::

    forward phase:  stage s forwards unit t − s at step t
    backward phase: stage s backwards unit U − 1 − (t − (K − 1 − s)) at step t

    K=2, U=3    step  0    1    2    3  |  0    1    2    3
    stage 0           F0   F1   F2      |       B2   B1   B0
    stage 1                F0   F1   F2 |  B2   B1   B0

A result is sent one step after it is computed, and received at that same step by the
neighbour (sends before receives inside a step), as in ``GPipe``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch
from deepspeed.runtime.pipe import schedule as ds

from ds_mp.config import ConfigError
from ds_mp.pipeline.engine import DsMpPipelineEngine
from ds_mp.pipeline.instructions import BackwardSlice, ForwardSlice, LoadSlice
from ds_mp.pipeline.schedules import register_schedule
from ds_mp.pipeline.simulate import Op

Plan = list[tuple[int, list[int]]]  # [(batch-slice rows, token slice lengths)], as plan_joint


# ------------------------------------------------------------------ per-stage key/value context

@dataclass
class _Cached:
    k: torch.Tensor  # (B, nh_l, l, hs) detached leaf: later slices attend to it, .grad collects
    v: torch.Tensor


class _AddCachedGrad(torch.autograd.Function):
    """y = x;  dx = dy + (cached copy of x).grad — the gradient later slices left on x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, entry: _Cached, name: str) -> torch.Tensor:
        ctx.entry, ctx.name = entry, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        extra = getattr(ctx.entry, ctx.name).grad
        return (grad if extra is None else grad + extra), None, None


def context_mask(length: int, context: int, device: Any) -> torch.Tensor | None:
    """Boolean SDPA mask (l, c+l): query q sees key k iff k ≤ c + q (None when c = 0: causal)."""
    if context == 0:
        return None
    return torch.ones(length, context + length, dtype=torch.bool, device=device).tril(diagonal=context)


class KVContext:
    """Keys/values of earlier token slices, per sequence ``key`` and block index.

    ``Block.attention`` calls ``extend(index, k, v)`` with the current slice's (B, nh_l, l, hs)
    keys/values and gets ``(K̃, Ṽ, mask)``; the slice is then cached for the next slices.
    """

    def __init__(self) -> None:
        self.key: Hashable = None
        self._cache: dict[Hashable, dict[int, list[_Cached]]] = {}

    def extend(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        cached = self._cache.setdefault(self.key, {}).setdefault(index, [])
        entry = _Cached(k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
        k_own, v_own = _AddCachedGrad.apply(k, entry, "k"), _AddCachedGrad.apply(v, entry, "v")
        c = sum(e.k.shape[2] for e in cached)
        if cached:
            k_own = torch.cat([e.k for e in cached] + [k_own], dim=2)  # (B, nh_l, c+l, hs)
            v_own = torch.cat([e.v for e in cached] + [v_own], dim=2)
        cached.append(entry)
        return k_own, v_own, context_mask(k.shape[2], c, k.device)

    def prefill(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Cache ``k``, ``v`` (B, nh_l, c, hs) as if earlier slices had produced them (profiling)."""
        self._cache.setdefault(self.key, {}).setdefault(index, []).append(_Cached(k, v))

    def leaves(self) -> list[torch.Tensor]:
        """Every cached tensor of the current sequence."""
        return [t for es in self._cache.get(self.key, {}).values() for e in es for t in (e.k, e.v)]

    def release(self, key: Hashable) -> None:
        self._cache.pop(key, None)

    def __len__(self) -> int:
        return len(self._cache)


# ------------------------------------------------------------------ the schedule

@dataclass(frozen=True)
class Unit:
    micro: int
    batch_slice: int
    slice: int
    rows: tuple[int, int]    # [r0, r1) of the micro-batch
    tokens: tuple[int, int]  # [a, b) of the sequence


def plan_units(plan: Plan, micro_batches: int) -> list[Unit]:
    """Units in forward order: micro-batch, then batch-slice, then token slice."""
    out = []
    for m in range(micro_batches):
        r0 = 0
        for bs, (rows, slices) in enumerate(plan):
            a = 0
            for i, n in enumerate(slices):
                out.append(Unit(m, bs, i, (r0, r0 + rows), (a, a + n)))
                a += n
            r0 += rows
    return out


class TeraPipeSchedule(ds.PipeSchedule):
    """Token-sliced GPipe over units (see the module docstring for the timetable)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, plan: Plan) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.plan = plan
        self.units = plan_units(plan, micro_batches)

    @classmethod
    def from_engine(cls, engine: Any) -> "TeraPipeSchedule":
        st = _state(engine)
        st.micro = -1  # a new batch: LoadSlice fetches micro-batch 0 afresh
        return cls(engine.micro_batches, engine.num_stages, engine.stage_id, st.plan)

    def num_pipe_buffers(self) -> int:
        return len(self.units)

    @property
    def phase(self) -> int:
        return len(self.units) + self.stages - 1

    def forward_unit(self, t: int) -> int:
        return t - self.stage_id

    def backward_unit(self, t: int) -> int:
        return len(self.units) - 1 - (t - (self.stages - 1 - self.stage_id))

    def _valid(self, u: int) -> bool:
        return 0 <= u < len(self.units)

    def _forward_step(self, t: int) -> list:
        cmds: list = []
        sent = self.forward_unit(t - 1)
        if not self.is_last_stage and self._valid(sent):
            cmds.append(ds.SendActivation(buffer_id=sent))
        u = self.forward_unit(t)
        if self._valid(u):
            x = self.units[u]
            if self.is_first_stage or self.is_last_stage:
                cmds.append(LoadSlice(buffer_id=u, micro=x.micro, rows=x.rows, tokens=x.tokens))
            if not self.is_first_stage:
                cmds.append(ds.RecvActivation(buffer_id=u))
            cmds.append(ForwardSlice(buffer_id=u, micro=x.micro, batch_slice=x.batch_slice, slice=x.slice))
        return cmds

    def _backward_step(self, t: int) -> list:
        cmds: list = []
        sent = self.backward_unit(t - 1)
        if not self.is_first_stage and self._valid(sent):
            cmds.append(ds.SendGrad(buffer_id=sent))
        u = self.backward_unit(t)
        if self._valid(u):
            x = self.units[u]
            if not self.is_last_stage:
                cmds.append(ds.RecvGrad(buffer_id=u))
            cmds.append(BackwardSlice(buffer_id=u, micro=x.micro, batch_slice=x.batch_slice, slice=x.slice))
        return cmds

    def steps(self) -> Iterator[list]:
        for t in range(self.phase):
            yield self._forward_step(t)
        for t in range(self.phase):
            cmds = self._backward_step(t)
            if t == self.phase - 1:
                cmds += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield cmds

    def ops(self) -> list[Op]:
        """This stage's forwards/backwards in order, as simulator ops ``Op(kind, micro, slice)``
        with ``slice`` numbering the (batch-slice, token slice) pairs of a micro-batch."""
        per_micro = sum(len(s) for _, s in self.plan)
        return [Op("F" if isinstance(c, ForwardSlice) else "B", c.micro, c.buffer_id % per_micro)
                for step in self.steps() for c in step if isinstance(c, (ForwardSlice, BackwardSlice))]


register_schedule("terapipe", TeraPipeSchedule)


# ------------------------------------------------------------------ engine side

@dataclass
class TeraPipeState:
    """What a TeraPipe engine keeps between instructions (and train_batch calls)."""

    plan: Plan
    context: KVContext = field(default_factory=KVContext)
    micro: int = -1  # micro-batch currently loaded (batch kept for its remaining slices)
    ids: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    count: torch.Tensor | None = None


def _state(engine: Any) -> TeraPipeState:
    """The engine's TeraPipe state; the plan is made once, on the first train_batch."""
    st = getattr(engine, "_terapipe", None)
    if st is not None:
        return st
    cfg = engine.ds_mp_config
    if cfg is None:
        raise ConfigError("ds_mp.pipeline.schedule: terapipe needs the ds_mp config; build the engine "
                          "with ds_mp.initialize")
    if cfg.pipeline.activation_checkpoint_interval:
        raise ConfigError("ds_mp.pipeline.activation_checkpoint_interval: terapipe caches keys/values in "
                          "forward and cannot recompute blocks; set it to 0")
    if cfg.tensor_parallel.sequence_parallel and cfg.tp > 1:
        raise ConfigError("ds_mp.tensor_parallel.sequence_parallel: not supported with terapipe "
                          "(slices need not divide by TP); set it to false")
    from ds_mp.pipeline.terapipe_plan import engine_plan

    engine._terapipe = st = TeraPipeState(engine_plan(engine))
    return st


def _exec_load_slice(self: Any, buffer_id: int, micro: int, rows: tuple[int, int],
                     tokens: tuple[int, int]) -> None:
    from ds_mp.models.gpt2 import shift_labels

    st = self._terapipe
    if st.micro != micro:  # first unit of a new micro-batch: fetch it, keep it for its slices
        ids, labels = self._next_batch()
        want = (sum(r for r, _ in st.plan), sum(st.plan[0][1]))
        if tuple(ids.shape) != want:
            raise RuntimeError(f"terapipe: micro-batch of shape {tuple(ids.shape)} but the slicing plan "
                               f"{st.plan} expects {want}; match data.seq_len and the micro-batch size")
        st.micro, st.ids = micro, ids.to(self.device)
        st.targets = shift_labels(labels.to(self.device))  # (B, L): targets[:, t] = labels[:, t+1]
        st.count = (st.targets != -100).sum().clamp(min=1)
    (r0, r1), (a, b) = rows, tokens
    if self.is_first_stage():
        pos = torch.arange(a, b, device=self.device).unsqueeze(0)  # absolute positions (1, l)
        self.pipe_buffers["inputs"][buffer_id] = (st.ids[r0:r1, a:b].clone(), pos)
    if self.is_last_stage():
        self.pipe_buffers["labels"][buffer_id] = (st.targets[r0:r1, a:b], st.count)
    self._loaded_micro[buffer_id] = self._n_loaded
    self._n_loaded += 1


def _forget_partition_shapes(self: Any) -> None:
    """With TP > 1 DeepSpeed sends activations/grads partitioned over TP and caches each
    partition's shape once; token slices change shape, so forget it before every slice."""
    self.pipe_partition_input_meta_cache = self.pipe_partition_output_meta_cache = None
    self.pipe_partition_grad_meta_cache = self.grad_partition_grad_layer_meta_cache = None


def _exec_forward_slice(self: Any, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
    _forget_partition_shapes(self)
    context, blocks = self._terapipe.context, self.module.blocks()
    context.key = (micro, batch_slice)
    for blk in blocks:
        blk.context = context
    try:
        self._exec_forward_pass(buffer_id)
    finally:
        for blk in blocks:
            blk.context = None


def _exec_backward_slice(self: Any, buffer_id: int, micro: int, batch_slice: int, slice: int) -> None:
    _forget_partition_shapes(self)
    self._exec_backward_pass(buffer_id)
    if slice == 0:  # the sequence's first slice: no later backward needs its cache
        self._terapipe.context.release((micro, batch_slice))


def plan_cli(argv: list[str]) -> int:
    """``ds-mp plan --config X.json [--profile]``: the slicing plan and its predicted speedups."""
    import argparse

    from ds_mp.pipeline.terapipe_plan import plan_from_config

    ap = argparse.ArgumentParser(prog="ds-mp plan", description="TeraPipe slicing plan for a DeepSpeed JSON")
    ap.add_argument("--config", required=True, help="DeepSpeed JSON with a ds_mp block")
    ap.add_argument("--profile", action="store_true", help="time a stage's blocks here and save the cost model")
    args = ap.parse_args(argv)
    try:
        plan_from_config(args.config, profile=args.profile)
    except ConfigError as e:
        print(f"ds-mp plan: {e}", file=sys.stderr)
        return 2
    return 0


DsMpPipelineEngine.register_instruction(LoadSlice, _exec_load_slice)
DsMpPipelineEngine.register_instruction(ForwardSlice, _exec_forward_slice)
DsMpPipelineEngine.register_instruction(BackwardSlice, _exec_backward_slice)

__all__ = ["KVContext", "context_mask", "TeraPipeSchedule", "Unit", "plan_units", "TeraPipeState", "Plan",
           "plan_cli"]
