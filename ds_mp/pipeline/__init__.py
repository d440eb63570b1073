"""Pipeline engine, schedule registry and schedules."""
from ds_mp.pipeline.schedules import SCHEDULES, GPipe, OneFOneB, register_schedule
from ds_mp.pipeline.terapipe import TeraPipeSchedule  # registers "terapipe"
from ds_mp.pipeline.ouroboros_schedule import OuroborosSchedule  # registers "ouroboros"

__all__ = ["SCHEDULES", "register_schedule", "OneFOneB", "GPipe", "TeraPipeSchedule", "OuroborosSchedule"]
