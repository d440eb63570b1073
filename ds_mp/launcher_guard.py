"""A rank never outlives its launcher, from its first moment (armed by ``import ds_mp``).

DeepSpeed's ``launch.py`` starts each rank as ``python script.py --local_rank=N`` with
``CROSS_SIZE`` in its environment.  When ``ds_mp`` is first imported in such a process,
:func:`arm` (before ``torch`` is imported):

1. records the launcher chain as it is at spawn: ``launch.py`` (the parent) and the ``deepspeed``
   runner above it (:class:`Chain`); later checks compare the parent with the *recorded* pid, never
   with "whoever the parent is now" (an orphan is re-parented to init or a subreaper);
2. sets ``PR_SET_PDEATHSIG`` (SIGTERM when ``launch.py`` dies), then re-reads the parent: a parent
   that died before the ``prctl`` sends nothing, so that case is checked by hand;
3. a rank whose launcher is already gone (the parent is not ``launch.py``, or ``launch.py`` was
   re-parented to init: the runner died) exits at once with one line;
4. until the run takes the signals over (:class:`~ds_mp.training.signals.StopFlag`), SIGTERM/SIGINT
   and the launcher's end exit the rank at once with one line and ``128 + signal``: a rank importing
   torch or waiting in the rendezvous has nothing to save (a script's own loop after
   ``ds_mp.initialize``, which no StopFlag takes over, is told apart: :func:`guard_exit`).  A thread
   watches both (the signals through ``signal.set_wakeup_fd``, so a main thread blocked in C, e.g. in
   the rendezvous, does not delay it).

A process that was not started by ``launch.py`` (a test, ``torchrun``, a notebook) is left alone,
and so is a process a rank starts (``DS_MP_RANK_PID`` in its environment).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass

LAUNCH_MODULE = "deepspeed.launcher.launch"
RUNNER_NAMES = ("deepspeed", "ds")
HANDLED = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Chain:
    """The pids above this rank recorded at spawn: ``launch.py`` and the ``deepspeed`` runner
    (None where this process was not started that way)."""
    launch: int | None = None
    runner: int | None = None


def read_proc(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def ppid_of(pid: int | None) -> int | None:
    """The parent of ``pid`` (Linux ``/proc``), None if it is gone or unknown."""
    stat = read_proc(f"/proc/{pid}/stat") if pid else ""
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else None


def cmdline(pid: int | None) -> list[str]:
    return read_proc(f"/proc/{pid}/cmdline").split("\0") if pid else []


def is_runner(pid: int | None) -> bool:
    cmd = cmdline(pid)
    return any(os.path.basename(a) in RUNNER_NAMES or a == "deepspeed.launcher.runner" for a in cmd[:3])


def spawned_by_launch() -> bool:
    """This process is a rank ``launch.py`` started (its marks, whoever the parent is now)."""
    return ("CROSS_SIZE" in os.environ and "DS_MP_RANK_PID" not in os.environ
            and any(a.startswith("--local_rank=") for a in sys.argv))


def current_chain() -> Chain:
    """The chain as it is now: ``launch.py`` if it is the parent, and its parent if a runner."""
    parent = os.getppid()
    if LAUNCH_MODULE not in cmdline(parent):
        return Chain()
    grand = ppid_of(parent)
    return Chain(parent, grand if is_runner(grand) else None)


def set_parent_death_signal(signum: int) -> None:
    """prctl(PR_SET_PDEATHSIG, signum): the kernel sends ``signum`` when the parent dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def gone(chain: Chain) -> str | None:
    """Which recorded launcher has ended (a sentence), None while both live."""
    if chain.launch is not None and os.getppid() != chain.launch:
        return f"its launcher launch.py (pid {chain.launch}) ended"
    if chain.runner is not None and ppid_of(chain.launch) != chain.runner:
        return f"the deepspeed launcher (pid {chain.runner}) ended"
    if chain.launch is not None and chain.runner is None and ppid_of(chain.launch) == 1:
        return f"the deepspeed launcher above launch.py (pid {chain.launch}) ended"
    return None


def startup_exit(cause: str, code: int) -> None:
    """End this rank now, during start-up: nothing was trained or saved (the kernel drops its locks)."""
    rank = os.environ.get("RANK", "?")
    print(f"ds_mp: rank {rank} stopped during start-up: {cause}; nothing was trained or saved: start the job "
          "again", file=sys.stderr, flush=True)
    os._exit(code)


def guard_exit(cause: str, code: int) -> None:
    """The guard ends this rank: during start-up with :func:`startup_exit`'s line; after
    ``ds_mp.initialize`` built an engine (:func:`engine_built`: a script's own loop, which the guard
    still watches) with one saying that this loop does not save on a signal."""
    guard = armed()
    if guard is None or not guard.engine_built:
        startup_exit(cause, code)
    print(f"ds_mp: rank {os.environ.get('RANK', '?')} stopped by {cause}: this script's training loop does not stop "
          "on a signal (launch/train.py and ds_mp.hf's trainer.train() save, then stop every rank); nothing was "
          "saved on the signal", file=sys.stderr, flush=True)
    os._exit(code)


def startup_handler(signum: int, frame: object) -> None:
    """The guard's signal handler (a run's :class:`~ds_mp.training.signals.StopFlag` replaces it and,
    when done, restores the default instead: after the run its line would not be true)."""
    guard_exit(signal.Signals(signum).name, 128 + signum)


class Guard:
    """The start-up watch (see the module doc); :meth:`disarm` hands over to the run's own."""

    def __init__(self, chain: Chain, poll_s: float = 0.2) -> None:
        self.chain, self.poll_s = chain, poll_s
        self.engine_built = False  # set by engine_built(): start-up is over for a script's own loop
        self._done = threading.Event()
        self.wakeup_r: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "Guard":
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                signal.signal(s, startup_handler)
            self.wakeup_r, w = os.pipe()
            os.set_blocking(self.wakeup_r, False)
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="ds_mp-launcher-guard")
        self._thread.start()
        return self

    def signals(self, timeout: float) -> list[int]:
        """The signals delivered since the last call (waits up to ``timeout`` for one)."""
        if self.wakeup_r is None:
            self._done.wait(timeout)
            return []
        import select

        ready, _, _ = select.select([self.wakeup_r], [], [], timeout)
        try:
            return list(os.read(self.wakeup_r, 64)) if ready else []
        except BlockingIOError:
            return []

    def disarm(self) -> None:
        """Stop this thread (the run's :class:`StopFlag` watches from now on, through :meth:`signals`)."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.is_set():
            got = [s for s in self.signals(self.poll_s) if s in HANDLED]
            if self._done.is_set():
                return
            if got:
                guard_exit(signal.Signals(got[0]).name, 128 + got[0])
            why = gone(self.chain)
            if why:
                guard_exit(why, 128 + signal.SIGTERM)


_GUARD: list[Guard] = []  # the one guard of this process (armed at most once)


def arm() -> Guard | None:
    """Called by ``import ds_mp``: record the chain, set the death signal, refuse an orphan, watch."""
    if _GUARD:
        return _GUARD[0]
    chain = current_chain()
    if chain.launch is None:
        if spawned_by_launch():  # launch.py's marks, but launch.py is not the parent any more
            startup_exit(f"its launcher launch.py ended before the rank started (parent now pid {os.getppid()})",
                         128 + signal.SIGTERM)
        return None
    os.environ["DS_MP_RANK_PID"] = str(os.getpid())  # processes this rank starts are not ranks
    set_parent_death_signal(signal.SIGTERM)
    why = gone(chain)  # a parent that died before the prctl sent nothing
    if why:
        startup_exit(why, 128 + signal.SIGTERM)
    _GUARD.append(Guard(chain).start())
    return _GUARD[0]


def engine_built() -> None:
    """Called by ``ds_mp.initialize``: from now on the guard's line no longer says "start-up"."""
    if _GUARD:
        _GUARD[0].engine_built = True


def armed() -> Guard | None:
    """This process's guard, None when it was not started by ``launch.py``."""
    return _GUARD[0] if _GUARD else None
