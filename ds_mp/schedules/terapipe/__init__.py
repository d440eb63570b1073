"""TeraPipe (token-level pipelining): ``schedule`` (instructions and timetable), ``kv_cache``
(attention to earlier slices), ``planner`` (cost model + dynamic program), ``profile``
(measuring a stage and ``"slices": "auto"``)."""
