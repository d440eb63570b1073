"""What the training loop does after a step whose loss or gradients were not finite.

The engine has already skipped that step's update (the weights stay those before it).  Then:

* ``training.on_nan: "stop"``: stop at once;
* ``training.on_nan: "skip"``: go on, unless ``training.max_consecutive_skips`` steps in a row
  were skipped (0 = no limit).  While steps are skipped the weights do not move, so a run of
  skips that does not end by itself means the weights or the LR have diverged, not the data:
  every further step is wasted and the run would end "successfully" with a diverged model.

On a stop the loop saves a diagnostic checkpoint ``nan-stepN`` (the weights before the bad step,
already diverging) that does **not** move ``latest`` and is not one of the run's checkpoints (a
fresh start is not refused for it, ``--resume`` never picks it).  The line names the newest
regular checkpoint from *before* the diverging weights (a checkpoint of the step just before the
bad one holds those same weights), or says to start afresh.
:func:`stop_message` is the one line the run ends with.
"""
from __future__ import annotations

import math

from ds_mp.training.run_dir import STEP_TAG


class NanGuard:
    """Counts skipped steps in a row; :meth:`after_step` says whether the run must stop."""

    def __init__(self, on_nan: str, max_consecutive_skips: int) -> None:
        self.on_nan, self.limit = on_nan, max_consecutive_skips
        self.in_a_row = 0  # consecutive skipped steps up to the last one seen

    def after_step(self, loss: float, skipped: bool) -> bool:
        """Record one step (``skipped``: its update was dropped for a non-finite gradient); True
        if the run must stop now."""
        bad = skipped or not math.isfinite(loss)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if not bad:
            return False
        return self.on_nan == "stop" or (self.limit > 0 and self.in_a_row >= self.limit)

    def stop_message(self, step: int, loss: float, diagnostic: str, checkpoints: list[str]) -> str:
        """The run's last line: why it stopped, where the diagnostic is, what to do next.

        ``checkpoints``: the run's regular ``stepN`` checkpoints, oldest first.  The first bad step
        (``first``) started from the weights after step ``first - 1``, so the checkpoints of steps
        ``>= first - 1`` hold those diverging weights (or, after skipped steps, the same ones):
        only an older one is offered to resume from; none older means a fresh start."""
        if self.on_nan == "stop":
            why = f"non-finite loss {loss} at step {step}"
        else:
            why = (f"{self.in_a_row} steps in a row skipped for a non-finite loss or gradient (steps "
                   f"{step - self.in_a_row + 1}-{step}; training.max_consecutive_skips={self.limit})")
        first = step - self.in_a_row + 1
        steps = [(int(m.group(1)), t) for t in checkpoints if (m := STEP_TAG.fullmatch(t))]
        before = [t for n, t in steps if n < first - 1]
        diverged = [t for n, t in steps if n >= first - 1]
        if before:
            then = (f"lower the LR and continue from {before[-1]}, the newest checkpoint from before the diverging "
                    f"weights: --resume {before[-1]}")
        elif diverged:
            then = (f"the run's checkpoints ({', '.join(diverged[-3:])}) hold the diverging weights: lower the LR and "
                    "start again in a new ds_mp.training.output_dir (--output_dir)")
        else:
            then = "no checkpoint precedes it: lower the LR and start again without --resume"
        hint = ", or set training.on_nan='skip'" if self.on_nan == "stop" else ""
        return (f"{why}; diagnostic checkpoint {diagnostic} (the weights the bad step started from; `latest` not "
                f"moved: do not resume from it); {then}{hint}")
