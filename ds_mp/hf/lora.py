"""PEFT's LoRA under ds_mp.hf: a ``LoraConfig`` as ``ds_mp.lora``, and the adapter in and out.

A ``PeftModel`` passed as ``model`` (or built from ``peft_config`` by ``SFTTrainer``) trains its LoRA
factors exactly as PEFT would: ``ds_mp.lora`` is set from its ``LoraConfig`` (:func:`lora_block`),
the engine reads the factors from the model, freezes every other weight, and ``save_model()``
writes PEFT's adapter directory (:func:`save_adapter`).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from ds_mp.config import ConfigError
from ds_mp.engine_view import EngineView


def lora_block(peft_config: Any) -> dict:
    """``ds_mp.lora`` for a PEFT ``LoraConfig``, or a one-line refusal naming the field."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config: {type(peft_config).__name__} is not supported by ds_mp (LoRA only); pass a "
                          "peft.LoraConfig")
    targets, params = peft_config.target_modules, getattr(peft_config, "target_parameters", None) or []
    if targets is None and params:
        targets = []  # PEFT allows the fused parameters alone
    bad = [
        (not isinstance(targets, (list, set, tuple)), f"target_modules={targets!r}: name the modules as a list "
         "(e.g. ['q_proj', 'v_proj'])"),
        (not isinstance(params, (list, set, tuple)), f"target_parameters={params!r}: name the parameters as a list "
         "(e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])"),
        (params and peft_config.lora_dropout, f"lora_dropout={peft_config.lora_dropout} with target_parameters: "
         "PEFT's ParamWrapper folds the update into the weight and cannot drop its input; set lora_dropout=0"),
        (peft_config.use_dora, "use_dora=True: ds_mp's LoRA has no DoRA magnitude; set use_dora=False"),
        (peft_config.use_rslora, "use_rslora=True: ds_mp scales by lora_alpha / r; set use_rslora=False"),
        (peft_config.bias != "none", f"bias={peft_config.bias!r}: ds_mp's LoRA trains the factors only; set "
         "bias='none'"),
        (peft_config.modules_to_save, f"modules_to_save={peft_config.modules_to_save!r}: not trained by ds_mp's "
         "LoRA; remove it"),
        (params and (peft_config.rank_pattern or peft_config.alpha_pattern),
         f"rank_pattern={dict(peft_config.rank_pattern)!r}: PEFT gives the fused expert tensors their own rank where "
         "it turns target_modules gate_proj/up_proj/down_proj of a mixture of experts into target_parameters; "
         "ds_mp's LoRA has one r: name the experts yourself, e.g. LoraConfig(target_modules=['q_proj', 'k_proj', "
         "'v_proj', 'o_proj'], target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])"),
        (peft_config.rank_pattern or peft_config.alpha_pattern, "rank_pattern/alpha_pattern: ds_mp's LoRA has one "
         "r and alpha; remove them"),
        (peft_config.layers_to_transform is not None, "layers_to_transform: ds_mp adapts every layer; remove it"),
    ]
    msg = next((m for b, m in bad if b), None)
    if msg:
        raise ConfigError(f"peft_config: {msg}")
    block = {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": float(peft_config.lora_dropout),
             "target_modules": sorted(targets)}
    return {**block, "target_parameters": sorted(params)} if params else block


def is_peft_model(model: Any) -> bool:
    """True for a PEFT ``PeftModel`` (an HF model with ``peft_config`` and ``get_base_model``)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def set_lora_from_peft(model: Any, args: Any) -> None:
    """Set ``ds_mp.lora`` in ``args``' DeepSpeed JSON from the ``LoraConfig`` of the PeftModel
    ``model`` (one adapter), refusing a JSON that asks for another LoRA."""
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ConfigError(f"model: a PeftModel with {len(configs)} adapters ({', '.join(configs)}); ds_mp trains one "
                          "LoRA adapter: delete the others (model.delete_adapter)")
    block = lora_block(next(iter(configs.values())))
    if args is None or getattr(args, "hf_deepspeed_config", None) is None:
        raise ConfigError("TrainingArguments.deepspeed: ds_mp.hf needs a DeepSpeed JSON (path or dict) with a "
                          "\"ds_mp\" block; pass deepspeed=... (e.g. ds_configs/trainer_tp2_pp2.json)")
    raw = args.hf_deepspeed_config.config.setdefault("ds_mp", {})
    if raw.get("lora") not in (None, {}, block):
        raise ConfigError(f"ds_mp.lora={raw['lora']!r} in the DeepSpeed JSON but the PEFT model's LoraConfig gives "
                          f"{block}; remove one")
    raw["lora"] = block


def peft_model(model: Any, args: Any, peft_config: Any) -> Any:
    """The PEFT model TRL's SFT / DPO trainers build from ``peft_config``: a model given by name or
    path loaded as TRL loads it (``from_pretrained`` with ``args.model_init_kwargs``), then
    ``get_peft_model`` seeded by ``args.seed`` as TRL seeds it (same initial factors); the mixin sets
    ``ds_mp.lora`` from its config.  What ds_mp's LoRA does not compute is refused first."""
    from peft import get_peft_model
    from transformers import set_seed

    from ds_mp.hub import resolve_model

    if args is None or getattr(args, "hf_deepspeed_config", None) is None:
        raise ConfigError("TrainingArguments.deepspeed: ds_mp.hf needs a DeepSpeed JSON (path or dict) with a "
                          "\"ds_mp\" block; pass deepspeed=... (e.g. ds_configs/trainer_tp2_pp2.json)")
    if is_peft_model(model):
        raise ConfigError("peft_config: the model is a PeftModel already; pass it without peft_config (its "
                          "adapter trains) or pass the base model with peft_config")
    lora_block(peft_config)  # refuse what ds_mp's LoRA does not compute before loading anything
    set_seed(args.seed)  # as TRL's trainers do before loading the model and get_peft_model
    if isinstance(model, str):
        from trl.trainer.utils import create_model_from_path

        kwargs = {**(args.model_init_kwargs or {}), "device_map": None}  # TRL's under DeepSpeed
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        model = create_model_from_path(resolve_model(model), **kwargs)
    return get_peft_model(model, peft_config)


def save_adapter(engine: EngineView, model: Any, tensors: dict[str, torch.Tensor], out: str) -> None:
    """Rank 0's part of ``save_model`` for a LoRA run: ``adapter_config.json`` +
    ``adapter_model.safetensors`` (PEFT's names and orientation) in ``out``, beside what it holds."""
    from safetensors.torch import save_file

    from ds_mp.checkpoint.lora import adapter_config, peft_adapter_tensors

    base = (getattr(model.get_base_model().config, "_name_or_path", None) or None) if is_peft_model(model) else None
    os.makedirs(out, exist_ok=True)
    save_file(peft_adapter_tensors(tensors, engine.hf_config), os.path.join(out, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(engine.ds_mp_config.lora, base, engine.module.family.fan_in_fan_out), f, indent=2)


def load_adapter(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Write the trained LoRA factors of ``tensors`` (ds_mp's full state dict) into the PeftModel."""
    from peft import set_peft_model_state_dict

    from ds_mp.checkpoint.lora import peft_adapter_tensors

    adapter = {k: v.to(next(model.parameters()).device)
               for k, v in peft_adapter_tensors(tensors, model.get_base_model().config).items()}
    result = set_peft_model_state_dict(model, adapter)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"model: the trained adapter has tensors the PeftModel lacks ({result.unexpected_keys[:3]})")


__all__ = ["lora_block", "is_peft_model", "peft_model", "set_lora_from_peft", "save_adapter", "load_adapter"]
