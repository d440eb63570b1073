"""Every check of the ``"ds_mp"`` block that needs more than its types: the world size, the
model's shape and family, the DeepSpeed JSON beside it.  :func:`load_config` is the entry
point; it runs on every rank before any collective, so a bad config fails everywhere with
the same single line naming the key and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from typing import Callable

from ds_mp.config.batching import check_batch_ramp, check_noise_scale
from ds_mp.config.context import check_context_parallel
from ds_mp.config.families import FAMILIES, family_for
from ds_mp.config.registry import SCHEDULES, names_where, schedule_spec
from ds_mp.config.losses import LOSSES, configured_loss
from ds_mp.config.resolve import resolve_model_source, shape_of
from ds_mp.config.schema import MODEL_TYPES, ConfigError, DsMpConfig, InlineModel, parse_config, positive


def _model_shape(cfg: DsMpConfig) -> tuple[InlineModel, dict]:
    """The model's shape and HF config dict: a resolved directory's or model object's
    (:func:`resolve_model_source`), or an inline shape's own (its family's ``config.json`` keys,
    ``Family.inline_hf``, for the family checks)."""
    if cfg.model_source:
        return shape_of(cfg.hf_config, cfg.model_source), cfg.hf_config
    if not isinstance(cfg.model, InlineModel):
        raise ConfigError(f"ds_mp.model: {cfg.model!r} is not resolved; call ds_mp.config.resolve_model_source(cfg) "
                          "before validate (load_config does both)")
    m = cfg.model
    if m.model_type not in MODEL_TYPES:
        raise ConfigError(f"ds_mp.model.model_type: {m.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    family = family_for(m.model_type)
    family.check_inline(m)
    return m, family.inline_hf(m) or cfg.hf_config


def check_model_family(cfg: DsMpConfig) -> None:
    """What the model's family supports: the schedules whose spec lists its ``model_type`` (tested
    against HF or, for Ouroboros, against its reference over HF's modules), then the family's own
    checks of the run (``Family.check_run``: e.g. an MLP width TP splits evenly, LoRA on k_proj/v_proj
    only where TP divides the key/value heads, HF options its layers do not build)."""
    kind = cfg.hf_config.get("model_type", "gpt2")
    if kind not in schedule_spec(cfg.pipeline.schedule).families:
        tested = names_where(lambda spec: kind in spec.families)
        raise ConfigError(f"ds_mp.pipeline.schedule: {cfg.pipeline.schedule!r} is not tested with {kind} models; "
                          f"use one of {', '.join(tested)}")
    family_for(kind).check_run(cfg)


# --- the checks of validate(), in the order they run -------------------------------------------------
def check_degrees_and_counts(cfg: DsMpConfig) -> None:
    """Sizes that must be >= 1 and counts/intervals that must be >= 0."""
    tp, pp = cfg.tensor_parallel, cfg.pipeline
    for key, v in (("tensor_parallel.size", tp.size), ("pipeline.stages", pp.stages),
                   ("tensor_parallel.vocab_pad_multiple", tp.vocab_pad_multiple),
                   ("data.seq_len", cfg.data.seq_len), ("training.steps", cfg.training.steps),
                   ("training.log_interval", cfg.training.log_interval),
                   ("terapipe.granularity", cfg.terapipe.granularity)):
        positive(v, key)
    for key, v in (("training.eval_interval", cfg.training.eval_interval),
                   ("training.checkpoint_interval", cfg.training.checkpoint_interval),
                   ("training.eval_batches", cfg.training.eval_batches),
                   ("training.noise_scale_interval", cfg.training.noise_scale_interval),
                   ("training.keep_last", cfg.training.keep_last),
                   ("pipeline.activation_checkpoint_interval", pp.activation_checkpoint_interval)):
        if v < 0:
            raise ConfigError(f"ds_mp.{key}: must be >= 0, got {v}")


def check_run_length(cfg: DsMpConfig) -> None:
    """``training.epochs`` (not with a batch ramp deciding its batches) and ``training.trace_steps``."""
    if not 0 <= cfg.training.epochs < math.inf:
        raise ConfigError(f"ds_mp.training.epochs: must be a number >= 0 (0 = use training.steps), got "
                          f"{cfg.training.epochs!r}")
    if cfg.training.epochs and cfg.batch_ramp.policy == "noise_scale":
        raise ConfigError("ds_mp.training.epochs: the noise_scale batch ramp decides its batches while training, so "
                          "the steps of an epoch are not known up front; set training.steps instead of epochs")
    ts = cfg.training.trace_steps
    if ts and (len(ts) != 2 or any(isinstance(n, bool) or not isinstance(n, int) for n in ts)
               or not 1 <= ts[0] <= ts[1] <= cfg.training.steps):
        raise ConfigError(f"ds_mp.training.trace_steps: {ts} must be [first, last] steps with 1 <= first <= last <= "
                          f"training.steps={cfg.training.steps} (e.g. [10, 12]), or [] for no trace")


def check_choices(cfg: DsMpConfig) -> None:
    """The keys that take one of a few words."""
    if cfg.data.overlong not in ("truncate", "drop"):
        raise ConfigError(f"ds_mp.data.overlong: must be 'truncate' or 'drop', got {cfg.data.overlong!r}")
    if cfg.loss.normalization not in ("tokens", "micro_batch"):
        raise ConfigError(f"ds_mp.loss.normalization: must be 'tokens' or 'micro_batch', got {cfg.loss.normalization!r}")
    if cfg.training.on_nan not in ("stop", "skip"):
        raise ConfigError(f"ds_mp.training.on_nan: must be 'stop' or 'skip', got {cfg.training.on_nan!r}")
    if cfg.training.max_consecutive_skips < 0:
        raise ConfigError(f"ds_mp.training.max_consecutive_skips: must be >= 0 (0 = no limit), got "
                          f"{cfg.training.max_consecutive_skips}")


def check_loss(cfg: DsMpConfig) -> None:
    """``loss.type`` is registered (a close name suggested), its options are the spec's, then the
    spec's own checks."""
    name = cfg.loss.type
    if name not in LOSSES:
        close = difflib.get_close_matches(str(name), list(LOSSES), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"ds_mp.loss.type: unknown loss {name!r}; registered: {', '.join(sorted(LOSSES))}{hint} "
                          "(ds_mp.config.losses.register_loss adds one)")
    configured_loss(cfg.loss).check(cfg)


def check_schedule_name(cfg: DsMpConfig) -> None:
    """``pipeline.schedule`` is registered (a close name suggested)."""
    name = cfg.pipeline.schedule
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, list(SCHEDULES), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"ds_mp.pipeline.schedule: unknown schedule {name!r}; "
                          f"registered: {', '.join(sorted(SCHEDULES))}{hint}")


def check_shape(cfg: DsMpConfig, shape: InlineModel) -> None:
    """The model's shape, and what TP and the sequence length ask of it."""
    tp = cfg.tensor_parallel
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        positive(getattr(shape, key), f"model.{key}")
    family_for(cfg.hf_config.get("model_type", "gpt2")).check_shape(shape, cfg.hf_config)
    if not 0.0 <= shape.dropout < 1.0:
        raise ConfigError(f"ds_mp.model.dropout: must be in [0, 1), got {shape.dropout}")
    if shape.n_head % tp.size:
        raise ConfigError(f"ds_mp.tensor_parallel.size: {tp.size} does not divide n_head="
                          f"{shape.n_head}; use a divisor of {shape.n_head}")
    if tp.sequence_parallel and tp.size > 1 and cfg.data.seq_len % tp.size:
        raise ConfigError(f"ds_mp.tensor_parallel.sequence_parallel: data.seq_len={cfg.data.seq_len} is not "
                          f"divisible by tensor_parallel.size={tp.size}; pick a multiple of {tp.size}")
    if cfg.data.seq_len > shape.n_positions:
        raise ConfigError(f"ds_mp.data.seq_len: {cfg.data.seq_len} exceeds the model's "
                          f"n_positions={shape.n_positions}; lower seq_len")


def check_stage_layout(cfg: DsMpConfig, shape: InlineModel) -> None:
    """The schedule's placement of stages (its spec), then ``pipeline.partition`` over the
    stages × virtual_stages chunks it cuts."""
    pp = cfg.pipeline
    schedule_spec(pp.schedule).check_layout(cfg, shape)
    chunks = pp.stages * pp.virtual_stages  # interleaved: the partition cuts stages × virtual_stages chunks
    if isinstance(pp.partition, list):
        if len(pp.partition) != chunks or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in pp.partition):
            per = "stage chunk" if chunks > pp.stages else "stage"
            raise ConfigError(f"ds_mp.pipeline.partition: expected {chunks} non-negative "
                              f"integers (blocks per {per}), got {pp.partition}")
        if sum(pp.partition) != shape.n_layer:
            raise ConfigError(f"ds_mp.pipeline.partition: {pp.partition} sums to "
                              f"{sum(pp.partition)} but the model has {shape.n_layer} blocks; "
                              f"make them sum to {shape.n_layer}")
        empty = [s for s, n in enumerate(pp.partition) if n == 0 and 0 < s < chunks - 1]
        if empty:  # first/last stages hold the embedding/head; a middle one would hold nothing
            raise ConfigError(f"ds_mp.pipeline.partition: middle stage {empty[0]} of {pp.partition} "
                              "has no blocks and no parameters; give every middle stage at least 1 block")
    elif pp.partition not in ("uniform", "parameters", "cost"):
        raise ConfigError(f"ds_mp.pipeline.partition: {pp.partition!r} is not 'uniform', 'parameters', "
                          "'cost' or a list of blocks per stage")


def check_virtual_stages(cfg: DsMpConfig, shape: InlineModel) -> None:
    """``pipeline.virtual_stages`` > 1 only for a schedule whose spec takes chunks per stage."""
    pp, v = cfg.pipeline, cfg.pipeline.virtual_stages
    positive(v, "pipeline.virtual_stages")
    if v != 1 and not schedule_spec(pp.schedule).virtual_stages:
        chunked = names_where(lambda spec: spec.virtual_stages)
        raise ConfigError(f"ds_mp.pipeline.virtual_stages: {v} chunks per stage need schedule "
                          f"{' or '.join(map(repr, chunked))}, not {pp.schedule!r}; set it to 1 or pick the "
                          f"{' or '.join(chunked)} schedule")


def check_zb_max_pending_w(cfg: DsMpConfig, shape: InlineModel) -> None:
    """``pipeline.zb_max_pending_w``: 'auto', 'paper' or a count."""
    n = cfg.pipeline.zb_max_pending_w
    if n not in ("auto", "paper") and not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        raise ConfigError(f"ds_mp.pipeline.zb_max_pending_w: {n!r}; use 'auto', 'paper' or an int >= 0 "
                          "(W passes a zb-h1 stage may defer)")


def check_lora(cfg: DsMpConfig, shape: InlineModel) -> None:
    """The ``lora`` block: rank, scale, dropout, the family's target names; not with sequence
    parallelism, nor with a schedule whose spec refuses it."""
    lo = cfg.lora
    if lo.r < 0:
        raise ConfigError(f"ds_mp.lora.r: must be >= 0 (0 = off), got {lo.r}")
    if not lo.r:
        return
    if lo.alpha <= 0:
        raise ConfigError(f"ds_mp.lora.alpha: must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"ds_mp.lora.dropout: must be in [0, 1), got {lo.dropout}")
    kind = cfg.hf_config.get("model_type", "gpt2")
    targets, params = MODEL_TYPES[kind], FAMILIES[kind].lora_parameters
    bad = [t for t in lo.target_modules if t not in targets]
    if (not lo.target_modules and not lo.target_parameters) or bad:
        raise ConfigError(f"ds_mp.lora.target_modules: {bad or lo.target_modules} not {kind} linear names; "
                          f"choose from {', '.join(targets)}")
    bad = [t for t in lo.target_parameters if t not in params]
    if bad:
        raise ConfigError(f"ds_mp.lora.target_parameters: {bad} not {kind} fused parameter names; "
                          + (f"choose from {', '.join(params)}" if params else "it has none (use target_modules)"))
    if lo.target_parameters and lo.dropout:
        raise ConfigError(f"ds_mp.lora.dropout: {lo.dropout} with target_parameters (the experts' update is "
                          "folded into W_e, as PEFT's ParamWrapper, which refuses dropout too); set dropout to 0")
    if cfg.tensor_parallel.sequence_parallel and cfg.tp > 1:
        raise ConfigError("ds_mp.lora: not supported with tensor_parallel.sequence_parallel (the replicated LoRA "
                          "factors would see only a slice of tokens); set sequence_parallel to false")
    refusal = schedule_spec(cfg.pipeline.schedule).lora
    if isinstance(refusal, str):
        raise ConfigError(refusal)


def check_world_size(cfg: DsMpConfig, world_size: int) -> None:
    """World size = TP × PP × CP × DP (Ouroboros' PP is its K − 1 ring ranks)."""
    tp, pp, cp = cfg.tensor_parallel, cfg.pipeline, cfg.context_parallel
    model_ranks = tp.size * pp.stages * cp.size
    if world_size % model_ranks:
        with_cp = f" × context_parallel.size ({cp.size})" if cp.size > 1 else ""
        raise ConfigError(f"ds_mp: world size {world_size} is not divisible by tensor_parallel.size "
                          f"({tp.size}) × pipeline.stages ({pp.stages}){with_cp} = {model_ranks}; launch a "
                          f"multiple of {model_ranks} ranks or change the degrees")


def check_schedule_options(cfg: DsMpConfig, shape: InlineModel) -> None:
    """The schedule's own checks (its spec's ``check``)."""
    schedule_spec(cfg.pipeline.schedule).check(cfg, shape)


def check_terapipe_block(cfg: DsMpConfig, shape: InlineModel) -> None:
    """The ``terapipe`` block's own values, whatever the schedule (the block validates itself)."""
    cfg.terapipe.validate(cfg.data.seq_len)


def check_router_aux(cfg: DsMpConfig, shape: InlineModel) -> None:
    """A MoE model with ``output_router_logits`` (HF's aux loss, pooled over every layer: its statistics
    travel with the hidden state, ``ds_mp.models.carry``): a schedule that passes no carry, and sequence
    parallelism and context parallelism (each rank would pool its own tokens' statistics) and a loss other
    than the LM loss and the DPO loss with ``normalization: "micro_batch"`` (TRL's DPOTrainer: each
    micro-batch's pair mean plus ``coef · aux``, averaged; no other loss's aux term is built) are refused."""
    hf = cfg.hf_config or {}
    if not (hf.get("output_router_logits") and (hf.get("num_experts") or hf.get("num_local_experts"))):
        return
    refusal = schedule_spec(cfg.pipeline.schedule).carry
    if isinstance(refusal, str):
        raise ConfigError(refusal)
    if cfg.tensor_parallel.sequence_parallel and cfg.tensor_parallel.size > 1:
        raise ConfigError("ds_mp.tensor_parallel.sequence_parallel: the MoE aux loss (output_router_logits) pools "
                          "router statistics over every token, which sequence parallelism splits over TP; set "
                          "sequence_parallel to false")
    if cfg.context_parallel.size > 1:
        raise ConfigError("ds_mp.context_parallel: the MoE aux loss (output_router_logits) pools router statistics "
                          "over every token of a row, which context parallelism splits over its ranks; set "
                          "output_router_logits to false or context_parallel.size to 1")
    if cfg.loss.type not in ("lm", "dpo"):
        raise ConfigError(f"ds_mp.loss.type: the MoE aux loss (output_router_logits) is added to the 'lm' and 'dpo' "
                          f"losses only, not to the {cfg.loss.type!r} loss; set output_router_logits to false")
    if cfg.loss.type == "dpo" and cfg.loss.normalization != "micro_batch":
        raise ConfigError("ds_mp.loss.normalization: the MoE aux loss (output_router_logits) is added to the 'dpo' "
                          "loss as TRL adds it, per micro-batch: set normalization to \"micro_batch\" (TRL's) or "
                          "output_router_logits to false")


def check_family(cfg: DsMpConfig, shape: InlineModel) -> None:
    """:func:`check_model_family`."""
    check_model_family(cfg)


BLOCK_CHECKS: tuple[Callable[[DsMpConfig], None], ...] = (
    check_degrees_and_counts, check_run_length, check_choices, check_schedule_name, check_loss)
SHAPE_CHECKS: tuple[Callable[[DsMpConfig, InlineModel], None], ...] = (
    check_shape, check_stage_layout, check_virtual_stages, check_schedule_options, check_terapipe_block,
    check_zb_max_pending_w, check_lora, check_family, check_context_parallel,
    check_router_aux)


def validate(cfg: DsMpConfig, world_size: int) -> DsMpConfig:
    """``cfg`` checked against itself and ``world_size``: :data:`BLOCK_CHECKS`, then
    :func:`validate_model`.  Pure (reads no file, environment or network): a model directory or
    Hub id must be resolved first (:func:`resolve_model_source`)."""
    for check in BLOCK_CHECKS:
        check(cfg)
    return validate_model(cfg, world_size)


def validate_model(cfg: DsMpConfig, world_size: int) -> DsMpConfig:
    """The checks that need the model's shape (:data:`SHAPE_CHECKS`, the schedule's own through its
    spec) and the world size, on a block that passed :data:`BLOCK_CHECKS`; returns a copy with
    ``world_size``, ``dp``, ``shape`` and ``hf_config`` filled (``cfg`` itself is not changed)."""
    shape, hf = _model_shape(cfg)
    cfg = dataclasses.replace(cfg, hf_config=hf)  # the family checks read it
    for shape_check in SHAPE_CHECKS:
        shape_check(cfg, shape)
    check_world_size(cfg, world_size)
    model_ranks = cfg.tp * cfg.pp * cfg.cp  # dp: the ranks that read distinct rows
    return dataclasses.replace(cfg, world_size=world_size, dp=world_size // model_ranks, shape=shape)


def read_json(config: str | dict) -> dict:
    """The whole DeepSpeed JSON as a dict (a path or an already-parsed dict)."""
    if isinstance(config, dict):
        return config
    try:
        with open(config) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: file {config!r} not found; pass --deepspeed_config PATH") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config: {config} is not valid JSON (line {e.lineno}, column "
                          f"{e.colno}: {e.msg}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {config} must hold a JSON object at the top level")
    return raw


def _check_combination(raw: dict, cfg: DsMpConfig) -> None:
    """Refuse the precision × optimizer-wrapper combinations that cannot run (one line each;
    see README "What combines with what").

    * ZeRO stage 3: every ds_mp layout (also TP-only) runs on DeepSpeed's PipelineEngine, which
      cannot gather partitioned weights per layer.  Stage 2 runs (ds_mp drives its gradient
      reduction: ds_mp/engine/zero2.py).
    * fp16 where DeepSpeed's accelerator has no fp16 (the CPU here): DeepSpeed would refuse
      it only after the process groups exist.
    """
    stage = (raw.get("zero_optimization") or {}).get("stage", 0)
    if not isinstance(stage, bool) and isinstance(stage, int) and stage >= 3:
        raise ConfigError(f"zero_optimization.stage: {stage}, but ds_mp runs on DeepSpeed's PipelineEngine, "
                          "which cannot partition the weights (ZeRO-3); set it to 2 (gradients and optimizer "
                          "state partitioned) or 1")
    if (raw.get("fp16") or {}).get("enabled"):
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if not acc.is_fp16_supported():
            raise ConfigError(f"fp16.enabled: DeepSpeed's {acc.device_name()!r} accelerator has no fp16 "
                              "support on this machine; use bf16 or fp32")


DEEPSPEED_CLIPPING_DEFAULT = 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT (runtime/constants.py), tested equal


def _warn_default_clipping(raw: dict) -> None:
    """DeepSpeed clips the global gradient norm at 1.0 when ``gradient_clipping`` is absent: say so
    once per process (rank 0), since a user comparing with an unclipped loop sees smaller updates."""
    if "gradient_clipping" not in raw and os.environ.get("RANK", "0") == "0":
        warnings.warn(f"gradient_clipping: absent, so DeepSpeed's default {DEEPSPEED_CLIPPING_DEFAULT} applies (the "
                      "global gradient norm is clipped to it); set \"gradient_clipping\" in the JSON (0.0 = no "
                      "clipping) to silence this", UserWarning, stacklevel=4)


def load_config(config: str | dict, world_size: int, hf_config: dict | None = None) -> tuple[DsMpConfig, dict]:
    """The validated ds_mp block and the full DeepSpeed dict (with ``ds_mp`` kept): the JSON read and
    typed once, its own checks, then the one step that reads outside it (:func:`resolve_model_source`:
    a Hub id or directory -> its ``config.json``; ``hf_config``: a model object's instead), then the
    checks against the model and ``world_size`` (given: nothing here reads the environment), then
    DeepSpeed's blocks beside it.  The dict passed in is not changed."""
    raw = read_json(config)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        v = raw.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key}: must be a positive integer, got {v!r}")
    cfg = parse_config(raw.get("ds_mp", {}))
    for check in BLOCK_CHECKS:  # before the model is read: the errors come in the order they always did
        check(cfg)
    cfg = validate_model(resolve_model_source(cfg, hf_config), world_size)
    check_deepspeed_blocks(raw, cfg)
    return cfg, raw


def check_deepspeed_blocks(raw: dict, cfg: DsMpConfig) -> None:
    """The DeepSpeed JSON beside a validated block: precision × ZeRO, the schedule's own refusals
    (its spec's ``check_deepspeed``), the noise scale and batch ramp against the batch keys; warns
    once when DeepSpeed's default clipping applies."""
    _check_combination(raw, cfg)
    schedule_spec(cfg.pipeline.schedule).check_deepspeed(raw, cfg)
    if cfg.training.noise_scale_interval:  # measured on fp32/bf16 gradients around DeepSpeed's DP reduction
        check_noise_scale(raw, cfg, "ds_mp.training.noise_scale_interval", "set it to 0")
    check_batch_ramp(raw, cfg)
    _warn_default_clipping(raw)
