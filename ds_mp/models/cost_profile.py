"""``"partition": "cost"``: what one micro-batch costs in each kind of pipeline layer of a family.

A stage of the pipeline built by ``ds_mp.models.pipeline.build_pipeline`` holding c blocks costs,
per micro-batch (forward + backward),

    c·block + embed·[s = 0] + head·[s = K−1]

    embed   the layers before the first block     (GPT-2: wte lookup + wpe; Llama: embed_tokens)
    block   one transformer block
    head    the layers after the last + the loss  (final norm + LM head + loss)

and ``LayerCosts.blocks`` chooses the block counts that minimise the costliest stage (exact,
``ds_mp.models.partition.balanced_blocks``).  The segments are built from the family's own
layer table (``Family.layer_spec`` of its rows), so any family is measured the same way.  :func:`measure_layer_costs` times the three segments
at the run's micro-batch shape (rows × seq), dtype, TP degree and sequence parallelism, with
this rank's own layers, on the engine's device: each segment is a real layer built from the
run's weight source, fed the previous segment's output (so shapes are the pipeline's, SP
included), in interleaved rounds (machine drift hits all three alike), every clock read after
an accelerator sync, median of the rounds.

:func:`agreed_layer_costs` is the collective used at engine build: every rank measures at once
(as they will train: all ranks busy; TP ranks in lockstep over their TP group), the per-rank
triples are all-gathered (a bit-exact copy) and each cost is the median over ranks, so every
rank holds identical numbers and computes the same partition.  Rank 0 keeps the result in a
JSON cache under a key naming the model shape, micro-batch shape, dtype, TP layout, LoRA and
device (:func:`profile_key`, like TeraPipe's ``terapipe_profile.json``); a later run with the
same key reuses it (rank 0 reads it and broadcasts).  Profiling leaves every random stream as
it found it (layers in eval mode, inputs from a private generator, states restored), so a
``"cost"`` run trains bit-identically to the same partition given as a list.

Not measured: activation checkpointing's recomputation, p2p sends and the once-per-step
optimizer update of the tied embedding, which the first and last stage both hold.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_mp.atomic import write_text_atomic
from ds_mp.models.family import family_of
from ds_mp.models.partition import LayerCosts
from ds_mp.losses import LM_LOSS, shift_labels
from ds_mp.models.pipeline import LAYER_COST_VERSION, Ctx
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel.random import rng_state, set_rng_state
from ds_mp.topology import Topology, build_grid

PROFILE_NAME = "partition_profile.json"
KINDS = ("embed", "block", "head")


def synced_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn()``, the accelerator synchronised before each clock read (so
    asynchronous GPU kernels fall inside the interval they belong to; a no-op on the CPU)."""
    from deepspeed.accelerator import get_accelerator

    sync = get_accelerator().synchronize
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def device_label(device: torch.device) -> str:
    """What the costs were measured on: the GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return device.type
    return f"cpu {cpu_model()}, {torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def profile_key(hf_config: Any, *, rows: int, seq: int, dtype: torch.dtype, device: torch.device, tp: int,
                sequence_parallel: bool, vocab_pad_multiple: int, lora: Any = None, overlap_comm: bool = True) -> str:
    """The cache key: everything the three costs depend on."""
    shape = family_of(hf_config).cost_shape(hf_config)  # what a layer's cost depends on, as its family says
    parts = {**shape, "rows": rows, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
             "tp": tp, "sp": bool(sequence_parallel and tp > 1), "vocab_pad_multiple": vocab_pad_multiple,
             "overlap_comm": bool(overlap_comm and tp > 1),
             "lora": ([lora.r, sorted(lora.target_modules), *([sorted(lora.target_parameters)]
                                                              if getattr(lora, "target_parameters", None) else [])]
                      if lora is not None and lora.r > 0 else None),
             "device": device_label(device), "version": LAYER_COST_VERSION}
    return json.dumps(parts, sort_keys=True, default=str)


def measure_layer_costs(src: WeightSource, topology: Topology, *, rows: int, seq: int, dtype: torch.dtype,
                        device: torch.device, sequence_parallel: bool = False, vocab_pad_multiple: int = 128,
                        lora: Any = None, overlap_comm: bool = True, rounds: int = 5, warmup: int = 2) -> LayerCosts:
    """This rank's measurement (a collective over its TP group when ``topology.tp > 1``: the
    topology must have its process groups).  Layers are built from ``src`` as ``build_pipeline``
    builds them (block 0 stands for every block; a tied embedding is one module at both ends),
    cast to ``dtype`` and moved to ``device``; gradients accumulate into ``.grad`` as over a
    step's micro-batches."""
    saved = rng_state()
    try:
        ctx = Ctx(topology, src.config, sequence_parallel, vocab_pad_multiple)
        ctx.lora = lora if lora is not None and lora.r > 0 else None
        ctx.overlap_comm = overlap_comm
        family, table, tied = ctx.family, ctx.family.pipeline_layers(src.config), {}
        lead = [_built(family.layer_spec(p, src, ctx), device, dtype, tied) for p in table[:family.lead_layers]]
        block = _built(family.layer_spec(table[family.lead_layers], src, ctx), device, dtype, tied)  # every block's
        tail = [_built(family.layer_spec(p, src, ctx), device, dtype, tied) for p in table[-family.tail_layers:]]
        if ctx.lora is not None:  # LoRA trains only its factors: no base weight gradients
            for _, module in (*lead, (None, block), *tail):
                for name, p in module.named_parameters():
                    p.requires_grad = ".lora_" in name
        loss_fn = LM_LOSS.bind(ctx)  # the head is timed with the per-token LM loss (what partitioning assumes)
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, ctx.vocab, (rows, seq), generator=gen, device=device)
        targets = shift_labels(ids)
        labels = LM_LOSS.labels(targets, (targets != -100).sum().clamp(min=1))

        def embed() -> torch.Tensor:
            return _run(lead, ids)

        h0 = embed().detach()
        h1 = block[1](h0).detach()
        x_block, x_head = h0.clone().requires_grad_(), h1.clone().requires_grad_()
        g_embed = torch.randn(h0.shape, generator=gen, device=device, dtype=dtype)
        g_block = torch.randn(h1.shape, generator=gen, device=device, dtype=dtype)
        segments: dict[str, Callable[[], None]] = {
            "embed": lambda: _backward(embed(), g_embed),
            "block": lambda: _backward(block[1](x_block), g_block),
            "head": lambda: _backward(loss_fn(_run(tail, x_head), labels), None),
        }
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(warmup + rounds):
            for kind in KINDS:
                t = synced_seconds(segments[kind])
                if r >= warmup:
                    times[kind].append(t)
        return LayerCosts(**{k: statistics.median(v) for k, v in times.items()})
    finally:
        set_rng_state(saved)


def _built(spec: Any, device: torch.device, dtype: torch.dtype,
           tied: dict[str, torch.nn.Module]) -> tuple[Callable[..., Any], torch.nn.Module]:
    """(forward, module) of a DeepSpeed layer spec, built and moved; a ``TiedLayerSpec`` key is built
    once (kept in ``tied``) and called with its ``forward_fn``."""
    key = getattr(spec, "key", None)
    if key is not None and key in tied:
        module = tied[key]
    else:
        module = spec.build().to(device=device, dtype=dtype).eval()
        if key is not None:
            tied[key] = module
    fn = getattr(spec, "forward_fn", None)
    return ((lambda x: fn(module, x)) if fn is not None else module), module


def _run(layers: list[tuple[Callable[..., Any], torch.nn.Module]], x: Any) -> Any:
    for forward, _ in layers:
        x = forward(x)
    return x


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    if out.requires_grad:  # LoRA with a frozen embedding: the embedding has nothing to backpropagate
        out.backward(grad)


def agreed_layer_costs(src: WeightSource, topology: Topology, *, cache: str | None, rows: int, seq: int,
                       dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False,
                       vocab_pad_multiple: int = 128, lora: Any = None, overlap_comm: bool = True) -> LayerCosts:
    """Collective over every rank: the costs (from ``cache`` if it holds this key, else measured
    on every rank, median over ranks; rank 0 then adds them to ``cache``), identical on every rank.
    ``topology`` gives the degrees and this rank; its process groups are not needed."""
    key = profile_key(src.config, rows=rows, seq=seq, dtype=dtype, device=device, tp=topology.tp,
                      sequence_parallel=sequence_parallel, vocab_pad_multiple=vocab_pad_multiple, lora=lora,
                      overlap_comm=overlap_comm)
    entry = _read_cache(cache).get(key) if cache and dist.get_rank() == 0 else None
    valid = (isinstance(entry, dict) and set(entry) == set(KINDS)
             and all(isinstance(v, float) and v > 0 for v in entry.values()))  # else: measure again
    known = torch.tensor([1.0, *(entry[k] for k in KINDS)] if valid else [0.0] * 4, dtype=torch.float64,
                         device=device)
    dist.broadcast(known, src=0)  # rank 0's verdict (and costs, bit-exact) to every rank
    if known[0] == 1.0:
        return LayerCosts(*known[1:].tolist())
    if topology.tp > 1:  # TP layers need the TP group; the pipeline creates its own groups later
        topology = build_grid(Topology(tp=topology.tp, pp=topology.pp, dp=topology.dp, cp=topology.cp,
                                        rank=topology.rank))
    mine = measure_layer_costs(src, topology, rows=rows, seq=seq, dtype=dtype, device=device,
                               sequence_parallel=sequence_parallel, vocab_pad_multiple=vocab_pad_multiple, lora=lora,
                               overlap_comm=overlap_comm)
    local = torch.tensor([getattr(mine, k) for k in KINDS], dtype=torch.float64, device=device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)  # a copy: every rank holds the same bits
    table = torch.stack(every).cpu()
    costs = LayerCosts(**{k: statistics.median(table[:, i].tolist()) for i, k in enumerate(KINDS)})
    if cache and dist.get_rank() == 0:
        entries = _read_cache(cache)
        entries[key] = {k: getattr(costs, k) for k in KINDS}
        try:
            os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
            write_text_atomic(cache, json.dumps(entries, indent=1, sort_keys=True) + "\n")
        except OSError as e:  # only a cache: the other ranks are already building the pipeline
            warnings.warn(f"ds_mp: could not cache the partition profile in {cache}: {e}")
    return costs


def _read_cache(path: str) -> dict:
    """The cache's entries ({} when it is missing or unreadable: it is only a cache)."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


__all__ = ["PROFILE_NAME", "synced_seconds", "device_label", "cpu_model", "profile_key", "measure_layer_costs",
           "agreed_layer_costs"]
