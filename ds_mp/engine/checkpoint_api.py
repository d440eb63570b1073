"""DeepSpeed's checkpoint API (``engine.save_checkpoint`` / ``load_checkpoint``) on ds_mp's
layout-free training checkpoints (:mod:`ds_mp.checkpoint.training`), as a base class of the engine."""
from __future__ import annotations

import os
from typing import Any


class LayoutFreeCheckpoints:
    """The engine's ``save_checkpoint``/``load_checkpoint``, in place of DeepSpeed's (the engine
    class lists it before DeepSpeed's): they save and resume at any TP × PP × DP, precision wrapper
    and schedule."""

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``engine.save_checkpoint``, writing ds_mp's layout-free checkpoint
        (:func:`ds_mp.checkpoint.training.save_checkpoint`): it resumes at any TP × PP × DP,
        precision wrapper and schedule.  Collective.  ``tag`` defaults to DeepSpeed's
        ``global_step<N>``; frozen parameters (LoRA's base) are always kept, so the checkpoint
        stands alone."""
        from ds_mp.checkpoint.training import save_checkpoint

        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        save_checkpoint(self, save_dir, tag, client_state=client_state, update_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """DeepSpeed's ``engine.load_checkpoint`` on ds_mp's layout-free format: returns
        ``(checkpoint path, client_state)``, or ``(None, None)`` when ``load_dir`` has no
        ``latest`` pointer and no tag is given (as DeepSpeed does: start fresh).  Collective."""
        from ds_mp.checkpoint.training import load_checkpoint, read_latest

        partial = [k for k, v in (("load_module_strict=False", not load_module_strict),
                                  ("load_optimizer_states=False", not load_optimizer_states),
                                  ("load_lr_scheduler_states=False", not load_lr_scheduler_states),
                                  ("load_module_only=True", load_module_only),
                                  ("custom_load_fn", custom_load_fn is not None)) if v]
        if partial:
            raise ValueError(f"load_checkpoint: {', '.join(partial)} is not supported: a ds_mp checkpoint resumes "
                             "the whole run; to start from its weights alone set ds_mp.training.init_from to it")
        if tag is None and read_latest(load_dir) is None:
            return None, None
        tag = str(tag) if tag is not None else read_latest(load_dir)
        client_state = load_checkpoint(self, load_dir, tag)
        return os.path.join(load_dir, tag), client_state
