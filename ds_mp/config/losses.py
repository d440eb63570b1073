"""The loss registry: loss name -> its :class:`~ds_mp.losses.spec.LossSpec` (a table; imports no loss).

``"ds_mp": {"loss": {"type": NAME}}`` picks a loss by name; an unknown name is refused at
``load_config``.  A built-in's entry is ``"module:attribute"`` of its spec, imported on first use
(:func:`loss_spec`); ``register_loss(name, spec)`` registers a user's spec with the same power.
"""
from __future__ import annotations

from typing import Any

from ds_mp.config.registry import load

LOSSES: dict[str, Any] = {
    "lm": "ds_mp.losses.lm:LM_LOSS",
    "dpo": "ds_mp.losses.dpo:DPO_LOSS",
}


HOOKS = ("with_options", "check", "units", "denominators", "labels", "unpack", "token_slice", "micro_loss",
         "rows", "row_values", "bind")


def loss_spec(name: str) -> Any:
    """The :class:`~ds_mp.losses.spec.LossSpec` registered as ``name`` (imported on first use)."""
    return load(LOSSES[name])


def configured_loss(loss: Any) -> Any:
    """The spec of a ``"loss"`` block (``DsMpConfig.loss``): the registered spec of ``loss.type`` with
    the block's other keys as its options (``LossSpec.with_options``: an unknown key or a bad value is
    a ConfigError naming it)."""
    return loss_spec(loss.type).with_options(**loss.options)


def register_loss(name: str, spec: Any) -> Any:
    """Register ``spec`` (a ``ds_mp.losses.LossSpec`` instance: this floor names no loss, so its hooks
    are checked by name) as ``"loss": {"type": name}``; returns it."""
    missing = [h for h in HOOKS if not callable(getattr(spec, h, None))]
    if isinstance(spec, type) or missing:
        raise TypeError(f"loss {name!r} must be a ds_mp.losses.LossSpec instance, got {spec!r}")
    LOSSES[name] = spec
    return spec


__all__ = ["LOSSES", "loss_spec", "configured_loss", "register_loss"]
