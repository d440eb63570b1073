"""TeraPipe's :class:`~ds_mp.config.registry.ScheduleSpec`: token-sliced pipelining (``schedule``),
its instruction handlers and KV cache per engine (``ds_mp.engine.terapipe``).  The ``"terapipe"``
block validates itself (:meth:`ds_mp.config.schema.TeraPipeConfig.validate`); this spec adds what
the block means together with the layout.  Light on purpose: config validation imports it."""
from __future__ import annotations

from ds_mp.config.registry import ALL_FAMILIES, ScheduleSpec
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel


class TeraPipeSpec(ScheduleSpec):
    """With sequence parallelism every token slice is split over the TP ranks."""

    def check(self, cfg: DsMpConfig, shape: InlineModel) -> None:
        tp, tera = cfg.tensor_parallel, cfg.terapipe
        if not (tp.sequence_parallel and tp.size > 1):
            return
        if isinstance(tera.slices, list) and any(n % tp.size for n in tera.slices):
            raise ConfigError(f"ds_mp.terapipe.slices: {tera.slices} with sequence parallelism: every "
                              f"slice is split over the {tp.size} TP ranks; make each a multiple of {tp.size}")
        if tera.slices == "auto" and tera.granularity % tp.size:
            raise ConfigError(f"ds_mp.terapipe.granularity: {tera.granularity} with sequence parallelism: "
                              f"planned slices are split over {tp.size} TP ranks; use a multiple of {tp.size}")


TERAPIPE = TeraPipeSpec(timetable="ds_mp.schedules.terapipe.schedule:TeraPipeSchedule",
                        runtime="ds_mp.engine.terapipe:attach", families=ALL_FAMILIES, batch_ramp=True,
                        token_slices=True,
                        context_parallel=("ds_mp.context_parallel: not supported with the terapipe schedule (its token "
                                          "slices and key/value cache split the sequence along the pipeline "
                                          "already); use 1f1b, gpipe, zb-h1, zb-v or interleaved"),
                        carry=("output_router_logits: the MoE aux loss pools each micro-batch's router statistics over "
                               "whole sequences, which the terapipe schedule's token slices do not see; use another "
                               "pipeline.schedule or set output_router_logits to false"))
