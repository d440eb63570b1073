"""Ouroboros (delayed-gradient model parallelism): ``timetable`` (module split, ring placement,
per-rank steps), ``spec`` (its ScheduleSpec).  The runtime is ``ds_mp.engine.ouroboros``; the
single-process reference of Algorithm 1 (the tests' oracle) is ``tests/ouroboros_oracle.py``."""
