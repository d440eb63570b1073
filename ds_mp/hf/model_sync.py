"""The Trainer's model in and out: what the engine reads it from (:func:`model_and_source`), and
``trainer.model`` after training: the engine's trained weights, on every rank.

ds_mp's engine trains its own TP/PP-sharded copy of the model; the HF object the Trainer holds
(``trainer.model``) is written from it after ``train()`` (and so after ``load_best_model_at_end``):
the full state dict is gathered from the engine (:func:`~ds_mp.checkpoint.hf.full_state_dict`, the
fp32 masters), broadcast tensor by tensor and loaded on every rank.  A model on the meta device
(given by name) is replaced by one built from those tensors (``from_pretrained(None, config=…,
state_dict=…)``: the full model in CPU memory on every rank); a ``PeftModel`` gets its adapter.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ds_mp.config import ConfigError
from ds_mp.hf.lora import is_peft_model, load_adapter


def model_and_source(model: Any) -> tuple[Any, Any]:
    """(the model object the Trainer holds, what ds_mp reads the weights from).

    A directory or Hub id → an HF model on the meta device (no weights) and the path: each rank
    reads only its shard.  A model on the meta device → its ``name_or_path``.  A model with
    weights → itself.  A model of no ds_mp family is refused with one line."""
    from ds_mp.models.family import causal_lm_family

    if model is None:
        raise ConfigError("model: ds_mp.hf needs model= (an HF …ForCausalLM, a directory or a Hub id); "
                          "model_init is not supported")
    source = model
    if isinstance(model, str):
        from transformers import AutoConfig, AutoModelForCausalLM

        from ds_mp.hub import resolve_model

        source = resolve_model(model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
        model.config._name_or_path = source
    elif any(p.is_meta for p in model.parameters()):
        source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
        if not source or not os.path.exists(source) and "/" not in source:
            raise ConfigError("model: on the meta device without a name_or_path to read the weights from; pass the "
                              "directory or Hub id as model=")
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:  # ds_mp reads the weights from the path, which does not say what is frozen
            raise ConfigError(f"model: on the meta device with requires_grad=False weights ({frozen[0]}, ...); pass "
                              "the model with its weights (from_pretrained) to keep them frozen")
    try:
        causal_lm_family(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model, source


def broadcast_state(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Collective: global rank 0's ``tensors`` (CPU) on every rank (CPU), one tensor at a time
    through ``device`` (the backend's device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in tensors.items()] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    out = {}
    for name, shape, dtype in meta[0]:
        buf = tensors[name].to(device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=0)
        out[name] = buf.cpu()
    return out


def write_back(model: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``model`` holding ``tensors`` (HF names, full, tied head omitted): loaded in place (its own
    dtype and device), the LoRA factors into a PeftModel, or — on the meta device — a new model of
    its config built from them.  Returns the model to keep."""
    if is_peft_model(model):
        load_adapter(model, tensors)
        return model
    if any(p.is_meta for p in model.parameters()):
        built = type(model).from_pretrained(None, config=model.config, state_dict=tensors)
        return built.train(model.training)
    result = model.load_state_dict(tensors, strict=False)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(f"trainer.model: the engine's weights do not match the model (missing {sorted(missing)[:3]},"
                           f" unexpected {sorted(result.unexpected_keys)[:3]})")
    return model


__all__ = ["model_and_source", "broadcast_state", "write_back"]
