"""On resume, the optimizer hyper-parameters the user changed in the config win.

A checkpoint restores the optimizer's parameter groups as they were saved (an exact resume:
the LR a schedule or a batch ramp had set, the group's own weight decay, ...).  Alone, that
would make an edited config silently lose: lower ``optimizer.params.lr`` after a divergence,
``--resume``, and the saved LR comes back.  So a checkpoint also stores the JSON's
``optimizer.params`` it was trained with (``engine.optimizer_hparams``, set by
``ds_mp.initialize``), and on load every key whose value differs between that and this run's
JSON takes this run's value, in every group as this engine built it (the no-decay group keeps
weight decay 0).  Keys the config did not change keep the saved values, so an unchanged config
still resumes exactly.  ``lr`` is the exception when an LR scheduler runs: the scheduler's
restored state sets the LR from the next step on (change the scheduler's params instead).
Checkpoints of an older ds_mp hold no JSON params: their saved groups win, as before.
"""
from __future__ import annotations

from typing import Any


def changed_hparams(saved: dict | None, current: dict | None) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for the JSON ``optimizer.params`` keys that differ;
    empty when the checkpoint holds no params (an older ds_mp) or the engine knows none."""
    if saved is None or current is None:
        return {}
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - betas: a list in JSON, a tuple in torch
    return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if norm(saved.get(k)) != norm(current.get(k))}


def apply_config_hparams(pairs: list[tuple[dict, dict]], changed: dict[str, tuple[Any, Any]],
                         has_scheduler: bool) -> str | None:
    """Set each changed key of each engine group back to the value this engine was built with.

    ``pairs``: (engine group, its hyper-parameters as built, before the checkpoint's were loaded).
    Returns the one-line note for the user, or None when nothing changed."""
    applied, by_scheduler = [], False
    for key, (old, new) in changed.items():
        if key == "lr" and has_scheduler:
            by_scheduler = True
            continue
        hit = False
        for group, built in pairs:
            if key in built and key in group:
                group[key] = built[key]
                hit = True
        if hit:
            applied.append(f"{key} {_shown(old)} -> {_shown(new)}")
    if not applied and not by_scheduler:
        return None
    note = f"the config changed {', '.join(applied)} since the save: the config's values are used" if applied else ""
    if by_scheduler:
        note += ("; " if note else "") + ("optimizer.params.lr changed, but the LR scheduler sets the LR "
                                          "(from its saved state): change scheduler.params instead")
    return note


def _shown(value: Any) -> str:
    """A JSON value as the user wrote it; an absent key is "unset" (the optimizer's default)."""
    return "unset" if value is None else str(value)
