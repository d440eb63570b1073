"""Schedule names -> where their classes live (a table; imports nothing).

``"ds_mp": {"pipeline": {"schedule": NAME}}`` picks a schedule by name.  Config validation
reads :data:`SCHEDULES` to check the name without importing DeepSpeed's pipeline engine or
any schedule; the engine resolves the entry with :func:`resolve` when it builds one.

An entry is ``"module:attribute"`` of a ``deepspeed.runtime.pipe.schedule.PipeSchedule``
subclass, or the class itself (user schedules registered with :func:`register_schedule`).
A schedule class may define ``from_engine(engine)`` to read its options; otherwise it is
built as ``cls(micro_batches=, stages=, stage_id=)``.  A schedule that needs engine-side
instruction handlers names their module in :data:`ENGINE_SUPPORT`; the engine imports it
(which registers the handlers) before running the schedule.

This module is on the ground floor, in ``ds_mp.config`` (which validates the name against it):
it is a table of names and imports no schedule.  ``ds_mp.schedules.registry`` re-exports it.
"""
from __future__ import annotations

import importlib
from typing import Union

SCHEDULES: dict[str, Union[str, type]] = {
    "1f1b": "ds_mp.schedules.gpipe:OneFOneB",
    "gpipe": "ds_mp.schedules.gpipe:GPipe",
    "terapipe": "ds_mp.schedules.terapipe.schedule:TeraPipeSchedule",
    "ouroboros": "ds_mp.schedules.ouroboros.timetable:OuroborosSchedule",
    "zb-h1": "ds_mp.schedules.zero_bubble:ZeroBubbleH1",
    "interleaved": "ds_mp.schedules.interleaved:Interleaved1F1B",
}

# schedule name -> module whose import registers its instruction handlers on the engine
ENGINE_SUPPORT: dict[str, str] = {
    "terapipe": "ds_mp.engine.terapipe",
    "ouroboros": "ds_mp.engine.ouroboros",
    "zb-h1": "ds_mp.engine.zero_bubble",
    "interleaved": "ds_mp.engine.interleaved",
}


def register_schedule(name: str, cls: type) -> type:
    """Register ``cls`` (a ``PipeSchedule`` subclass) as ``name``; returns ``cls``."""
    from deepspeed.runtime.pipe.schedule import PipeSchedule

    if not (isinstance(cls, type) and issubclass(cls, PipeSchedule)):
        raise TypeError(f"schedule {name!r} must be a PipeSchedule subclass, got {cls!r}")
    SCHEDULES[name] = cls
    return cls


def resolve(name: str) -> type:
    """The schedule class registered as ``name`` (importing it on first use)."""
    entry = SCHEDULES[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry


__all__ = ["SCHEDULES", "ENGINE_SUPPORT", "register_schedule", "resolve"]
