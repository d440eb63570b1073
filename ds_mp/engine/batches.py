"""A step's micro-batches, read before the step: parsed, counted, their layouts sent along the pipeline.

The loss is the run's :class:`~ds_mp.losses.spec.LossSpec` (``engine.module.loss_spec``), which
states its normalisation in one place (``ds_mp.losses.spec``: for the per-token LM loss, the global
batch's token-loss sum over its target count N, and how DeepSpeed's 1/GAS and DP mean are
compensated).  N is known before the step: the ranks that read data (the first and last stage) read
the step's M micro-batches up front, count their units (``spec.units``: target tokens) and
all-reduce the count over the ranks that read distinct rows (``topology.dp_group``; CP peers read the
same rows); the spec divides by the gradient group's size (``topology.grad_size``: dp × cp, the DP
replicas while cp = 1), the group DeepSpeed averages over; stage 0 broadcasts it with the batch shape along the pipeline (the
shape broadcast DeepSpeed#4777 already needs), so every stage agrees to skip a step without a target.

Each micro-batch is handed to DeepSpeed as ``(input_ids or (input_ids, positions), labels)``, the
labels the spec's tuple ``(targets, denominator, *extras)`` (``spec.labels``) which the spec's bound
``loss_fn`` reads back on the last stage (``extras``: the loss's extra tensors of a dict batch,
``MicroBatch.extras``); the embedding reads the positions.  Micro-batches with documents, padding
or a sliding window also have a :class:`~ds_mp.models.batch.Layout`; stage 0 broadcasts them (one
``(M, 2, B, T)`` tensor) to the stages that read no data, and the engine sets the running
micro-batch's layout around each forward and backward (:meth:`DsMpPipelineEngine.micro_layout`).
Shapes stay ``(B, T)``: the p2p buffers and their announced shapes are kept.  Under context
parallelism every micro-batch has a full-row layout and each CP rank is fed its ``T/C`` tokens
(:mod:`ds_mp.engine.context`: targets and counts are made on the full row first).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ds_mp.engine import context
from ds_mp.models.batch import Layout, MicroBatch, parse_micro_batch
from ds_mp.engine_view import RuntimeEngine

_REFUSED_ELSEWHERE = "batch: refused on another rank (its error names the problem)"


@dataclass
class Step:
    """What every stage knows about the step before it runs."""

    count: int = 0  # the loss's units (LM: target tokens) in the global batch
    shape: tuple[int, int] = (0, 0)  # (B, T) of every micro-batch
    layouts: list[Layout | None] = field(default_factory=list)  # per micro-batch, in order


@dataclass
class MicroBook:
    """Which micro-batch each pipe buffer holds on this stage: its identity travels with the buffer
    (loaded on a stage that reads data, received elsewhere, run by the forward for its backward),
    so the layout and labels a buffer is run with are its own micro-batch's.  The engine owns one
    (``engine.micros``); :meth:`start` forgets a schedule run's loads and receives."""

    loaded: dict[int, int] = field(default_factory=dict)  # buffer -> micro-batch whose inputs/labels it holds
    received: dict[int, int] = field(default_factory=dict)  # buffer -> micro-batch whose activations it holds
    ran: dict[int, int] = field(default_factory=dict)  # buffer -> micro-batch its last forward ran
    n_loaded: int = 0
    n_received: int = 0

    def start(self) -> None:
        """A schedule run begins: micro-batches are counted from 0 again."""
        self.loaded.clear()
        self.received.clear()
        self.n_loaded = self.n_received = 0

    def load(self, buffer_id: int, micro: int | None = None) -> None:
        """``buffer_id`` now holds micro-batch ``micro``'s inputs/labels [the next in order]."""
        if micro is None:
            micro, self.n_loaded = self.n_loaded, self.n_loaded + 1
        self.loaded[buffer_id] = micro

    def receive(self, buffer_id: int, micro: int | None = None) -> None:
        """``buffer_id`` now holds micro-batch ``micro``'s activations [the next in order]."""
        if micro is None:
            micro, self.n_received = self.n_received, self.n_received + 1
        self.received[buffer_id] = micro

    def forward(self, buffer_id: int, first_stage: bool) -> None:
        """The forward of ``buffer_id`` runs the micro-batch it holds (loaded on the first stage,
        received elsewhere); its backward will run the same one."""
        self.ran[buffer_id] = (self.loaded if first_stage else self.received).get(buffer_id, 0)

    def micro_of(self, buffer_id: int) -> int:
        """The micro-batch ``buffer_id``'s last forward ran [0]."""
        return self.ran.get(buffer_id, 0)


def batch_source(data_iter: Any, kept: Any, deepspeed_iter: Any, fed: Any) -> Any:
    """The iterator a training step reads (the engine keeps it for the next step): ``data_iter``;
    else DeepSpeed's own (``set_dataiterator`` / ``deepspeed.initialize(training_data=…)``) unless
    that is only the normalized micro-batches ``fed`` last step; else the one ``kept`` from before."""
    if data_iter is not None:
        return data_iter
    source = deepspeed_iter if deepspeed_iter is not None and deepspeed_iter is not fed else kept
    if source is None:
        raise ValueError("train_batch: no data; pass a data iterator (or training_data to the engine)")
    return source


def _read(engine: RuntimeEngine, source: Any, n: int) -> tuple[list[MicroBatch], list[torch.Tensor], list[int], str]:
    """Parse ``n`` micro-batches (with the loss's extras), their targets and units (``spec.units``);
    on a refusal, the message (the step is refused on every rank)."""
    spec = engine.module.loss_spec
    extras = spec.extras
    try:
        mbs = []
        for _ in range(n):
            raw = next(source)
            mbs.append(parse_micro_batch(engine.batch_fn(raw) if engine.batch_fn else raw, extras))
        shapes = {tuple(mb.input_ids.shape) for mb in mbs}
        flat = FLATTENED if any(mb.input_ids.shape[0] == 1 and mb.position_ids is not None for mb in mbs) else ""
        if len(shapes) > 1:
            raise ValueError(f"batch: the micro-batches of one step differ in shape {sorted(shapes)}; pad them to "
                             f"one{flat}")
        seq_len = engine.ds_mp_config.data.seq_len if engine.ds_mp_config is not None else None
        T = mbs[0].input_ids.shape[1]
        if seq_len is not None and T > seq_len:
            raise ValueError(f"batch: sequence length {T} exceeds ds_mp.data.seq_len={seq_len}; raise data.seq_len "
                             f"or cut the batches to {seq_len} tokens{flat}")
        if engine.module.ds_mp_ctx.cp > 1:
            context.check_rows(T, engine.module.ds_mp_ctx)
        targets = [mb.targets() for mb in mbs]
        return mbs, targets, [spec.units(t) for t in targets], ""
    except ValueError as err:
        return [], [], [], str(err)


#: Appended to a shape refusal of one-row packed micro-batches (#43 item 14).
FLATTENED = ("; a flattened (1, T) batch (DataCollatorWithFlattening, TRL padding-free) is re-formed into fixed rows "
             "by ds_mp.data.flatten.unflatten_all (docs/batches.md)")


def prepare_step(engine: RuntimeEngine, source: Any, n: int) -> tuple[Iterator | None, Step]:
    """Read, check and count this step's ``n`` micro-batches from ``source`` (see the module docstring).

    Returns the iterator DeepSpeed reads (the normalized micro-batches; None on stages that read
    no data) and the :class:`Step`.  Collective over DP (reading ranks) and the pipeline; a
    refused batch raises on every rank, after the collectives, so no rank is left waiting."""
    topo, dev = engine.topology, engine.device
    reads = engine.stage_id in engine.data_stages()
    mbs, targets, counts, error = _read(engine, source, n) if reads else ([], [], [], "")
    ctx = engine.module.ds_mp_ctx
    layouts = [mb.layout(ctx.window) for mb in mbs]
    if ctx.cp > 1:  # context parallelism: every micro-batch has a (full-row) layout
        layouts = [context.full_layout(mb, lay) for mb, lay in zip(mbs, layouts)]
    spec = engine.module.loss_spec
    head = torch.zeros(5, dtype=torch.long, device=dev)  # B, T, count, has layouts, refused
    if reads:
        head[4] = int(bool(error))
        if mbs:
            head[0], head[1] = mbs[0].input_ids.shape
            head[2], head[3] = sum(counts), int(any(lay is not None for lay in layouts))
        if topo.dp > 1:  # N: the targets of the distinct rows (each counted on its full row, once)
            both = head[2:5:2].clone()
            dist.all_reduce(both, group=topo.dp_group)
            head[2], head[4] = both
    if engine.num_stages > 1:
        dist.broadcast(head, src=topo.pp_ranks()[0], group=topo.pp_group)
    if head[4]:
        raise ValueError(error or _REFUSED_ELSEWHERE)
    B, T, count, has_layouts = head[:4].tolist()
    if has_layouts and not getattr(engine.schedule_support, "takes_layouts", True):
        raise ValueError(f"batch: documents, padding or a sliding window (position_ids, attention_mask, window < "
                         f"{T} tokens) are not supported by the {engine.schedule_name!r} schedule; use another schedule")
    if has_layouts and engine.num_stages > len(engine.data_stages()):  # stages without data get them from stage 0
        packed = torch.zeros(n, 2, B, T, dtype=torch.long, device=dev)
        if engine.stage_id == 0:
            for i, mb in enumerate(mbs):
                if layouts[i] is not None:  # else: one document per row, positions 0 … T-1
                    packed[i, 0], packed[i, 1] = layouts[i].positions, layouts[i].docs
                else:
                    packed[i, 0] = torch.arange(T, device=dev)
        dist.broadcast(packed, src=topo.pp_ranks()[0], group=topo.pp_group)
        if not reads:
            layouts = [Layout(p[0], p[1], ctx.window) for p in packed]
    if ctx.cp > 1:  # this CP rank's tokens of each (full-row) layout
        layouts = [context.sharded(lay, ctx, dev) for lay in layouts]
    step = Step(count, (B, T), layouts if layouts else [None] * n)
    if not reads:
        return None, step
    fed = _feed(engine, mbs, layouts, targets, spec.denominators(counts, count, topo.grad_size, _normalization(engine)))
    step.layouts = [None if lay is None else Layout(lay.positions.to(dev), lay.docs.to(dev), lay.window, lay.q_index)
                    for lay in layouts]
    return iter(fed), step


def _normalization(engine: RuntimeEngine) -> str:
    return "tokens" if engine.ds_mp_config is None else engine.ds_mp_config.loss.normalization


def _feed(engine: RuntimeEngine, mbs: list[MicroBatch], layouts: list[Layout | None], targets: list[torch.Tensor],
          denominators: list[float]) -> list[tuple]:
    """What DeepSpeed reads of each micro-batch: ``(input_ids or (input_ids, positions), labels)``,
    the labels the loss spec's tuple; under CP this rank's tokens (:mod:`ds_mp.engine.context`)."""
    spec, ctx, dev = engine.module.loss_spec, engine.module.ds_mp_ctx, engine.device
    fed = []
    for mb, lay, tgt, d in zip(mbs, layouts, targets, denominators):
        inputs, extras = (mb.input_ids if lay is None else (mb.input_ids, lay.positions)), mb.extras
        if ctx.cp > 1:
            inputs, tgt, extras = context.shard_micro_batch(mb, lay, tgt)
            d = context.shard_denominators([d], _normalization(engine), ctx)[0]
        fed.append((inputs, spec.labels(tgt, torch.tensor(d, device=dev), extras)))
    return fed


@contextlib.contextmanager
def micro_layout(engine: RuntimeEngine, buffer_id: int, forward: bool = False) -> Iterator[None]:
    """Inside: the model attends with the layout of the micro-batch in ``buffer_id`` (documents,
    padding, window; None = plain causal).  ``forward`` records which micro-batch that is (the
    loaded one on the first stage, the received one elsewhere) for its backward.  A schedule may
    answer itself (``layout_of(buffer_id)``, TeraPipe's token slices) or leave it to this rule
    (``NotImplemented``)."""
    hook = getattr(engine.schedule_support, "layout_of", None)
    layout = hook(buffer_id) if hook is not None else NotImplemented
    if layout is NotImplemented:
        if forward:
            engine.micros.forward(buffer_id, engine.is_first_stage())
        layouts, micro = engine.step_info.layouts, engine.micros.micro_of(buffer_id)
        layout = layouts[micro] if micro < len(layouts) else None
    ctx = engine.module.ds_mp_ctx
    saved, ctx.layout = ctx.layout, layout
    try:
        yield
    finally:
        ctx.layout = saved


def warn_no_targets(engine: RuntimeEngine) -> torch.Tensor:
    """The step of a global batch without a target: skipped (no update), loss 0, a warning."""
    warnings.warn(f"step {engine.global_steps + 1}: the global batch has no target token (every shifted label is "
                  "-100); step skipped, weights unchanged", RuntimeWarning, stacklevel=3)
    return torch.zeros((), device=engine.device)


__all__ = ["Step", "MicroBook", "prepare_step", "batch_source", "micro_layout", "warn_no_targets"]
