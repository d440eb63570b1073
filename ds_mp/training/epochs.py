"""Training by epochs (``training.epochs``): the optimizer steps that many passes over the rows take.

An epoch is one pass over the training rows (SFT: the planned rows; stream: the chunks), R of
them; the run takes ``target = ceil(epochs × R)`` samples of the sampler's stream.  A run that
starts (or resumes) at step s having consumed c samples (the sampler's, kept in its checkpoints)
trains to

    steps = s + ceil((target − c) / global batch)                   (fixed batch)
    steps = s + the steps the linear batch ramp takes to consume target − c   (ramp simulated)

so a resume, at the same or another layout, ends where the uninterrupted run would (the last step
may straddle into the next epoch, like any step: nothing is dropped).  The noise-scale ramp is
refused with epochs (``load_config``): its batches are known only while training.
The ``epoch`` column of log.csv is ``consumed samples / R`` after the step (1.0 = one epoch done).
"""
from __future__ import annotations

import copy
import math
from typing import Any


def epoch_steps(epochs: float, rows: int, consumed: int, start_step: int, global_batch: int,
                ramp: Any = None) -> int:
    """The last step of a run of ``epochs`` epochs over ``rows`` rows (module docstring)."""
    left = math.ceil(epochs * rows) - consumed
    if left <= 0:
        return start_step
    if ramp is None:
        return start_step + math.ceil(left / global_batch)
    sim, step = copy.deepcopy(ramp), start_step
    while left > 0:
        step += 1
        left -= sim.before_step(step)
        sim.after_step()
    return step


def epoch_note(rows: int, global_batch: int, steps: int, epochs: float, ramp: Any = None) -> str:
    """The line printed at start: rows per epoch, steps per epoch, and the run's length in both."""
    per = rows / global_batch
    ramped = " at the ramp's first batch" if ramp is not None else ""
    length = f"training.epochs={epochs:g} -> {steps} steps" if epochs else f"{steps} steps = {steps / per:.2f} epochs"
    return (f"ds_mp: epoch = {rows} rows; {per:.1f} steps per epoch at global batch {global_batch}{ramped}; "
            f"{length}")
