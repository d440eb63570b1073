"""Pipeline schedules as pure timetables: which instruction each stage runs at each step.

``registry`` re-exports ``ds_mp.config.registry`` (names -> specs, read by config validation);
``gpipe`` holds 1F1B and GPipe, ``zero_bubble`` ZB-H1 (backward split into B and W),
``interleaved`` interleaved 1F1B (v chunks per stage round a ring),
``terapipe/`` the token-sliced schedule (GPipe and 1F1B orders) and its planner,
``ouroboros/`` the delayed-gradient ring; each with its ``ScheduleSpec``; ``timetable`` compiles
any per-stage op order into deadlock-free instruction steps, ``simulate`` turns a timetable and
per-op costs into an iteration time.  What runs on live tensors (handlers, TeraPipe's key/value
cache and profiling, the measured memory census) lives in ``ds_mp.engine``.
"""
