"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline) as a DeepSpeed schedule.

The layers are cut into K·v chunks (the cost-balanced split per chunk); pipeline rank s holds
chunks s, s + K, s + 2K, … (virtual stages c·K + s for its local chunks c = 0 … v−1).  A
micro-batch goes round the ring v times: the last rank sends chunk c's activation to the first
rank's chunk c + 1 (DeepSpeed's p2p allows the wrap last <-> first), and the gradients come back
the same way.  With v chunks per rank the warm-up and cool-down ramps are v times shorter:

    bubble(1F1B) = (K − 1)(F + B)        bubble(interleaved) = (K − 1)(F + B) / v

The timetable is :func:`ds_mp.schedules.simulate.interleaved_timetable` (Megatron's order:
forwards in groups of K micro-batches chunk by chunk, backwards likewise with the chunks
reversed; M % K == 0); :class:`~ds_mp.schedules.timetable.TimetableSchedule` compiles it into
deadlock-free blocking sends and receives along the ring (:func:`ring_peer`).  ``Op.slice`` is
the local chunk.  Engine handlers: ``ds_mp.engine.interleaved``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterator

from deepspeed.runtime.pipe import schedule as ds

from ds_mp.config.registry import ALL_FAMILIES, ScheduleSpec
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel
from ds_mp.schedules.simulate import Op, interleaved_deps, interleaved_timetable
from ds_mp.schedules.timetable import TimetableSchedule, Transfer
from ds_mp.schedules.zero_bubble import stage_weights
from ds_mp.engine_view import StageView


class ChunkForward(ds.BufferOpInstruction):
    """Forward the unit in ``buffer_id`` through this rank's local chunk ``chunk``; ``micro`` is
    its micro-batch (checked against the labels the last virtual stage loaded).
    kwargs: ``buffer_id``, ``chunk``, ``micro``."""


class ChunkBackward(ds.BufferOpInstruction):
    """Backward the unit in ``buffer_id`` (micro-batch ``micro``) through local chunk ``chunk``.
    kwargs: ``buffer_id``, ``chunk``, ``micro``."""


def ring_peer(stages: int, chunks: int) -> Callable[[int, Op], int | None]:
    """Who sends an op's input: F(s, m, c) receives from s − 1, or from K − 1 (chunk c − 1) when
    s = 0 < c; B(s, m, c) receives from s + 1, or from 0 (chunk c + 1) when s = K − 1, c < v − 1."""
    K = stages

    def peer(s: int, op: Op) -> int | None:
        c = op.slice
        if op.kind == "F":
            return s - 1 if s > 0 else (K - 1 if c > 0 else None)
        if op.kind == "B":
            return s + 1 if s < K - 1 else (0 if c < chunks - 1 else None)
        return None
    return peer


def forward_only_timetable(K: int, M: int, v: int) -> list[list[Op]]:
    """Evaluation: every stage forwards chunk 0 of every micro-batch, then chunk 1, …"""
    return [[Op("F", m, c) for c in range(v) for m in range(M)] for _ in range(K)]


class Interleaved1F1B(TimetableSchedule):
    """``"schedule": "interleaved"`` with ``pipeline.virtual_stages`` = v chunks per rank."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 2,
                 forward_only: bool = False, chunk_weights: list[float] | None = None) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.v, self.forward_only = virtual_stages, forward_only
        self.deps = interleaved_deps(virtual_stages)
        self.chunk_weights = chunk_weights  # per virtual stage c·K + s: relative compute (None: equal)

    @classmethod
    def from_engine(cls, engine: StageView) -> "Interleaved1F1B":
        return cls(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id,
                   virtual_stages=engine.ds_mp_config.pipeline.virtual_stages,
                   chunk_weights=chunk_weights(engine.module))

    def cost(self, stage: int, op: Op) -> float:
        """Modelled op time (only the compiled order of transfers depends on it): a chunk's weight
        in blocks (its LM head counted, :func:`chunk_weights`), a backward twice a forward."""
        weight = self.chunk_weights[op.slice * self.stages + stage] if self.chunk_weights else 1.0
        return weight * (2.0 if op.kind == "B" else 1.0)

    def table(self) -> list[list[Op]]:
        if self.forward_only:
            return forward_only_timetable(self.stages, self.micro_batches, self.v)
        return interleaved_timetable(self.stages, self.micro_batches, self.v)

    def peer(self) -> Callable[[int, Op], int | None]:
        return ring_peer(self.stages, self.v)

    def sent_unit(self, move: Transfer) -> tuple[int, int]:
        """Across the wrap the sender's chunk is the consumer's − 1 (activations) or + 1 (gradients)."""
        wrap = (move.src > move.dst) == (move.kind == "act")
        return move.op.micro, move.op.slice + ((-1 if move.kind == "act" else 1) if wrap else 0)

    def compute(self, op: Op, buffer_id: int) -> list:
        """F loads the micro-batch on the first virtual stage (token ids) and the last (labels)."""
        if op.kind == "F":
            first = self.stage_id == 0 and op.slice == 0
            last = self.stage_id == self.stages - 1 and op.slice == self.v - 1
            return ([ds.LoadMicroBatch(buffer_id=buffer_id)] if first or last else []) + \
                [ChunkForward(buffer_id=buffer_id, chunk=op.slice, micro=op.micro)]
        if op.kind == "B":
            return [ChunkBackward(buffer_id=buffer_id, chunk=op.slice, micro=op.micro)]
        raise ValueError(f"{type(self).__name__}: no instruction for op kind {op.kind!r}")

    def steps(self) -> Iterator[list]:
        step_end = (ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep)
        for cmds in super().steps():
            yield [c for c in cmds if not isinstance(c, step_end)] if self.forward_only else cmds


def chunk_weights(net: Any) -> list[float] | None:
    """Each virtual stage's compute in blocks, the last one's LM head and loss included (ZB-H1's
    :func:`~ds_mp.schedules.zero_bubble.stage_weights` over the chunk boundaries); the same on
    every rank.  None without ds_mp's layer table."""
    parts = getattr(net, "virtual_parts", None) or getattr(net, "parts", None)
    return stage_weights(SimpleNamespace(ds_mp_ctx=getattr(net, "ds_mp_ctx", None), parts=parts,
                                         layer_names=getattr(net, "layer_names", None)))


class InterleavedSpec(ScheduleSpec):
    """Interleaved 1F1B: ``pipeline.virtual_stages`` chunks per stage round a ring of at least 2
    stages, micro-batches in groups of ``pipeline.stages``; tested against HF in fp32/bf16 with
    ZeRO 0 and 1, DP, TP (sequence parallelism too), LoRA and activation checkpointing."""

    def check(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        pp, v = cfg.pipeline, cfg.pipeline.virtual_stages
        if pp.stages < 2:
            raise ConfigError(f"ds_mp.pipeline.stages: {pp.stages}; the interleaved schedule needs a ring of at least 2 "
                              "stages (use 1f1b on one stage)")
        if pp.stages * v > shape.n_layer:
            raise ConfigError(f"ds_mp.pipeline.virtual_stages: {pp.stages} stages × {v} chunks exceed "
                              f"n_layer={shape.n_layer} blocks; lower it")

    def check_deepspeed(self, raw: dict, cfg: DsMpConfig) -> None:
        gas, zero = raw.get("gradient_accumulation_steps", 1), (raw.get("zero_optimization") or {}).get("stage", 0)
        if gas % cfg.pp:
            raise ConfigError(f"gradient_accumulation_steps: {gas} micro-batches; the interleaved schedule runs them "
                              f"in groups of pipeline.stages={cfg.pp} (as Megatron does): use a multiple of {cfg.pp}")
        if (zero or 0) >= 2:
            raise ConfigError("zero_optimization.stage: the interleaved schedule is tested with ZeRO 0 and 1; use one")
        if (raw.get("fp16") or {}).get("enabled"):
            raise ConfigError("fp16.enabled: the interleaved schedule is tested in fp32 and bf16; use the bf16 block")

    def micro_multiple(self, cfg: DsMpConfig) -> int:
        """Its order walks the ring in groups of ``pipeline.stages`` micro-batches."""
        return cfg.pipeline.stages

    def micro_multiple_reason(self, cfg: DsMpConfig) -> str:
        return f"stages ({cfg.pipeline.stages}: interleaved runs a multiple of the ring's micro-batches)"


INTERLEAVED = InterleavedSpec(timetable=Interleaved1F1B, runtime="ds_mp.engine.interleaved:attach",
                              families=ALL_FAMILIES, batch_ramp=True, virtual_stages=True,
                              context_parallel=True)

__all__ = ["ChunkForward", "ChunkBackward", "ring_peer", "forward_only_timetable", "Interleaved1F1B",
           "chunk_weights", "InterleavedSpec", "INTERLEAVED"]
