"""A run's hold on its output directory: one run at a time, one resume point, bounded disk.

Global rank 0 does all of it and tells the other ranks (:func:`from_rank0`), so every rank of a
job sees the same decision even when the directory changes under it:

* **Lock** (:class:`RunDir`): ``<output_dir>/ds_mp.lock``, an exclusive ``fcntl.flock`` taken before
  the run writes anything and held until it ends; the holder's host, pid and start time are written
  in it.  A second run is refused naming the holder.  The kernel drops a flock when its process
  dies, so a lock left by a killed run is free and is taken over (its old holder is named); a run
  that ends cleanly empties the file.  flock works on local disks and on NFS (lockd); on a
  filesystem without locking (some FUSE mounts) the lock call fails and is reported.
* **Leftovers** of a run killed mid-write (``latest.tmp-PID``, ``stepN.tmp``, ``stepN.old-PID``,
  ``hf.tmp-PID``) are removed at the next start: nobody else writes there while the lock is held.
* **Resume point** (:func:`choose_resume`): ``--resume`` reads ``latest`` once, ``--resume TAG`` that
  tag; a run without ``--resume`` into a directory holding checkpoints is refused.
* **Rotation** (:func:`rotate`): ``training.keep_last`` newest ``stepN`` checkpoints are kept;
  ``latest``'s target is never deleted, nor ``nan-stepN`` diagnostics or tags being written.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from typing import Any, Callable

from ds_mp.checkpoint.sharded import META
from ds_mp.launcher_guard import cmdline
from ds_mp.checkpoint.training import LATEST, damaged_latest, read_latest

LOCK = "ds_mp.lock"
STEP_TAG = re.compile(r"step(\d+)")
_LEFTOVER = re.compile(r".+\.(tmp|tmp-\d+|old-\d+)")  # atomic.py's temporaries in the checkpoint root
_EXPORT_LEFTOVER = re.compile(r"(hf|adapter)\.(tmp|old)-\d+")  # and of the exports in output_dir


class RunDirError(RuntimeError):
    """The output directory cannot be used as asked; one line naming it and the way out."""


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']} since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown holder"


def flock_holders(path: str) -> list[int]:
    """The pids holding a ``flock`` on ``path`` on this machine (Linux ``/proc/locks``; empty when unknown)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return [int(f[4]) for f in (line.split() for line in lines)
            if len(f) > 5 and f[1] == "FLOCK" and f[5] == inode and f[4].isdigit()]


def _in_use(output_dir: str, text: str) -> RunDirError:
    holder, path = _holder(text), os.path.join(output_dir, LOCK)
    pids = flock_holders(path)
    try:
        recorded = int(json.loads(text)["pid"])
    except (ValueError, KeyError, TypeError):
        recorded = None
    if pids and recorded not in pids:  # not the ds_mp run the file names: name the process that holds it
        cmd = " ".join(cmdline(pids[0])).strip()[:120]
        holder = f"pid {pids[0]} ({cmd or '?'}), which is not a ds_mp run, holds a flock on {path}"
    return RunDirError(f"ds_mp.training.output_dir {output_dir!r} is in use by another run ({holder}): wait "
                       "for it to end or stop it, or choose another ds_mp.training.output_dir (--output_dir)")


def check_unlocked(output_dir: str) -> None:
    """Every rank, before any collective (writes nothing): refuse if another run holds the lock.  A
    shared probe, released at once, so the ranks of one job never see each other's; rank 0 then
    takes the lock for real (:meth:`RunDir.lock`), which also catches a run that started since."""
    try:
        fd = os.open(os.path.join(output_dir, LOCK), os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise _in_use(output_dir, os.pread(fd, 4096, 0).decode(errors="replace")) from e
    finally:
        os.close(fd)


class RunDir:
    """Global rank 0's exclusive hold on ``output_dir`` (no-op on other ranks: never opened)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.taken_over: str | None = None  # the dead holder of a stale lock, when one was taken over
        self.holder = ""  # what this run wrote into the lock (every rank reads it back: the shared-disk probe)

    def lock(self, output_dir: str) -> None:
        """Take ``<output_dir>/ds_mp.lock`` or raise :class:`RunDirError` naming its holder."""
        path = os.path.join(output_dir, LOCK)
        try:
            os.makedirs(output_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"ds_mp.training.output_dir: cannot create {path} ({e.strerror}); choose a writable "
                              "directory with free space") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            held = e.errno in (errno.EAGAIN, errno.EACCES)
            text = os.pread(fd, 4096, 0).decode(errors="replace") if held else ""
            os.close(fd)
            if held:
                raise _in_use(output_dir, text) from e
            raise RunDirError(f"{path}: cannot lock ({e.strerror}); put ds_mp.training.output_dir on a filesystem "
                              "with file locks") from e
        old = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        self.taken_over = _holder(old) if old else None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        text = json.dumps(me) + "\n"
        try:
            os.ftruncate(fd, 0)
            if os.pwrite(fd, text.encode(), 0) != len(text.encode()):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)  # on NFS the other nodes read it back (startup.check_shared_output_dir) while it stays open
        except OSError as e:
            os.close(fd)  # drops the lock; an empty lock file would only puzzle the next run
            if not old:
                _remove_quietly(path)
            raise RunDirError(f"{path}: cannot write the run's lock ({e.strerror}): free space on that filesystem "
                              "(df -h) or choose another ds_mp.training.output_dir (--output_dir)") from e
        self.fd, self.holder = fd, text

    def release(self) -> None:
        """Empty the lock file (a clean end) and drop the lock."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def clean_leftovers(output_dir: str, ckpt_root: str) -> list[str]:
    """Remove the temporaries a killed run left (``latest.tmp-PID``, ``stepN.tmp``, ``*.old-PID``,
    ``hf.tmp-PID``) under ``ckpt_root`` and ``output_dir``; returns what was removed.  Call with
    the lock held."""
    removed = []
    for root, pattern in ((ckpt_root, _LEFTOVER), (output_dir, _EXPORT_LEFTOVER)):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            if pattern.fullmatch(name):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
                removed.append(path)
    return removed


def finished_tags(ckpt_root: str) -> list[str]:
    """Finished checkpoints (committed directories with a sharded meta), oldest first by the time
    their meta was written (step number breaks ties)."""
    try:
        names = os.listdir(ckpt_root)
    except OSError:
        return []
    found = []
    for t in names:
        meta = os.path.join(ckpt_root, t, META)
        if not _LEFTOVER.fullmatch(t) and os.path.isfile(meta):
            m = STEP_TAG.fullmatch(t)
            found.append((os.stat(meta).st_mtime_ns, int(m.group(1)) if m else -1, t))
    return [t for *_, t in sorted(found)]


def choose_resume(ckpt_root: str, requested: str | None) -> str | None:
    """The tag every rank loads: None for a fresh run (``requested`` None), ``latest``'s target for
    ``requested == "latest"``, else ``requested`` itself once checked to be a finished checkpoint.
    ``nan-stepN`` diagnostics are not the run's checkpoints: they neither make a fresh start
    refused nor are resumed from through ``latest``."""
    resumable = [t for t in finished_tags(ckpt_root) if not t.startswith("nan-")]
    if requested is None:
        if resumable:
            return _refuse_fresh(ckpt_root, resumable)
        return None
    if requested == LATEST:
        tag = read_latest(ckpt_root)  # a damaged pointer raises naming the tags that exist
        if tag is not None and tag not in resumable:
            raise damaged_latest(ckpt_root, f"it names {tag!r}, which is not a finished checkpoint here")
        if tag is not None:
            return tag
        if resumable:
            raise RunDirError(f"--resume: {os.path.join(ckpt_root, LATEST)} is missing or empty, but finished "
                              f"checkpoints exist; the newest is {resumable[-1]!r}: continue it with --resume "
                              f"{resumable[-1]}")
        diagnostics = " (only NaN diagnostics, which are not resumed from)" if finished_tags(ckpt_root) else ""
        raise RunDirError(f"--resume: no finished checkpoint under {ckpt_root}{diagnostics}; run without --resume "
                          "first")
    if requested not in finished_tags(ckpt_root):
        found = ", ".join(resumable[-5:]) or "none"
        raise RunDirError(f"--resume {requested}: {os.path.join(ckpt_root, requested)} is not a finished checkpoint "
                          f"(found: {found}); pass one of those, or plain --resume for the latest")
    return requested


def _refuse_fresh(ckpt_root: str, resumable: list[str]) -> None:
    newest = f" (newest: {resumable[-1]})" if resumable else ""
    raise RunDirError(f"{ckpt_root} already holds checkpoints{newest} and this run has no --resume: continue them "
                      "with --resume, or start afresh in a new ds_mp.training.output_dir (--output_dir)")


def rotate(ckpt_root: str, keep_last: int) -> list[str]:
    """Delete all but the ``keep_last`` newest finished ``stepN`` checkpoints (0: keep all).

    Never deleted: ``latest``'s target, tags not named ``stepN`` (``nan-stepN`` diagnostics, your
    own tags) and unfinished ``*.tmp`` directories.  Each doomed directory is first renamed to
    ``<tag>.old-PID`` (so a kill mid-delete leaves no half checkpoint that looks finished), then
    removed.  Returns the deleted tags.  Call on global rank 0 after a save has committed."""
    if keep_last <= 0:
        return []
    latest = read_latest(ckpt_root)
    steps = [t for t in finished_tags(ckpt_root) if STEP_TAG.fullmatch(t)]
    doomed = [t for t in steps[:-keep_last] if t != latest]
    for tag in doomed:
        aside = os.path.join(ckpt_root, f"{tag}.old-{os.getpid()}")
        os.rename(os.path.join(ckpt_root, tag), aside)
        shutil.rmtree(aside)
    return doomed


def open_run_dir(run_dir: RunDir, output_dir: str, ckpt_root: str, requested: str | None) -> tuple[str | None,
                                                                                                  list[str]]:
    """Rank 0's start of a run: lock ``output_dir``, clean leftovers, choose the resume tag.
    Returns (tag or None, notes to print)."""
    run_dir.lock(output_dir)
    notes = []
    if run_dir.taken_over:
        notes.append(f"ds_mp: took over {os.path.join(output_dir, LOCK)} from a run that ended without releasing "
                     f"it ({run_dir.taken_over})")
    removed = clean_leftovers(output_dir, ckpt_root)
    if removed:
        notes.append(f"ds_mp: removed {len(removed)} leftover(s) of an interrupted run: "
                     + ", ".join(os.path.basename(p) for p in removed))
    return choose_resume(ckpt_root, requested), notes


def from_rank0(fn: Callable[[], Any], device: Any) -> Any:
    """Collective: global rank 0 runs ``fn``; every rank returns its result, or raises
    :class:`RunDirError` with rank 0's message if it failed (one ``broadcast_object_list`` on
    ``device``, the accelerator's device: NCCL carries no CPU tensors)."""
    import torch.distributed as dist

    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("ok", fn())]
        except RunDirError as e:
            payload = [("error", str(e))]
        except Exception as e:  # noqa: BLE001 - every rank fails with it below
            payload = [("error", f"{type(e).__name__}: {e}")]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0, device=device)
    status, value = payload[0]
    if status == "error":
        raise RunDirError(value)
    return value
