"""TeraPipe (token-level pipelining): ``schedule`` (instructions and timetable), ``planner`` (cost
model + dynamic program), ``cost_model``, ``spec`` (its ScheduleSpec).  The live parts are on the
engine floor: ``ds_mp.engine.terapipe_kv`` (attention to earlier slices) and
``ds_mp.engine.terapipe_profile`` (measuring a stage and ``"slices": "auto"``)."""
