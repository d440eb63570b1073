"""The schedule registry's old import path: the table itself is :mod:`ds_mp.config.registry`
(ground floor, beside the config that validates a schedule's name against it)."""
from __future__ import annotations

from ds_mp.config.registry import SCHEDULES, ScheduleSpec, register_schedule, resolve, schedule_spec

__all__ = ["SCHEDULES", "ScheduleSpec", "register_schedule", "resolve", "schedule_spec"]
