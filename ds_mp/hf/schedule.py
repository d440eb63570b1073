"""The Trainer's LR schedule, stepped by DeepSpeed's engine.

The engine is built when the Trainer is (so ``evaluate()`` and ``save_model()`` work before
``train()``), but the number of optimizer steps — which ``lr_scheduler_type`` and the warm-up need —
is known only in ``train()``.  DeepSpeed is handed a :class:`BoundLater` scheduler; ``train()`` binds
it to ``transformers.get_scheduler(...)`` over the engine's own torch optimizer, exactly as the
Trainer's ``create_scheduler`` does.  DeepSpeed steps it after every optimizer step (none on a
skipped step); its state goes into ds_mp's layout-free checkpoint (``lr_scheduler``).
"""
from __future__ import annotations

from typing import Any, Callable


class BoundLater:
    """A scheduler whose schedule is set by :meth:`bind`; before that ``step()`` changes nothing."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.scheduler: Any = None

    def bind(self, make: Callable[[Any], Any]) -> None:
        """Build the real scheduler ``make(optimizer)`` (again on every ``train()``, as the Trainer does)."""
        self.scheduler = make(self.optimizer)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        if self.scheduler is not None:
            return self.scheduler.get_last_lr()
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict:
        return {} if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None and state:
            self.scheduler.load_state_dict(state)


def trainer_schedule(args: Any, max_steps: int) -> Callable[[Any], Any]:
    """``optimizer -> scheduler``: the Trainer's ``create_scheduler`` for ``max_steps`` optimizer steps."""
    from transformers.optimization import get_scheduler

    def make(optimizer: Any) -> Any:
        return get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                             num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                             scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    return make


__all__ = ["BoundLater", "trainer_schedule"]
