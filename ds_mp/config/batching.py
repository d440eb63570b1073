"""The checks of a changing global batch: ``ds_mp.batch_ramp`` (sizes this layout can take, the
policy, the schedules it is tested with) and the gradient-noise-scale measurement it and
``training.noise_scale_interval`` rely on."""
from __future__ import annotations

import difflib

from ds_mp.config.registry import names_where, schedule_spec
from ds_mp.config.schema import ConfigError, DsMpConfig, positive


def check_noise_scale(raw: dict, cfg: DsMpConfig, key: str, instead: str) -> None:
    """B_simple compares each replica's gradient before DeepSpeed's DP reduction with the reduced one."""
    if cfg.dp < 2:  # no pair to compare: the probe would never measure and the column stay empty
        raise ConfigError(f"{key}: the noise scale compares each DP replica's gradient with the all-reduced one, so "
                          f"it needs DP >= 2 (this layout has DP = 1) and would never be measured; {instead}, or launch "
                          "more ranks or lower tensor_parallel.size/pipeline.stages")
    stage = (raw.get("zero_optimization") or {}).get("stage", 0) or 0
    measurable = schedule_spec(cfg.pipeline.schedule).noise_scale  # its gradients go through DP reduction
    if (raw.get("fp16") or {}).get("enabled") or not measurable or stage >= 2:
        raise ConfigError(f"{key}: the noise scale is measured in fp32 or bf16 at ZeRO 0/1 around the pipeline engine's "
                          "DP reduction (not on fp16's scaled gradients; not with ouroboros, which assembles gradients "
                          "by hand; not at ZeRO-2, which reduces during the backward); " + instead)


def ramp_micro_multiple(cfg: DsMpConfig) -> int:
    """The number of micro-batches per step a batch ramp's sizes must be a multiple of (per DP
    rank): the schedule's spec says (interleaved: the pipeline stages, its order walks the ring in
    groups of that many; else 1)."""
    return schedule_spec(cfg.pipeline.schedule).micro_multiple(cfg)


def check_batch_ramp(raw: dict, cfg: DsMpConfig) -> None:
    """``ds_mp.batch_ramp``: sizes this layout can take (multiples of micro-batch × DP), a known
    policy and LR scaling, and the noise-scale policy only where B_simple can be measured."""
    br, key = cfg.batch_ramp, "ds_mp.batch_ramp"
    if not br.policy:
        if br.start or br.max or br.ramp_samples:
            raise ConfigError(f"{key}.policy: empty (ramp off) but start/max/ramp_samples are set; "
                              "set policy to 'linear' or 'noise_scale', or remove the block")
        return
    if br.policy not in ("linear", "noise_scale"):
        close = difflib.get_close_matches(br.policy, ["linear", "noise_scale"], n=1)
        raise ConfigError(f"{key}.policy: unknown policy {br.policy!r}; use 'linear' or 'noise_scale'"
                          + (f" (did you mean '{close[0]}'?)" if close else ""))
    if br.lr_scaling not in ("none", "sqrt", "linear"):
        raise ConfigError(f"{key}.lr_scaling: {br.lr_scaling!r} is not 'none', 'sqrt' or 'linear'")
    for name in ("start", "max", "interval"):
        positive(getattr(br, name), f"batch_ramp.{name}")
    if br.start > br.max:
        raise ConfigError(f"{key}.start: {br.start} > max={br.max}; the batch only grows: make start <= max")
    micro = raw.get("train_micro_batch_size_per_gpu", 1)
    spec = schedule_spec(cfg.pipeline.schedule)
    per_step = spec.micro_multiple(cfg)
    unit = micro * cfg.dp * per_step
    ring = f" × {spec.micro_multiple_reason(cfg)}" if per_step > 1 else ""
    for name in ("start", "max"):
        v = getattr(br, name)
        if v % unit:
            lo, hi = max(unit, v // unit * unit), (v // unit + 1) * unit
            raise ConfigError(f"{key}.{name}: {v} samples is no size this layout can take: a step is a whole number of "
                              f"micro-batches on every DP rank, multiples of train_micro_batch_size_per_gpu ({micro}) "
                              f"× DP ({cfg.dp}){ring} = {unit}; use {lo} or {hi}")
    zero = raw.get("zero_optimization") or {}
    if zero.get("cpu_offload") or (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
        raise ConfigError(f"{key}: not with zero_optimization.offload_optimizer: DeepSpeed's ZeRO optimizer stores "
                          "gradient_accumulation_steps when it is built and branches on it in its CPU-offload path, "
                          "so a batch change would leave it on the old branch; remove offload_optimizer or the ramp")
    tested = spec.batch_ramp  # True, False (untested) or the refusal
    if br.policy == "linear":
        positive(br.ramp_samples, "batch_ramp.ramp_samples")
    elif cfg.dp < 2:
        raise ConfigError(f"{key}.policy: 'noise_scale' measures B_simple from the per-replica vs all-reduced "
                          "gradient, which needs DP >= 2 (this layout has DP = 1); launch more ranks or lower "
                          "tensor_parallel.size/pipeline.stages, or use policy 'linear'")
    elif not isinstance(tested, str):  # (a refused schedule says why below)
        check_noise_scale(raw, cfg, f"{key}.policy", "use policy 'linear'")
    if isinstance(tested, str):
        raise ConfigError(tested)
    if tested is not True:
        ramped = names_where(lambda other: other.batch_ramp is True)
        raise ConfigError(f"{key}: tested with the {', '.join(ramped)} schedules (a batch change gives the "
                          f"schedule more micro-batches per step), not with {cfg.pipeline.schedule!r}; use one of "
                          "those or a fixed batch")
