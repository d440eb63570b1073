"""Pipeline schedules as pure timetables: which instruction each stage runs at each step.

``registry`` maps names to classes (read by config validation without importing them);
``gpipe`` holds 1F1B and GPipe, ``terapipe/`` the token-sliced schedule, its key/value
cache and its planner, ``ouroboros/`` the delayed-gradient ring, ``simulate`` turns a
timetable and per-op costs into an iteration time.  Engine-side handlers live in
``ds_mp.engine``.
"""
