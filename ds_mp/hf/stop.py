"""Stopping a job on the Trainer path, and checkpoints that are either complete or absent.

A signal (SIGTERM, SIGINT, or a ``deepspeed`` launcher's end: :mod:`ds_mp.training.signals`) during
``trainer.train()`` is handled as ds_mp's own loop handles it:

1. :func:`train` installs a :class:`~ds_mp.training.signals.StopFlag` for the call (it takes over
   from the start-up guard :mod:`ds_mp.launcher_guard`, whose "stopped during start-up" exit is
   true only until then) and a :class:`StopCallback`;
2. at the end of every optimizer step (``on_step_end``) every rank all-reduces the flag, so a
   signal to any one rank stops every rank after the same step;
3. the Trainer then writes its ordinary checkpoint of that step (``_save_checkpoint``:
   ``trainer_state.json``, RNG states, the model, ds_mp's layout-free state), and every rank exits
   with ``SystemExit(128 + signal)`` and rank 0's one line naming the checkpoint;
4. if the save cannot finish (it fails, or a peer is gone and the flag's backstop fires after
   ``2 × DS_MP_TIMEOUT``), the line names the last complete checkpoint instead.

Every Trainer checkpoint (a signal's or a scheduled one) is written under
``<output_dir>/.ds_mp-partial/checkpoint-N`` and renamed to ``<output_dir>/checkpoint-N`` by global
rank 0 once every rank has written its part (:func:`save_checkpoint`): transformers'
``get_last_checkpoint`` never sees a half-written one.  ``train(resume_from_checkpoint=True)``
picks the newest *complete* checkpoint (:func:`last_complete`), skipping others with one line;
an explicit incomplete path is refused in one line naming the last complete one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Any, Callable

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME as STATE
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ds_mp.checkpoint.latest import read_latest
from ds_mp.config import ConfigError
from ds_mp.training.signals import StopFlag, stop_grace_s

STAGING = ".ds_mp-partial"  # under the Trainer's output directory; not a name get_last_checkpoint matches
TAG = "ds_mp"  # ds_mp's layout-free checkpoint inside checkpoint-N (mixin.CHECKPOINT_TAG)
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as transformers.trainer_utils._re_checkpoint


def incomplete(path: str) -> str | None:
    """Why ``path`` is not a complete ds_mp.hf checkpoint (None: it is): a readable
    ``trainer_state.json`` and a finished ds_mp checkpoint (``latest`` → ``ds_mp``)."""
    try:
        with open(os.path.join(path, STATE)) as f:
            json.load(f)
    except (OSError, ValueError):
        return f"no readable {STATE} (a save that was interrupted)"
    try:
        finished = read_latest(path) == TAG
    except Exception:  # noqa: BLE001 - a damaged pointer is an unfinished checkpoint here
        finished = False
    return None if finished else f"no finished {TAG}/ checkpoint (save_only_model, or a save that was interrupted)"


def last_complete(output_dir: str, say: Callable[[str], None] | None = None) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (None: none); ``say`` gets one line
    for each newer one skipped."""
    try:
        names = [n for n in os.listdir(output_dir) if _CHECKPOINT.match(n)]
    except OSError:
        return None
    for name in sorted(names, key=lambda n: int(_CHECKPOINT.match(n).group(1)), reverse=True):
        path = os.path.join(output_dir, name)
        why = incomplete(path) if os.path.isdir(path) else "not a directory"
        if why is None:
            return path
        if say is not None:
            say(f"ds_mp: resume skips {path}: {why}")
    return None


def resume_point(trainer: Any, resume: Any) -> Any:
    """``resume_from_checkpoint`` as the Trainer should read it: True → the newest complete
    checkpoint; an explicit incomplete one → refused in one line."""
    out = trainer.args.output_dir
    if resume is True:
        say = print if trainer.is_world_process_zero() else None
        found = last_complete(out, lambda line: say(line, file=sys.stderr, flush=True) if say else None)
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({out}): no complete checkpoint-N "
                             "(trainer_state.json and ds_mp/)")  # the Trainer's words, then ds_mp's reason
        return found
    if isinstance(resume, str) and os.path.isdir(resume):
        why = incomplete(resume)
        if why is not None:
            raise ConfigError(f"resume_from_checkpoint: {resume} is incomplete ({why}); the last complete checkpoint "
                              f"is {last_complete(os.path.dirname(os.path.abspath(resume))) or 'none'}")
    return resume


class StopCallback(TrainerCallback):
    """The job-wide stop at a step boundary (collective in ``on_step_end``; see the module doc)."""

    def __init__(self, flag: StopFlag, device: Any) -> None:
        self.flag, self.device = flag, device
        self.signum = 0  # the agreed signal (0: none)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.flag.running()  # start-up is over: a signal now waits for the step's end and a save

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.signum, _ = self.flag.agreed(self.device)  # collective: every rank, every step
        if self.signum:
            control.should_save, control.should_training_stop, control.should_evaluate = True, True, False
        return control


class Stopper:
    """One ``train()`` call's stop: the flag and its callback."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.flag = StopFlag(stop_grace_s(), last_saved=lambda: self.last_line())
        self.callback = StopCallback(self.flag, trainer.ds_mp_engine.device)

    def last_line(self) -> str:
        """The last complete checkpoint, as the end of a stop line."""
        found = last_complete(self.trainer.args.output_dir)
        return (f"; the last complete checkpoint is {found} (resume_from_checkpoint=True picks it)" if found
                else "; there is no complete checkpoint yet")

    def cause(self) -> str:
        return self.flag.describe(self.callback.signum)


def _stopper(trainer: Any) -> Stopper | None:
    return getattr(trainer, "_ds_mp_stopper", None)


def train(trainer: Any, base_train: Callable[..., Any], resume: Any, trial: Any, **kwargs: Any) -> Any:
    """``trainer.train`` (``base_train``) with the stop on a signal installed for the call."""
    stopper = Stopper(trainer)
    trainer._ds_mp_stopper = stopper
    stopper.flag.install()
    trainer.add_callback(stopper.callback)
    try:
        result = base_train(resume_from_checkpoint=resume_point(trainer, resume), trial=trial, **kwargs)
        signum, _ = stopper.flag.agreed(trainer.ds_mp_engine.device)  # a signal after the last step's check
        if signum:
            _stop(trainer, f"stopped by {stopper.flag.describe(signum)} after training ended (step "
                           f"{trainer.state.global_step}){stopper.last_line()}", signum)
        return result
    except SystemExit:
        raise
    except BaseException as e:
        if stopper.callback.signum:  # the stop's save failed
            print(f"ds_mp: stopped by {stopper.cause()} after step {trainer.state.global_step} but the checkpoint "
                  f"could not be saved ({type(e).__name__}: {e}){stopper.last_line()}", file=sys.stderr, flush=True)
        raise
    finally:
        stopper.flag.uninstall()
        trainer.remove_callback(stopper.callback)
        trainer._ds_mp_stopper = None


def _stop(trainer: Any, line: str, signum: int) -> None:
    if trainer.is_world_process_zero():
        print(f"ds_mp: {line}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def staging_root(trainer: Any) -> str | None:
    """Where the Trainer writes the checkpoint being saved (None: no save under way)."""
    return getattr(trainer, "_ds_mp_staging", None)


def save_checkpoint(trainer: Any, base_save: Callable[[Any, Any], None], model: Any, trial: Any) -> None:
    """Collective: the Trainer's ``_save_checkpoint`` (``base_save``) into the staging directory,
    renamed to ``<output_dir>/checkpoint-N`` by global rank 0 once every rank has written; then,
    after a stop was agreed, every rank exits (rank 0 naming the checkpoint)."""
    from transformers.trainer_utils import rotate_checkpoints

    args, state = trainer.args, trainer.state
    run_dir = trainer._get_output_dir(trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging, final = os.path.join(run_dir, STAGING), os.path.join(run_dir, name)
    if args.should_save:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        os.makedirs(staging)
    _barrier()
    trainer._ds_mp_staging = staging
    try:
        base_save(model, trial)
    finally:
        trainer._ds_mp_staging = None
    _barrier()  # every rank's files are in the staging directory
    _fix_best(trainer, os.path.join(staging, name), run_dir)
    if args.should_save:
        if os.path.exists(final):  # the same step saved before (a run resumed from an earlier checkpoint)
            os.replace(final, os.path.join(staging, f"replaced-{name}"))
        os.replace(os.path.join(staging, name), final)
        shutil.rmtree(staging, ignore_errors=True)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
    _barrier()
    stopper = _stopper(trainer)
    if stopper is not None and stopper.callback.signum:
        _stop(trainer, f"stopped by {stopper.cause()} after step {state.global_step}: checkpoint saved in {final}; "
                       "continue with trainer.train(resume_from_checkpoint=True)", stopper.callback.signum)


def _fix_best(trainer: Any, staged: str, run_dir: str) -> None:
    """Every rank: the Trainer looked for the best checkpoint under the staging directory; set
    ``best_model_checkpoint`` as it would have in ``run_dir`` (an existing ``checkpoint-<best step>``,
    or the one being saved) and rewrite the staged ``trainer_state.json`` with it."""
    from transformers.trainer_utils import SaveStrategy

    state, args = trainer.state, trainer.args
    if args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) or \
            not state.best_global_step:
        return
    best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
    if state.best_model_checkpoint == best or (state.best_global_step != state.global_step and not os.path.isdir(best)):
        return
    state.best_model_checkpoint = best
    if args.should_save and os.path.exists(os.path.join(staged, STATE)):
        state.save_to_json(os.path.join(staged, STATE))


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
