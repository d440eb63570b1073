"""Ouroboros (delayed-gradient model parallelism): ``algorithm`` (single-process reference of
Algorithm 1), ``timetable`` (module split, ring placement, per-rank steps), ``checkpoint``
(in-flight state)."""
