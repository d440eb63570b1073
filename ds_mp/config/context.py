"""The ``context_parallel`` block's checks: one line each, on every rank, before any collective.

Context parallelism (CP) splits each micro-batch's sequence over C ranks (``ds_mp.context_parallel``:
which tokens a rank holds, the two attention implementations).  What it asks of the rest of the
config: a known ``impl``; ``data.seq_len`` cut as the impl's shard layout needs (``check_seq_len``:
2·C equal chunks when the impl balances the causal work, C otherwise), and again by TP under
sequence parallelism (each rank's seq_len/C rows are split over TP); heads the impl can split
(``check_heads``: ulysses splits heads over TP × C); and a schedule whose spec carries it
(``ScheduleSpec.context_parallel``); a loss summed over token positions (``LossSpec.token_sliceable``:
a per-sequence loss needs every token of a row on one rank); no gradient-noise probe (it reads each
replica's gradient before the reduction, a CP rank's is its shard's part).  The world-size arithmetic (TP × PP × CP × DP) is
``ds_mp.config.checks.check_world_size``'s.
"""
from __future__ import annotations

from ds_mp.config.losses import loss_spec
from ds_mp.config.registry import names_where, schedule_spec
from ds_mp.config.schema import ConfigError, DsMpConfig, InlineModel, positive
from ds_mp.context_parallel.rules import IMPLS, balanced_for, check_heads, check_seq_len


def check_context_parallel(cfg: DsMpConfig, shape: InlineModel) -> None:
    """``ds_mp.context_parallel``: size >= 1, a known impl, and what C > 1 asks of seq_len, the heads,
    sequence parallelism and the schedule (module docstring)."""
    cp = cfg.context_parallel
    positive(cp.size, "context_parallel.size")
    if cp.impl not in IMPLS:
        raise ConfigError(f"ds_mp.context_parallel.impl: {cp.impl!r} is unknown; use one of {', '.join(IMPLS)}")
    if cp.size == 1:
        return
    tp = cfg.tensor_parallel
    sp_tp = tp.size if tp.sequence_parallel else 1  # sequence parallelism cuts each shard again by TP
    kv = cfg.hf_config.get("num_key_value_heads") or shape.n_kv_head or shape.n_head
    try:
        check_seq_len(cfg.data.seq_len, cp.size, balanced_for(cp.impl), sp_tp)
    except ValueError as err:
        raise ConfigError(f"ds_mp.data.seq_len: {err}") from None
    try:
        check_heads(shape.n_head, kv, tp.size, cp.size, cp.impl)
    except ValueError as err:
        raise ConfigError(f"ds_mp.context_parallel.impl: {err}") from None
    loss = loss_spec(cfg.loss.type)
    if not loss.token_sliceable:
        raise ConfigError(f"ds_mp.context_parallel: the {loss.name!r} loss needs whole sequences, which a CP rank "
                          "(holding 1/size of each row's tokens) does not see; set context_parallel.size to 1")
    if cfg.training.noise_scale_interval or cfg.batch_ramp.policy == "noise_scale":
        raise ConfigError("ds_mp.training.noise_scale_interval: the gradient noise scale is not measured under context "
                          "parallelism (a CP rank's gradient before the reduction is its shard's part); set "
                          "noise_scale_interval to 0 and no noise_scale batch ramp, or context_parallel.size to 1")
    carried = schedule_spec(cfg.pipeline.schedule).context_parallel
    if isinstance(carried, str):
        raise ConfigError(carried)
    if not carried:
        tested = names_where(lambda spec: spec.context_parallel is True)
        raise ConfigError(f"ds_mp.context_parallel: the {cfg.pipeline.schedule!r} schedule is not tested with "
                          f"context parallelism; use {' or '.join(tested)}, or set context_parallel.size to 1")


__all__ = ["check_context_parallel"]
