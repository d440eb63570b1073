"""Stopping a job: a signal to any one of its processes ends all of them, after a save.

What DeepSpeed 0.19.8's single-node launchers do with signals (``deepspeed/launcher/``):

* ``runner.py`` (the ``deepspeed`` command) starts ``launch.py`` and waits; it installs a handler
  only on its multi-node pdsh path.  SIGTERM ends the runner at once (SIGINT: a KeyboardInterrupt
  in it) and leaves ``launch.py`` and every rank running.
* ``launch.py`` handles SIGTERM/SIGINT by terminating each rank's process tree in turn (SIGTERM,
  then SIGKILL after 30 s), and when a rank exits non-zero it does the same to the others and exits
  with that rank's code.

So every rank (:class:`StopFlag`, taking over from :mod:`ds_mp.launcher_guard`, which ``import
ds_mp`` armed before torch was imported):

0. during start-up (until :meth:`StopFlag.running`, just before the first step) a signal or a
   launcher's end exits the rank at once with one line and 128 + the signal: nothing to save;

1. turns SIGTERM/SIGINT into a flag (later signals are ignored: a signal to the process group
   reaches a rank twice, once directly and once from ``launch.py``);
2. watches its launchers as recorded at spawn: ``launch.py`` (its parent: ``PR_SET_PDEATHSIG`` and
   a poll of the parent pid against the recorded one) and the ``deepspeed`` runner above it (a poll
   of ``launch.py``'s parent pid); one of them gone sets the flag as SIGTERM would;
3. at the end of every step all ranks all-reduce the flag (:meth:`StopFlag.agreed`: MAX of one
   int32 on the engine's device), so a signal to any one rank stops every rank after the same
   step; the loop then saves (``training.save_on_signal``) and exits with 128 + the signal number,
   which makes ``launch.py`` end and exit too;
4. a backstop: a rank still alive ``grace_s`` after its flag was set (a peer died inside a
   collective, a save stuck on a dead filesystem) exits at once, without saving.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch

from ds_mp import launcher_guard

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(RuntimeError):
    """The job was asked to stop; ``code`` is the process exit code (128 + signal number)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def launcher_chain() -> tuple[int | None, int | None]:
    """(``launch.py``'s pid, the ``deepspeed`` runner's pid) above this rank as recorded when ``ds_mp``
    was first imported (:mod:`ds_mp.launcher_guard`), each None when this process was not started
    that way (a test, ``torchrun``, Slurm's ``srun``)."""
    guard = launcher_guard.armed()
    chain = guard.chain if guard is not None else launcher_guard.current_chain()
    return chain.launch, chain.runner


class StopFlag:
    """This rank's stop request: set by SIGTERM/SIGINT or by its launchers' end (see the module doc).

    ``grace_s``: the backstop; the process exits without saving that long after the request, its line
    ending with ``last_saved()`` (e.g. which checkpoint is the last complete one).
    Until :meth:`running` (start-up: imports, rendezvous, checks, engine, resume) a signal or the
    launcher's end exits the rank at once with one line (nothing to save yet)."""

    def __init__(self, grace_s: float, poll_s: float = 0.5, last_saved: Callable[[], str] | None = None) -> None:
        self.grace_s, self.poll_s, self.last_saved = grace_s, poll_s, last_saved
        self.signum, self.reason, self.since = 0, "", 0.0
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.starting = True

    def running(self) -> "StopFlag":
        """From now on a stop request waits for the end of the step (and a save)."""
        self.starting = False
        return self

    def install(self) -> "StopFlag":
        """Handle the signals (from the main thread only: Python's rule), watch the launchers."""
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._on_signal)
        guard = launcher_guard.armed()
        if guard is not None:
            guard.disarm()  # this flag's thread watches from now on
        launch, runner = launcher_chain()
        self._thread = threading.Thread(target=self._watch, args=(guard, launch, runner), daemon=True,
                                        name="ds_mp-stop")
        self._thread.start()
        return self

    def uninstall(self) -> None:
        """Restore the handlers found at :meth:`install`; the start-up guard's becomes the default
        (start-up is over: its "nothing was trained" would not be true)."""
        for s, handler in self._previous.items():
            if handler is launcher_guard.startup_handler:
                handler = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
            signal.signal(s, handler)
        self._previous.clear()
        self._done.set()

    def request(self, signum: int, reason: str) -> None:
        if self.starting:
            launcher_guard.startup_exit(reason, 128 + int(signum))
        if not self.signum:  # the first request wins; repeats change nothing
            self.signum, self.reason, self.since = int(signum), reason, time.monotonic()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(signum, signal.Signals(signum).name)

    def _watch(self, guard: launcher_guard.Guard | None, launch: int | None, runner: int | None) -> None:
        chain = launcher_guard.Chain(launch, runner)
        while not self._done.is_set():
            for got in guard.signals(self.poll_s) if guard is not None else []:  # a main thread blocked in C
                if got in HANDLED and not self._done.is_set():
                    self.request(got, signal.Signals(got).name)
            if guard is None and self._done.wait(self.poll_s):
                return
            why = launcher_guard.gone(chain)
            if why and not self._done.is_set():
                self.request(signal.SIGTERM, f"SIGTERM ({why})")
            if self.signum and time.monotonic() - self.since > self.grace_s:
                last = self.last_saved() if self.last_saved is not None else ""
                print(f"ds_mp: stop requested by {self.reason} {self.grace_s:.0f} s ago and the step or save did "
                      f"not finish (a peer gone?): exiting without a save{last}", file=sys.stderr, flush=True)
                os._exit(128 + self.signum)

    def agreed(self, device: Any, failed: bool = False) -> tuple[int, bool]:
        """Collective over all ranks (one all-reduce of two int32 on the engine's device): the largest
        signal number any rank holds (0: carry on), and whether any rank reports ``failed``."""
        import torch.distributed as dist

        flag = torch.tensor([self.signum, int(failed)], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum, any_failed = flag.tolist()
        return signum, bool(any_failed)

    def describe(self, signum: int) -> str:
        """The stop's cause as this rank knows it (another rank may have received the signal)."""
        return self.reason if self.signum == signum and self.reason else signal.Signals(signum).name


def stop_message(cause: str, step: int, ckpt_root: str, saved: bool) -> str:
    """The one line a stopped run prints (global rank 0)."""
    if saved:
        return (f"ds_mp: stopped by {cause} after step {step}: checkpoint saved in "
                f"{os.path.join(ckpt_root, f'step{step}')}; continue with --resume")
    from ds_mp.checkpoint.training import read_latest

    latest = read_latest(ckpt_root)
    return (f"ds_mp: stopped by {cause} after step {step}, not saved (training.save_on_signal is off); --resume "
            f"continues from {os.path.join(ckpt_root, latest) if latest else 'nothing: no checkpoint yet'}")


def stop_grace_s() -> float:
    """The backstop: one step plus one save, each bounded by the collective timeout
    (``DS_MP_TIMEOUT``, default 300 s)."""
    return 2 * float(os.environ.get("DS_MP_TIMEOUT", "300"))
