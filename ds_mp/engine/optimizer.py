"""The one parser of the DeepSpeed ``optimizer`` block that ds_mp needs for its own additions.

DeepSpeed builds the optimizer from the JSON itself; ds_mp only supplies parameter groups
(no weight decay on biases and LayerNorm, as GPT-2/Megatron train) and, for
``"type": "Lamb"``, its own LAMB (DeepSpeed's is CUDA-only).
"""
from __future__ import annotations

from typing import Any, Hashable

import torch

from ds_mp.config import ConfigError


def optimizer_setup(net: torch.nn.Module, ds_dict: dict, optimizer: Any,
                    group_keys: dict[int, Hashable] | None = None) -> tuple[list, Any]:
    """Parameter groups (no weight decay on biases/LayerNorm) and, for ``"type": "Lamb"``,
    ds_mp's own LAMB (DeepSpeed's Lamb is CUDA-only): it is passed to DeepSpeed as a
    client optimizer and the ``optimizer`` block is removed from the dict DeepSpeed sees.
    ``group_keys`` (id(parameter) -> key) splits every group further by key (:func:`split_groups`).
    """
    from ds_mp.optim import Lamb, param_groups_no_decay

    block = ds_dict.get("optimizer") or {}
    opts = dict(block.get("params", {}))
    groups = param_groups_no_decay(net, float(opts.get("weight_decay", 0.0)))
    if group_keys is not None:
        groups = split_groups(groups, group_keys)
    if optimizer is None and str(block.get("type", "")).lower() == "lamb":
        optimizer = Lamb(groups, **_lamb_params(opts))
        del ds_dict["optimizer"]
    return groups, optimizer


def split_groups(groups: list[dict], keys: dict[int, Hashable]) -> list[dict]:
    """Each group cut into one group per distinct ``keys[id(p)]`` (first-seen order), with the
    same hyper-parameters: the optimizer update is unchanged, but a wrapper that flattens each
    group (DeepSpeed's bf16/ZeRO) keeps per-key partitions and step counters."""
    out = []
    for g in groups:
        by_key: dict[Hashable, list] = {}
        for p in g["params"]:
            by_key.setdefault(keys[id(p)], []).append(p)
        out += [{**g, "params": ps} for ps in by_key.values()]
    return out


def _lamb_params(opts: dict) -> dict:
    """DeepSpeed's Lamb params -> ds_mp's Lamb kwargs (weight decay lives in the param groups)."""
    allowed = {"lr", "betas", "eps", "weight_decay", "max_trust", "bias_correction", "max_coeff"}
    unknown = set(opts) - allowed
    if unknown:
        raise ConfigError(f"optimizer.params: {sorted(unknown)} not understood by ds_mp's Lamb; "
                          f"use {sorted(allowed - {'max_coeff'})}")
    opts = dict(opts)
    if "max_coeff" in opts:  # DeepSpeed's name for the trust-ratio clip
        opts["max_trust"] = opts.pop("max_coeff")
    opts.pop("weight_decay", None)
    return opts


def single_process_optimizer(block: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer the DeepSpeed ``optimizer`` block describes, as a plain torch optimizer on
    one process (tools that run the HF model alone, e.g. ``ds-mp lr-find``), with the same
    weight-decay groups.  DeepSpeed's semantics: ``Adam`` is AdamW unless ``adam_w_mode`` is
    false; ``Lamb`` is ds_mp's.
    """
    from ds_mp.optim import Lamb, param_groups_no_decay

    kind = str(block.get("type", "AdamW")).lower()
    opts = dict(block.get("params", {}))
    groups = param_groups_no_decay(model, float(opts.get("weight_decay", 0.0)))
    if kind == "lamb":
        return Lamb(groups, **_lamb_params(opts))
    common = {k: opts[k] for k in ("lr",) if k in opts}
    if kind == "sgd":
        return torch.optim.SGD(groups, **common, **{k: opts[k] for k in ("momentum", "nesterov") if k in opts})
    if kind in ("adam", "adamw"):
        w_mode = kind == "adamw" or opts.get("adam_w_mode", True)
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        return cls(groups, **common, **{k: opts[k] for k in ("betas", "eps") if k in opts})
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, **common, **{k: opts[k] for k in ("eps",) if k in opts})
    raise ConfigError(f"optimizer.type: {block.get('type')!r} has no single-process equivalent here; "
                      "use Adam, AdamW, SGD, Adagrad or Lamb")


__all__ = ["optimizer_setup", "split_groups", "single_process_optimizer"]
