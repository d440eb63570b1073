"""The schedule registry's old import path: the table itself is :mod:`ds_mp.config.registry`
(ground floor, beside the config that validates a schedule's name against it)."""
from __future__ import annotations

from ds_mp.config.registry import ENGINE_SUPPORT, SCHEDULES, register_schedule, resolve

__all__ = ["SCHEDULES", "ENGINE_SUPPORT", "register_schedule", "resolve"]
