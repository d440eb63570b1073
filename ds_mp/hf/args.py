"""``TrainingArguments`` → the DeepSpeed JSON ds_mp's engine is built from, or a one-line refusal.

transformers already filled the JSON's ``"auto"`` values from the arguments when the arguments were
built (``HfTrainerDeepSpeedConfig.trainer_config_process``); this module starts from that dict and
maps what the Trainer would otherwise do itself:

    per_device_train_batch_size  -> train_micro_batch_size_per_gpu   (rows of one micro-batch)
    gradient_accumulation_steps  -> gradient_accumulation_steps      (micro-batches per step)
    max_grad_norm                -> gradient_clipping                (ds_mp's global norm over TP × PP)
    optim, learning_rate, weight_decay, adam_beta1/2, adam_epsilon
                                 -> "optimizer" (AdamW torch / SGD), unless the JSON has its own block
    bf16 / fp16                  -> "bf16" / "fp16" enabled
    seed                         -> ds_mp.training.seed
    gradient_checkpointing       -> ds_mp.pipeline.activation_checkpoint_interval = 1
    (TRL) max_length             -> ds_mp.data.seq_len, else the model's positions

``train_batch_size`` is derived by ds_mp (micro × accumulation × DP, not × world); an explicit one in
the JSON must equal that (:func:`check_train_batch_size`).  The LR schedule
(``lr_scheduler_type``, warm-up) is the Trainer's own scheduler, driven by the engine
(:mod:`ds_mp.hf.schedule`).  Everything the engine cannot honour is refused (:func:`refusals`).
"""
from __future__ import annotations

import copy
import os
from typing import Any

from ds_mp.config import ConfigError

#: ``TrainingArguments.optim`` values mapped to a DeepSpeed ``optimizer`` block (torch's own classes).
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # enum members (OptimizerNames, SchedulerType) as their strings


def refusals(args: Any, raw: dict) -> str | None:
    """The first argument ds_mp's engine cannot honour, as one line naming it and what to do."""
    zero = (raw.get("zero_optimization") or {}).get("stage", 0)
    checks = [
        (getattr(args, "fsdp", None), "fsdp: ds_mp shards with TP × PP × DP (the \"ds_mp\" block); remove fsdp"),
        (getattr(args, "fsdp_config", None) and any((args.fsdp_config or {}).get(k) for k in ("fsdp_version",
         "version")), "fsdp_config: FSDP does not apply under ds_mp; remove it"),
        (getattr(args, "torch_compile", False), "torch_compile: not supported by ds_mp's pipeline engine; set "
         "torch_compile=False"),
        (zero == 3, "zero_optimization.stage=3: ds_mp's pipeline engine runs ZeRO stages 0-2; use stage 1 or 2"),
        (raw.get("scheduler"), "scheduler: remove the DeepSpeed JSON's \"scheduler\" block; ds_mp.hf drives the "
         "Trainer's own lr_scheduler_type / warmup_steps"),
        (_value(args.lr_scheduler_type) == "reduce_lr_on_plateau", "lr_scheduler_type=reduce_lr_on_plateau: not "
         "supported by ds_mp.hf; choose a step-based schedule (linear, cosine, constant, ...)"),
        (not raw.get("optimizer") and _value(args.optim) not in OPTIMIZERS,
         f"optim={_value(args.optim)!r}: ds_mp.hf maps {', '.join(OPTIMIZERS)}; set one of them or put an "
         "\"optimizer\" block in the DeepSpeed JSON"),
        (not raw.get("optimizer") and getattr(args, "optim_args", None) and _value(args.optim) != "sgd",
         f"optim_args={args.optim_args!r}: not mapped for {_value(args.optim)!r}; remove it or use an \"optimizer\" "
         "block in the DeepSpeed JSON"),
        (getattr(args, "label_smoothing_factor", 0.0), "label_smoothing_factor: ds_mp's loss is the plain per-token "
         "cross-entropy; set label_smoothing_factor=0"),
        (getattr(args, "neftune_noise_alpha", None) is not None, "neftune_noise_alpha: NEFTune's embedding hook does "
         "not reach ds_mp's parallel embedding; remove it"),
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel: ds_mp has its own fused vocab-parallel loss; "
         "set use_liger_kernel=False"),
        (getattr(args, "auto_find_batch_size", False), "auto_find_batch_size: the pipeline's row shape is fixed; "
         "set per_device_train_batch_size"),
        (getattr(args, "average_tokens_across_devices", True) is False, "average_tokens_across_devices=False: ds_mp's "
         "loss is per target token over the global batch; set average_tokens_across_devices=True"),
        (getattr(args, "parallelism_config", None) is not None, "parallelism_config: ds_mp's layout comes from the "
         "\"ds_mp\" block of the DeepSpeed JSON; remove parallelism_config"),
    ]
    return next((msg for bad, msg in checks if bad), None)


def constructor_refusal(given: dict[str, Any]) -> str | None:
    """The first Trainer constructor argument (``given``: the call bound to the base Trainer's
    signature, by name) that ds_mp's engine cannot honour, as one line naming it."""
    checks = [
        (given.get("model_init"), "model_init: ds_mp.hf needs model= (an HF …ForCausalLM, a directory or a Hub id); "
         "remove model_init"),
        (any(o is not None for o in given.get("optimizers") or ()), "optimizers: ds_mp builds the optimizer and "
         "scheduler from optim / lr_scheduler_type (or the DeepSpeed JSON); remove optimizers="),
        (given.get("optimizer_cls_and_kwargs"), "optimizer_cls_and_kwargs: ds_mp builds the optimizer from optim; "
         "remove it"),
        (given.get("compute_metrics"), "compute_metrics: ds_mp.hf evaluates the per-token loss only; remove "
         "compute_metrics"),
        (given.get("compute_loss_func"), "compute_loss_func: ds_mp's loss is the per-token cross-entropy computed on "
         "the last pipeline stage over vocab-parallel logits; remove compute_loss_func"),
    ]
    return next((msg for bad, msg in checks if bad), None)


def deepspeed_dict(args: Any, hf_config: Any, rows_per_item: int = 1) -> dict:
    """The DeepSpeed JSON (with its ``"ds_mp"`` block) for ``args``; raises :class:`ConfigError`
    with one line on anything the engine cannot honour.  ``hf_config``: the model's HF config
    (its positions give ``ds_mp.data.seq_len`` when neither the JSON nor ``max_length`` does).
    ``rows_per_item``: rows one dataset item becomes (a preference pair: 2, chosen and rejected), so
    a micro-batch is ``per_device_train_batch_size × rows_per_item`` rows."""
    hf_ds = getattr(args, "hf_deepspeed_config", None)
    if hf_ds is None:
        raise ConfigError("TrainingArguments.deepspeed: ds_mp.hf needs a DeepSpeed JSON (path or dict) with a "
                          "\"ds_mp\" block; pass deepspeed=... (e.g. ds_configs/trainer_tp2_pp2.json)")
    raw = copy.deepcopy(hf_ds.config)
    msg = refusals(args, raw)
    if msg:
        raise ConfigError(msg)
    check_train_batch_size(args, raw)
    raw.pop("train_batch_size", None)  # transformers filled "auto" with world × micro × GA; ds_mp derives it
    for key, value, name in (("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
                              "per_device_train_batch_size"),
                             ("gradient_accumulation_steps", args.gradient_accumulation_steps,
                              "gradient_accumulation_steps"),
                             ("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")):
        if raw.get(key, "auto") not in ("auto", value):
            raise ConfigError(f"{key}={raw[key]!r} in the DeepSpeed JSON but {name}={value!r}; make them equal or "
                              f"set \"{key}\": \"auto\"")
        raw[key] = value * rows_per_item if key == "train_micro_batch_size_per_gpu" else value
    if not raw.get("optimizer"):
        raw["optimizer"] = optimizer_block(args)
    for flag, key in ((args.bf16, "bf16"), (args.fp16, "fp16")):
        if flag:
            raw.setdefault(key, {})["enabled"] = True
    block = raw.setdefault("ds_mp", {})
    block.setdefault("training", {}).setdefault("seed", args.seed)
    if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None):
        pipe = block.setdefault("pipeline", {})
        if not pipe.get("activation_checkpoint_interval"):
            pipe["activation_checkpoint_interval"] = 1
    data = block.setdefault("data", {})
    if "seq_len" not in data:
        positions = getattr(hf_config, "n_positions", None) or getattr(hf_config, "max_position_embeddings", None)
        data["seq_len"] = int(getattr(args, "max_length", None) or positions)
    raw.setdefault("steps_per_print", 10**9)  # the Trainer logs; DeepSpeed's own step prints stay quiet
    return raw


def check_train_batch_size(args: Any, raw: dict) -> None:
    """An explicit ``train_batch_size`` in the user's DeepSpeed JSON (``args.deepspeed``, before
    transformers filled its ``"auto"``) must be micro × accumulation × DP, DP = world / (TP × PP) of
    the ``"ds_mp"`` block and world the launcher's ``WORLD_SIZE``: ds_mp's global batch (plain DeepSpeed
    refuses a wrong one as well)."""
    from ds_mp.config import read_json

    given = read_json(args.deepspeed).get("train_batch_size", "auto") if args.deepspeed else "auto"
    if given in ("auto", None):
        return
    block = raw.get("ds_mp") or {}
    model_ranks = int((block.get("tensor_parallel") or {}).get("size", 1)) * int(
        (block.get("pipeline") or {}).get("stages", 1))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's, as check_layout's load_config reads it
    want = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(world // model_ranks, 1)
    if given != want:
        raise ConfigError(f"train_batch_size={given!r} in the DeepSpeed JSON but per_device_train_batch_size "
                          f"({args.per_device_train_batch_size}) × gradient_accumulation_steps "
                          f"({args.gradient_accumulation_steps}) × DP ({max(world // model_ranks, 1)} = world "
                          f"{world} / (TP × PP)) = {want}; set \"train_batch_size\": \"auto\" (or {want})")


def check_layout(args: Any, source: Any, hf_config: Any, rows_per_item: int = 1) -> dict:
    """Everything about the arguments and the layout that can be checked before the Trainer is built
    (no collective, no dataset work: TRL tokenizes and packs in its constructor): :func:`deepspeed_dict`'s
    refusals and ds_mp's own ``load_config`` of the result against the model (``source``: a directory,
    Hub id or model object) and the launcher's world size (heads by TP, layers by PP, the schedule's
    own checks, world divisible by TP × PP; ``rows_per_item`` as :func:`deepspeed_dict`).  Returns the
    DeepSpeed JSON; raises :class:`ConfigError`."""
    from ds_mp.engine.initialize import config_for

    raw = deepspeed_dict(args, hf_config, rows_per_item)
    config_for(source, raw, None, None)
    return raw


def optimizer_block(args: Any) -> dict:
    """The DeepSpeed ``optimizer`` block of ``args.optim`` (torch's AdamW / SGD, as the Trainer builds
    them); weight decay goes to matrices and embeddings only (ds_mp's groups = the Trainer's)."""
    name = _value(args.optim)
    if name == "sgd":
        params = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
        for k, v in (_parse_optim_args(args.optim_args) or {}).items():
            if k not in ("momentum", "dampening", "weight_decay", "nesterov"):
                raise ConfigError(f"optim_args: {k!r} is not an SGD argument; use momentum, dampening, weight_decay "
                                  "or nesterov")
            params[k] = v.lower() in ("true", "1", "yes") if k == "nesterov" else float(v)
        return {"type": "SGD", "params": params}
    params = {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
              "weight_decay": args.weight_decay, "torch_adam": True}
    if name == "adamw_torch_fused":
        params["fused"] = True
    return {"type": "AdamW", "params": params}


def _parse_optim_args(text: str | None) -> dict[str, str]:
    """``"momentum=0.9,nesterov=True"`` → ``{"momentum": "0.9", "nesterov": "True"}`` (the Trainer's format)."""
    if not text:
        return {}
    return dict(kv.split("=", 1) for kv in text.replace(" ", "").split(",") if kv)


__all__ = ["OPTIMIZERS", "check_layout", "check_train_batch_size", "constructor_refusal", "deepspeed_dict", "optimizer_block",
           "refusals"]
