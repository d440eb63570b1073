"""TeraPipe ``"slices": "auto"``: profile a stage, fit the cost model, run the planner.

The cost model t(i, j) (``planner.TableCostModel``, the paper's form: a measured t(i, 0) table
plus a fitted linear context term; one stage's forward+backward of i tokens after j cached
tokens, at the micro-batch size B) comes from ``terapipe.profile`` or
``<training.output_dir>/terapipe_profile.json``; when neither exists the engine profiles its
own stage (every rank, its real layers and TP), takes for every (i, j) the slowest rank (the
pipeline runs at its bottleneck stage), fits, measures the point-to-point time of a slice's activation on every pipeline link
(:func:`profile_transfer`, on the engine's own backend: gloo here, NCCL on GPUs) and adds it
to the table, and rank 0 saves the file with what was profiled (model shape, micro-batch,
layout, device, dtype) and how long profiling took.  A saved profile whose ``meta`` does not
match the engine is measured again (an explicit ``terapipe.profile`` file is used as given,
with a warning).  Every batch-slice size the planner may use is profiled at that size
(``planner.profile_sizes``: B/n and B for ``batch_slices = n``; the powers of two below B and
B for ``"auto"``), a ``BatchTableCostModel``: a one-row slice does not cost 1/B of a B-row one.
With ``batch_slices = n`` the micro-batch is cut into n equal batch-slices and the joint planner
chooses their token slicing: ``plan_joint(B, L, K, cost, batch_sizes=[B/n])``; with ``"auto"``
it also chooses the split (a knapsack over the profiled sizes).  The plan is for a whole step: the M =
``gradient_accumulation_steps`` micro-batches run in one flush.  Rank 0 plans and broadcasts.

:func:`profile_blocks` times a stage's blocks (the model family's) on one process for ``ds-mp plan --profile``.
"""
from __future__ import annotations

import math
import os
import re
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_mp.config import ConfigError, DsMpConfig
from ds_mp.models.pipeline import LAYER_COST_VERSION, attending_to
from ds_mp.engine.terapipe_kv import KVContext
from ds_mp.tensor_parallel.layers import sparse_lookups
from ds_mp.schedules.terapipe.cost_model import (BatchTableCostModel, cost_model_meta, fit_table_cost_model,
                                                 load_cost_model, profile_stage)
from ds_mp.schedules.terapipe.planner import explicit_plan, plan_for, profile_sizes
from ds_mp.schedules.terapipe.schedule import Plan
from ds_mp.engine_view import RuntimeEngine

PROFILE_NAME = "terapipe_profile.json"


def profile_path(cfg: DsMpConfig) -> str:
    return cfg.terapipe.profile or os.path.join(cfg.training.output_dir, PROFILE_NAME)


def profile_grid(L: int, granularity: int) -> tuple[list[int], list[int], list[int]]:
    """What to time: ``(table lengths, context lengths, contexts)``.

    The t(i, 0) table: every multiple of g up to 8g (where costs are least linear), then
    lengths growing by ~1.5× to L (≤ ~20 points).  The context term: lengths g, 2g, 4g, … L
    after contexts L/4, L/2, 3L/4 (rounded to g).
    """
    g = max(1, min(granularity, L))
    table = {min(L, g * k) for k in range(1, 9)}
    n = 8 * g
    while n < L:
        n = g * max(n // g + 1, round(1.5 * n / g))
        table.add(min(L, n))
    powers = sorted({min(L, g * 2 ** k) for k in range(int(math.log2(max(1, L // g))) + 1)} | {L})
    contexts = sorted({g * round(L * q / 4 / g) for q in range(1, 4)} - {0})
    return sorted(table), powers, contexts


def engine_plan(engine: RuntimeEngine) -> Plan:
    """The engine's plan: the configured slices, or (collective) the planner's."""
    tcfg = engine.ds_mp_config.terapipe
    if isinstance(tcfg.slices, list):
        return explicit_plan(tcfg.slices, engine.train_micro_batch_size_per_gpu(), tcfg.batch_slices)
    return auto_plan(engine)


def _slice_timer(forward: Callable[[Any], torch.Tensor], blocks: list, make_input: Callable[[int, int], Any],
                 batch: int, hs: int, dtype: torch.dtype, device: Any) -> Callable[[int, int], None]:
    """fn(i, j): forward+backward of i tokens through ``blocks`` after a random j-token context.

    Gradients are returned by ``torch.autograd.grad``, never accumulated into ``.grad``.
    """
    def run(i: int, j: int) -> None:
        context = KVContext()
        for blk in blocks:
            shape = (batch, blk.n_head_local, j, hs)
            context.prefill(blk.index, *(torch.randn(shape, dtype=dtype, device=device).requires_grad_()
                                         for _ in range(2)))
        with attending_to(blocks, context):
            x = make_input(i, j)
            out = forward(x)
        params = forward.parameters() if isinstance(forward, torch.nn.Module) else []
        wrt = [p for p in params if p.requires_grad] + context.leaves()
        if torch.is_tensor(x) and x.requires_grad:
            wrt.append(x)
        torch.autograd.grad([out], wrt, [torch.ones_like(out)], allow_unused=True)
    return run


def profile_engine_stage(engine: RuntimeEngine, L: int, granularity: int, rows: int | None = None) -> list[tuple[int, int, float]]:
    """Time this rank's stage (its layers, its TP shard) on batch-slices of ``rows`` rows (default:
    the micro-batch size); collective over the stage's TP group only (TP ranks run the same grid
    in lockstep)."""
    module, B = engine.module, rows or engine.train_micro_batch_size_per_gpu()
    ctx, blocks = module.ds_mp_ctx, module.blocks()
    p = next(module.parameters())
    hs = ctx.family.head_dim(ctx.hf)  # the cache's per-head width (Llama's explicit head_dim may differ from C/heads)

    def make_input(i: int, j: int) -> Any:
        if engine.is_first_stage():
            ids = torch.randint(0, ctx.vocab, (B, i), device=p.device)
            pos = torch.arange(j, j + i, device=p.device).clamp(max=L - 1)  # same cost, valid index
            return ids, pos.unsqueeze(0)
        return torch.randn(B, i, ctx.n_embd, dtype=p.dtype, device=p.device, requires_grad=True)

    was_training = module.training
    module.eval()  # no dropout: profiling draws no random numbers from the training streams
    # Embedding lookups add a step's later slices into .grad sparsely once it exists
    # (ds_mp.tensor_parallel.layers.embedding_lookup): give them one so every slice is timed
    # as it runs in a step, not as the step's first (dense) backward.
    lookups = [w for m in sparse_lookups(module) if m.sparse_grads
               for w in m.parameters(recurse=False) if w.requires_grad and w.grad is None]
    for w in lookups:
        w.grad = torch.zeros_like(w)
    try:
        return _profile(_slice_timer(module, blocks, make_input, B, hs, p.dtype, p.device), L, granularity)
    finally:
        module.train(was_training)
        for w in lookups:
            w.grad = None


def _profile(fn: Callable[[int, int], None], L: int, granularity: int) -> list[tuple[int, int, float]]:
    """(i, j, seconds) over :func:`profile_grid`: the t(i, 0) table and the context samples.

    The table is timed in two passes, ascending then descending lengths, and each length keeps
    the faster pass (other processes only ever add time, and a burst of load is local in time):
    one spike in t(i, 0) would move every slice boundary near i."""
    table, powers, contexts = profile_grid(L, granularity)
    up = profile_stage(fn, table, [0], repeats=3, warmup=1)
    down = {i: t for i, _, t in profile_stage(fn, table[::-1], [0], repeats=3, warmup=0)}
    return ([(i, 0, min(t, down[i])) for i, _, t in up]
            + (profile_stage(fn, powers, contexts, repeats=3, warmup=0) if contexts else []))


def _bottleneck(per_rank: list[list[tuple[int, int, float]]]) -> list[tuple[int, int, float]]:
    """Per (i, j), the slowest rank's time."""
    worst: dict[tuple[int, int], float] = {}
    for samples in per_rank:
        for i, j, t in samples:
            worst[(i, j)] = max(worst.get((i, j), 0.0), t)
    return [(i, j, t) for (i, j), t in sorted(worst.items())]


def profile_transfer(engine: RuntimeEngine, lengths: list[int], repeats: int = 5, rows: int | None = None) -> list[float]:
    """Collective over the pipeline: per slice length i, the seconds this rank spends on one
    slice's point-to-point traffic (``rows`` rows, default the micro-batch size), summed over the
    links it is on.

    A slice on a link is what DeepSpeed's dynamic-shape pipeline sends: forward, the shape
    message, the (B, i, n_embd) activation and the (1, i) positions; backward, the activation's
    gradient — all blocking, so the time includes waking the peer.  Links are timed one after
    another (stage s with s+1, for s = 0 … K−2; every TP/DP pair of a link at once, as in
    training), ``repeats`` exchanges after one warm-up, the fastest.  Tensors live on the engine's
    device; the accelerator is synchronised before each clock read.
    """
    from deepspeed.accelerator import get_accelerator

    sync = get_accelerator().synchronize
    module, B = engine.module, rows or engine.train_micro_batch_size_per_gpu()
    p, h = next(module.parameters()), module.ds_mp_ctx.n_embd
    s, K = engine.stage_id, engine.num_stages
    out = [0.0] * len(lengths)
    for link in range(K - 1):
        if s not in (link, link + 1):
            continue
        peer = engine.grid.stage_to_global(stage_id=link + 1 if s == link else link)
        for n, i in enumerate(lengths):
            forward = [torch.zeros(16, dtype=torch.int32, device=p.device),
                       torch.empty(B, i, h, dtype=p.dtype, device=p.device),
                       torch.zeros(1, i, dtype=torch.long, device=p.device)]
            grad = torch.empty(B, i, h, dtype=p.dtype, device=p.device)
            took = []
            for r in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                for x in forward:
                    dist.send(x, peer) if s == link else dist.recv(x, peer)
                dist.recv(grad, peer) if s == link else dist.send(grad, peer)
                sync()
                if r:
                    took.append(time.perf_counter() - t0)
            out[n] += min(took)  # other processes only ever add time
    return out


def profile_meta(engine: RuntimeEngine) -> dict:
    """What a stage profile depends on: a saved one is reused only when this matches."""
    ctx, p = engine.module.ds_mp_ctx, next(engine.module.parameters())
    cfg = engine.ds_mp_config
    return {"stage_blocks": len(engine.module.blocks()), "n_embd": ctx.n_embd, "n_head": ctx.n_head, "vocab": ctx.vocab,
            "head_dim": ctx.family.head_dim(ctx.hf), "n_kv_head": getattr(ctx.hf, "num_key_value_heads", ctx.n_head),
            "seq_len": cfg.data.seq_len, "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "tp": cfg.tp, "pp": engine.num_stages, "sequence_parallel": bool(ctx.sp),
            "granularity": cfg.terapipe.granularity, "batch_slices": cfg.terapipe.batch_slices,
            "device": p.device.type, "dtype": str(p.dtype).split(".")[-1],
            "p2p_backend": dist.get_backend(), "version": LAYER_COST_VERSION}


def _cached(path: str, meta: dict, explicit: bool) -> bool:
    """Whether the profile at ``path`` can be reused for ``meta`` (rank 0)."""
    if not os.path.isfile(path):
        return False
    saved = {k: v for k, v in cost_model_meta(path).items() if k in meta}
    if saved == meta:
        return True
    if explicit:
        print(f"ds_mp.terapipe.profile: {path!r} was profiled for {saved or 'an unknown setup'}, "
              f"not {meta}; using it as given", flush=True)
        return True
    return False


def measure_cost_model(engine: RuntimeEngine, L: int, granularity: int,
                       sizes: list[int] | None = None) -> tuple[BatchTableCostModel, dict]:
    """Collective: for every batch-slice size b in ``sizes`` (default: the micro-batch size),
    profile every stage (:func:`profile_engine_stage`; per (i, j) the slowest rank), fit the
    table model, add the slowest rank's p2p time per slice (:func:`profile_transfer`).  Every
    rank returns the same model, and ``{compute_profile_s, p2p_profile_s, samples, fit_error}``
    (what profiling cost; the fit error is the worst size's)."""
    sizes = sizes or [engine.train_micro_batch_size_per_gpu()]
    lengths = profile_grid(L, granularity)[0]
    models, compute_s, p2p_s, samples, worst = {}, 0.0, 0.0, 0, 0.0
    for b in sizes:
        t0 = time.perf_counter()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, profile_engine_stage(engine, L, granularity, rows=b))
        measured = _bottleneck(gathered)
        t1 = time.perf_counter()
        p2p: list = [None] * dist.get_world_size()
        dist.all_gather_object(p2p, profile_transfer(engine, lengths, rows=b))
        t2 = time.perf_counter()
        cost, err = fit_table_cost_model(measured)
        models[b] = cost.with_transfer([max(r[n] for r in p2p) for n in range(len(lengths))])  # the bottleneck's
        compute_s, p2p_s, samples, worst = compute_s + t1 - t0, p2p_s + t2 - t1, samples + len(measured), max(worst, err)
    return BatchTableCostModel(models), {"compute_profile_s": round(compute_s, 3), "p2p_profile_s": round(p2p_s, 3),
                                         "samples": samples, "fit_error": round(worst, 4), "batch_sizes": sizes}


def auto_plan(engine: RuntimeEngine) -> Plan:
    """Collective: every rank calls it on its first train_batch; all get rank 0's plan."""
    cfg = engine.ds_mp_config
    tcfg, L, K = cfg.terapipe, cfg.data.seq_len, engine.num_stages
    B, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    path, meta = profile_path(cfg), profile_meta(engine)
    have = [_cached(path, meta, bool(tcfg.profile)) if rank == 0 else None]
    dist.broadcast_object_list(have, src=0)
    measured: tuple | None = None
    if not have[0]:
        if tcfg.profile:
            err = f"ds_mp.terapipe.profile: {path!r} not found; run `ds-mp plan --profile` or set it to \"\""
            raise ConfigError(err)
        measured = measure_cost_model(engine, L, tcfg.granularity, profile_sizes(B, tcfg.batch_slices))
    result: list = [None]
    if rank == 0:
        try:
            if measured:
                cost, took = measured
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                cost.save(path, {**meta, **took})
                print(f"terapipe: profiled {took['samples']} stage costs (batch-slices of {took['batch_sizes']} rows) in "
                      f"{took['compute_profile_s']:.1f}s and "
                      f"p2p on {K - 1} link(s) in {took['p2p_profile_s']:.1f}s (fit error {took['fit_error']:.1%});"
                      f" saved {path}", flush=True)
            else:
                cost = load_cost_model(path)
            result[0] = plan_for(cost, B, L, K, tcfg.batch_slices, tcfg.granularity, engine.micro_batches)
        except (ConfigError, OSError, ValueError, TypeError) as e:
            result[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(result, src=0)  # the error too, so no rank hangs
    if isinstance(result[0], str):
        raise ConfigError(f"ds_mp.terapipe.slices: auto planning failed on rank 0: {result[0]}")
    return result[0]


# ------------------------------------------------------------------ `ds-mp plan`

def profile_blocks(cfg: DsMpConfig, micro_batch: int) -> list[tuple[int, int, float]]:
    """One process, TP = 1: time ⌈n_layer / stages⌉ freshly initialised blocks of the model's
    family (a stage's blocks; embedding and head are left out) at the micro-batch size, on
    DeepSpeed's accelerator device (the GPU where there is one, else the CPU)."""
    from ds_mp.models.family import model_config
    from ds_mp.models.ctx import Ctx
    from ds_mp.models.weights import fresh_source
    from ds_mp.topology import Topology

    hf = model_config(cfg)
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), hf, sequence_parallel=False, vocab_pad_multiple=1)
    src = fresh_source(hf, seed=0)
    rows = [r for r in ctx.family.pipeline_layers(hf) if re.fullmatch(r"[a-z_]+\.\d+", r)]  # h.3, layers.3
    blocks = [ctx.family.layer_spec(r, src, ctx).build().eval() for r in rows[:math.ceil(cfg.shape.n_layer / cfg.pp)]]
    assert all(getattr(b, "is_block", False) for b in blocks), f"{ctx.family.name}: {rows} are not all blocks"
    stage = torch.nn.Sequential(*blocks)

    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().device_name())  # profile where training runs (GPU if any)
    stage = stage.to(device)

    def make_input(i: int, j: int) -> torch.Tensor:
        return torch.randn(micro_batch, i, hf.hidden_size, device=device, requires_grad=True)

    fn = _slice_timer(stage, blocks, make_input, micro_batch, ctx.family.head_dim(hf), torch.float32, device)
    return _profile(fn, cfg.data.seq_len, cfg.terapipe.granularity)


__all__ = ["engine_plan", "auto_plan", "profile_engine_stage", "profile_transfer", "profile_meta", "measure_cost_model", "profile_blocks", "profile_grid", "profile_path",
           "PROFILE_NAME"]
