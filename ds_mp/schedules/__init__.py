"""Pipeline schedules as pure timetables: which instruction each stage runs at each step.

``registry`` re-exports ``ds_mp.config.registry`` (names -> classes, read by config validation);
``gpipe`` holds 1F1B and GPipe, ``zero_bubble`` ZB-H1 (backward split into B and W),
``interleaved`` interleaved 1F1B (v chunks per stage round a ring),
``terapipe/`` the token-sliced schedule (GPipe and 1F1B orders), its key/value cache and its
planner, ``ouroboros/`` the delayed-gradient ring; ``timetable`` compiles any per-stage op order
into deadlock-free instruction steps, ``simulate`` turns a timetable and per-op costs into an
iteration time, ``memory`` measures a schedule's saved
activations.  Engine-side handlers live in ``ds_mp.engine``.
"""
