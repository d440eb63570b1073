"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) as a DeepSpeed schedule.

A backward is two passes with different consumers:

    B (input gradient)   dX = ∂L/∂X of the stage input: the previous stage waits for it;
    W (weight gradient)  dθ = ∂L/∂θ of the stage's parameters: nobody waits for it.

Running W later than B takes it off the critical path of the gradient chain and lets it fill
the bubbles 1F1B leaves; :func:`ds_mp.schedules.simulate.zb_h1_timetable` is the timetable
(1F1B's F/B order, stage s defers its W by d_s micro-batches: ``pipeline.zb_max_pending_w``,
by default ⌊s/2⌋, which keeps every stage's held memory within 1F1B's largest rank although a
pending W holds its recorded gradients on top of its activations; the paper's d_s = s holds
K micro-batches' activations plus d_s micro-batches' recorded gradients) and :class:`ds_mp.schedules.timetable.TimetableSchedule` turns it into
instruction steps.  Engine handlers of the two instructions: ``ds_mp.engine.zero_bubble``.

The first stage has no input gradient to send: its B only keeps the received output gradient,
and its W runs its whole backward (in the bubble where ZB-H1 puts W).
"""
from __future__ import annotations

from typing import Any

from deepspeed.runtime.pipe.schedule import BufferOpInstruction

from ds_mp.config.registry import ALL_FAMILIES, ScheduleSpec
from ds_mp.config.schema import ConfigError, DsMpConfig
from ds_mp.schedules.simulate import Op, zb_h1_timetable, zero_bubble_deps
from ds_mp.schedules.timetable import TimetableSchedule
from ds_mp.engine_view import StageView


class BackwardInput(BufferOpInstruction):
    """B of the unit in ``buffer_id``: the gradient of the stage input (what ``SendGrad`` sends),
    keeping what W needs (the gradients at the parameters' consumers).  kwargs: ``buffer_id``."""


class BackwardWeight(BufferOpInstruction):
    """W of the unit in ``buffer_id``: accumulate its parameter gradients into ``.grad`` and free
    its activations.  kwargs: ``buffer_id``."""


# Modelled relative op costs (only the order of transfers depends on them).  The first stage's B
# is bookkeeping; its W is the whole backward.
COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}
FIRST_STAGE_COSTS = {"F": 1.0, "B": 1e-3, "W": 2.0}


class ZeroBubbleH1(TimetableSchedule):
    """``"schedule": "zb-h1"``: the ZB-H1 timetable with split backward instructions.

    Its transfers are ordered with every stage priced alike.  Pricing them by their compute
    (:func:`stage_weights`) was tried and measured worse: where the last stage (the LM head's) is
    the slowest, it sent each gradient before its next W, but then waited for the next activation
    while the first stage ran its own W before sending it (a blocking send happens when the
    sender's program reaches it, not at the modelled time) — the equal-price order keeps the
    slowest stage busy."""

    deps = staticmethod(zero_bubble_deps)

    def __init__(self, micro_batches: int, stages: int, stage_id: int, max_pending_w: int | str = "auto") -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.max_pending_w = max_pending_w  # W passes a stage may defer (``pipeline.zb_max_pending_w``)

    @classmethod
    def from_engine(cls, engine: StageView) -> "ZeroBubbleH1":
        return cls(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id,
                   max_pending_w=engine.ds_mp_config.pipeline.zb_max_pending_w)

    def table(self) -> list[list[Op]]:
        return zb_h1_timetable(self.stages, self.micro_batches, self.max_pending_w)

    def cost(self, stage: int, op: Op) -> float:
        return (FIRST_STAGE_COSTS if stage == 0 else COSTS)[op.kind]

    def compute(self, op: Op, buffer_id: int) -> list:
        if op.kind == "B":
            return [BackwardInput(buffer_id=buffer_id)]
        if op.kind == "W":
            return [BackwardWeight(buffer_id=buffer_id)]
        return super().compute(op, buffer_id)


def stage_weights(net: Any) -> list[float] | None:
    """Each stage's compute in blocks, the same on every rank (a schedule pricing its transfers with
    it must compile one order everywhere): its blocks, plus on the last stage the LM head and its
    loss, ``V·d`` multiply-adds per token against a block's parameter count (a block's
    multiply-adds per token, attention's own ``T·d`` aside).  None for a module without ds_mp's
    layer table."""
    ctx, parts, names = (getattr(net, k, None) for k in ("ds_mp_ctx", "parts", "layer_names"))
    if ctx is None or parts is None or names is None:
        return None
    lead, tail = ctx.family.lead_layers, ctx.family.tail_layers
    blocks = [sum(lead <= i < len(names) - tail for i in range(a, b)) for a, b in zip(parts, parts[1:])]
    head = ctx.padded_vocab * ctx.n_embd / ctx.family.block_parameters(ctx.hf)
    return [max(n + (head if s == len(blocks) - 1 else 0.0), 0.1) for s, n in enumerate(blocks)]


class ZeroBubbleSpec(ScheduleSpec):
    """A split-backward schedule (ZB-H1, ZB-V): its W pass adds weight gradients outside autograd's
    accumulation (ZeRO 0/1 only); tested in fp32 and bf16."""

    def check_deepspeed(self, raw: dict, cfg: DsMpConfig) -> None:
        name = cfg.pipeline.schedule
        if ((raw.get("zero_optimization") or {}).get("stage", 0) or 0) >= 2:
            raise ConfigError(f"zero_optimization.stage: the {name} schedule computes weight gradients in a deferred "
                              "pass that ZeRO-2's per-parameter reduction hooks do not see; set it to 0 or 1")
        if (raw.get("fp16") or {}).get("enabled"):
            raise ConfigError(f"fp16.enabled: the {name} schedule is tested in fp32 and bf16 only; use the bf16 block")


ZB_H1 = ZeroBubbleSpec(timetable=ZeroBubbleH1, runtime="ds_mp.engine.zero_bubble:attach", families=ALL_FAMILIES,
                       batch_ramp=True, context_parallel=True)

__all__ = ["BackwardInput", "BackwardWeight", "ZeroBubbleH1", "ZeroBubbleSpec", "ZB_H1", "stage_weights"]
