"""Engine side of interleaved 1F1B: run one local chunk of the pipeline module at a time.

Imported by the engine when the ``interleaved`` schedule is selected (its spec's runtime: :func:`attach`).  The
module (``build_pipeline(virtual_stages=v)``) holds this rank's v chunks as consecutive runs of
its ``forward_funcs`` (chunk c = virtual stage c·K + s, its layers in the order of the model);
``module.virtual_parts`` are the chunk boundaries over the whole layer table.

A chunk's instruction runs DeepSpeed's own handlers (forward with the loss on the last virtual
stage, backward of the loss or of the received gradient, bf16/fp16 bookkeeping) with two things
switched for its duration (:meth:`InterleavedState.chunk`):

* the module's ``forward_funcs`` are the chunk's layers only, with their activation-checkpoint
  segments (as DeepSpeed's DualPipeV module exposes one phase at a time);
* ``is_first_stage()`` / ``is_last_stage()`` answer for the *virtual* stage: the first is chunk
  0 of rank 0 (token ids in, no input gradient), the last is chunk v − 1 of rank K − 1 (labels,
  loss); every other chunk receives an activation and sends a gradient back.

The p2p neighbours are the ring's, ``(s ± 1) mod K``: DeepSpeed's p2p allows the wrap between
the last and the first stage.  Every chunk boundary carries the hidden state ``(B, T, H)``, so
DeepSpeed's one cached receive buffer and its once-announced shapes stay valid.  Outside a chunk
instruction (gradient reduction, tied-weight all-reduce, the loss aggregation) the engine sees
its physical stage: the tied embedding lives on chunk 0 of rank 0 and the LM head on chunk v − 1
of rank K − 1, so the tied group is DeepSpeed's first/last-stage pair as in 1F1B.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_mp import deepspeed_compat as compat
from ds_mp.schedules.interleaved import ChunkBackward, ChunkForward, Interleaved1F1B
from ds_mp.engine_view import RuntimeEngine


class InterleavedState:
    """One rank's chunks: forward-function ranges and virtual stage ids; the chunk switch."""

    def __init__(self, engine: RuntimeEngine, virtual: list[int] | None = None, bounds: list[int] | None = None) -> None:
        """``virtual``: the virtual stage of each local chunk, in the order the module holds them
        (default the interleaved c·K + s; ZB-V's V: s and 2K − 1 − s); ``bounds``: the chunk bounds
        over the family's layer table, one more than the virtual stages (default the module's)."""
        self.engine = engine
        self.K, self.s = engine.num_stages, engine.stage_id
        v = engine.ds_mp_config.pipeline.virtual_stages
        self.virtual = virtual or [c * self.K + self.s for c in range(v)]
        self.v = len(self.virtual)
        vparts = bounds or engine.module.virtual_parts or compat.stage_bounds(engine.module)  # chunk bounds, K·v + 1
        self.last = len(vparts) - 2  # the last virtual stage (it computes the loss)
        sizes = [vparts[vs + 1] - vparts[vs] for vs in self.virtual]
        self.funcs = compat.local_layers(engine.module)
        if sum(sizes) != len(self.funcs):
            raise RuntimeError(f"interleaved: rank {self.s} holds {len(self.funcs)} layers, its chunks {sizes}")
        starts = [sum(sizes[:c]) for c in range(self.v)]
        self.ranges = [(a, a + n) for a, n in zip(starts, sizes)]
        # DeepSpeed's checkpoint-segment flags per chunk (its forward zips them with the segments)
        self.checkpointable = [compat.checkpointable_flags(engine.module, self.funcs[a:b]) for a, b in self.ranges]
        compat.set_neighbours(engine, (self.s - 1) % self.K, (self.s + 1) % self.K)  # the ring
        self.ends: tuple[bool, bool] | None = None  # inside a chunk: (first, last) virtual stage

    @contextlib.contextmanager
    def chunk(self, c: int) -> Iterator[None]:
        """Inside: the module runs local chunk ``c`` only and the engine is its virtual stage."""
        vs = self.virtual[c]
        a, b = self.ranges[c]
        self.ends = (vs == 0, vs == self.last)  # what the engine's is_first_stage / is_last_stage answer
        try:
            with compat.running_layers(self.engine.module, self.funcs[a:b], self.checkpointable[c]):
                yield
        finally:
            self.ends = None

    def stage_ends(self) -> tuple[bool, bool] | None:
        """Inside a chunk: whether its virtual stage is the pipe's first / last (None outside)."""
        return self.ends

    def chunk_forward(self, buffer_id: int, chunk: int, micro: int) -> None:
        with self.chunk(chunk):
            self.engine.expect_micro(buffer_id, micro)  # the schedule's micro-batch: checked against the labels
            self.engine.run_forward(buffer_id)

    def chunk_backward(self, buffer_id: int, chunk: int, micro: int) -> None:  # noqa: ARG002 - traced
        with self.chunk(chunk):
            self.engine.run_backward(buffer_id)

    instructions = {ChunkForward: "chunk_forward", ChunkBackward: "chunk_backward"}

    def eval_batch(self, data_iter: Any, *args: Any, num_micro_batches: int | None = None, **kwargs: Any) -> Any:
        """DeepSpeed's ``eval_batch`` with the forward-only interleaved timetable (every chunk of
        every micro-batch, round the ring v times) in place of its linear inference schedule."""
        e = self.engine
        fed = e._prepare(data_iter, num_micro_batches or e.micro_batches, training=False)
        with compat.inference_schedule(e, lambda n: Interleaved1F1B(n, self.K, self.s, self.v, forward_only=True)), \
                compat.batch_fn_done(e):
            return PipelineEngine.eval_batch(e, fed, *args, num_micro_batches=num_micro_batches, **kwargs)


def attach(engine: RuntimeEngine) -> InterleavedState:
    """The runtime of an interleaved engine (made by its spec, ``config.registry.ScheduleSpec.runtime``)."""
    return InterleavedState(engine)


__all__ = ["InterleavedState", "attach"]
