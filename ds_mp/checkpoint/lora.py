"""Export a LoRA-trained engine (``ds_mp.lora``): the adapter in PEFT's format, or the merged HF model.

Both come from :func:`~ds_mp.checkpoint.hf.full_state_dict` (the TP shards of every tensor,
LoRA factors included, gathered to global rank 0 by HF name; factors in the Conv1D layout
``lora_A`` = Aᵀ (in, r), ``lora_B`` = Bᵀ (r, out)):

* adapter (``merge=False``): ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's
  keys ``base_model.model.transformer.h.<i>.<module>.lora_A.weight`` = A (r, in) and
  ``….lora_B.weight`` = B (out, r), ``fan_in_fan_out: true`` for GPT-2's Conv1D (false for the
  Llama family's ``nn.Linear``), so
  ``PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), out)`` loads it.
* merged (``merge=True``): an HF GPT-2 directory with ``W ← W + s · lora_A lora_B``
  (= W + s·(BA)ᵀ in the Conv1D layout), s = alpha / r, and no LoRA tensors.

A mixture of experts' fused tensors (``target_parameters``) carry their factors per expert,
``<tensor>.lora_A`` (E, r, in) and ``<tensor>.lora_B`` (E, out, r) (``ds_mp.models.moe.lora``): the
adapter stores them as PEFT's ``ParamWrapper`` does (``….experts[.base_layer].lora_A.weight`` (r·E, in),
``lora_B.weight`` (out, r·E)) and lists ``target_parameters`` in its config; the merge adds
``s · B_e A_e`` to each expert's ``W_e``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from ds_mp.atomic import atomic_dir
from ds_mp.checkpoint.hf import full_state_dict, write_hf_dir, write_on_rank0
from ds_mp.checkpoint.sharded import CheckpointError
from ds_mp.engine_view import EngineView
from ds_mp.models.family import family_of
from ds_mp.models.weights import param_factors_to_peft, peft_wrapper_names

__all__ = ["save_lora", "merge_lora", "peft_adapter_tensors", "hf_order", "adapter_config", "peft_version",
           "PEFT_TESTED"]


def hf_order(cfg: Any) -> list[str]:
    """Every parameter of ``cfg``'s model by HF name, in HF order (the order PEFT nests ``ParamWrapper`` s in)."""
    return list(family_of(cfg).param_shapes(cfg))


def _factors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module prefixes (``transformer.h.0.attn.c_attn``) that carry LoRA factors."""
    return sorted(n[: -len(".lora_A")] for n in tensors if n.endswith(".lora_A"))


def merge_lora(tensors: dict[str, torch.Tensor], scaling: float,
               fan_in_fan_out: bool = True) -> dict[str, torch.Tensor]:
    """HF tensors with every LoRA update folded into its base weight: ``W + s · lora_A lora_B`` for a
    Conv1D-layout ``W`` (in, out), its transpose for an ``nn.Linear`` ``W`` (out, in;
    ``fan_in_fan_out=False``, the Llama family); a fused expert tensor ``W`` (E, out, in) adapted per
    expert (``target_parameters``, factors (E, r, in) and (E, out, r)): ``W_e + s · lora_B_e lora_A_e``."""
    out = {n: t for n, t in tensors.items() if ".lora_" not in n}
    for m in _factors(tensors):
        a, b = tensors[m + ".lora_A"], tensors[m + ".lora_B"]
        if a.dim() == 3:  # PEFT's ParamWrapper: the factors are named after the parameter itself
            out[m] = out[m] + scaling * torch.bmm(b, a)
            continue
        delta = scaling * (a @ b)
        out[m + ".weight"] = out[m + ".weight"] + (delta if fan_in_fan_out else delta.t())
    return out


def peft_adapter_tensors(tensors: dict[str, torch.Tensor], cfg: Any = None) -> dict[str, torch.Tensor]:
    """The LoRA factors under PEFT's saved names, in PEFT's (nn.Linear) orientation; a fused expert
    tensor's factors (3-D: ``target_parameters``) under the name of the ``ParamWrapper`` PEFT nests for it
    (by ``cfg``'s HF parameter order, :func:`hf_order`; :func:`~ds_mp.models.weights.peft_wrapper_names`), as
    PEFT's ``(r·E, in)`` and ``(out, r·E)`` weights."""
    out, factors = {}, _factors(tensors)
    params = [m for m in factors if tensors[m + ".lora_A"].dim() == 3]
    wrappers = peft_wrapper_names(params, hf_order(cfg)) if params else {}
    for m in factors:
        if m in wrappers:
            a, b = param_factors_to_peft(tensors[m + ".lora_A"], tensors[m + ".lora_B"])
            out[f"base_model.model.{wrappers[m]}.lora_A.weight"] = a
            out[f"base_model.model.{wrappers[m]}.lora_B.weight"] = b
            continue
        for f in ("lora_A", "lora_B"):
            out[f"base_model.model.{m}.{f}.weight"] = tensors[f"{m}.{f}"].t().contiguous()
    return out


#: The PEFT release whose adapter format ds_mp writes, named in ``peft_version`` where PEFT is not installed.
PEFT_TESTED = "0.21.2"


def peft_version() -> str:
    """``peft_version`` as PEFT writes it (its ``PeftConfig.peft_version``: the installed release); the
    tested release where PEFT is not installed.  PEFT reads it to tell which release wrote an adapter."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peft")
    except PackageNotFoundError:
        return PEFT_TESTED


def adapter_config(lora: Any, base_model: str | None, fan_in_fan_out: bool = True) -> dict:
    """PEFT's ``adapter_config.json`` for ``ds_mp.lora`` (a ``LoraConfig``); ``fan_in_fan_out``: the base
    weights are GPT-2's Conv1D (in, out), not ``nn.Linear``'s (out, in)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "fan_in_fan_out": fan_in_fan_out, "bias": "none",
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "peft_version": peft_version(), **({"target_parameters": list(lora.target_parameters)}
                                               if getattr(lora, "target_parameters", None) else {})}


def save_lora(engine: EngineView, out_dir: str, merge: bool = False, tokenizer_dir: str | None = None,
              base_model: str | None = None) -> None:
    """Collective (every rank calls it): global rank 0 writes the PEFT adapter (or, ``merge``, the
    merged HF directory) to ``out_dir`` (replaced atomically).  A write error on rank 0 is raised on
    every rank; an engine without ``ds_mp.lora`` is refused on every rank before any collective."""
    lora = engine.ds_mp_config.lora
    if not lora.r:
        raise CheckpointError("save_lora: this engine has no LoRA (ds_mp.lora.r is 0); use ds_mp.save_hf")
    tensors, conv1d = full_state_dict(engine), engine.module.family.fan_in_fan_out

    def write() -> None:
        if merge:
            write_hf_dir(merge_lora(tensors, lora.alpha / lora.r, conv1d), engine.hf_config, out_dir,
                         tokenizer_dir=tokenizer_dir, overwrite=True)
            return
        from safetensors.torch import save_file

        with atomic_dir(out_dir, overwrite=True) as tmp:
            save_file(peft_adapter_tensors(tensors, engine.hf_config),
                      os.path.join(tmp, "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                json.dump(adapter_config(lora, base_model, conv1d), f, indent=2)

    write_on_rank0(engine, f"save_lora to {out_dir!r}", write)
