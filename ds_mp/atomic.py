"""Crash-safe directory and file writes.

A checkpoint or export is written into a temporary sibling directory and renamed onto
its final name only when complete, after every file in it has been fsynced.  A crash
therefore leaves either the previous output or no output, never a half-written one
(at worst a stale ``*.tmp*`` sibling, removed by the next write).  ``rename`` is atomic
on POSIX within one filesystem, which is why the temporary directory lives beside the
target rather than in ``/tmp``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Flush every file under ``path`` (and the directories themselves) to disk."""
    for root, _, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(root, name))
        _fsync_path(root)


def fresh_dir(path: str) -> str:
    """Create ``path`` empty (removing a stale leftover of an earlier crash)."""
    if os.path.lexists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def commit_dir(tmp: str, out: str, overwrite: bool = False) -> None:
    """Move the finished ``tmp`` onto ``out``: fsync, then rename.

    With ``overwrite`` an existing ``out`` is first renamed aside and deleted only after
    the new directory is in place, so some complete version exists at every instant.
    """
    fsync_tree(tmp)
    old = None
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{out!r} already exists; remove it or choose another output path")
        old = f"{out}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync_path(os.path.dirname(os.path.abspath(out)))
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def atomic_dir(out: str, overwrite: bool = False) -> Iterator[str]:
    """``with atomic_dir(out) as tmp:`` write files into ``tmp``; on success it becomes ``out``.

    On an exception the temporary directory is removed and ``out`` is untouched.
    """
    out = os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"{out!r} already exists; remove it or choose another output path")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = fresh_dir(f"{out}.tmp-{os.getpid()}")
    try:
        yield tmp
        commit_dir(tmp, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str, text: str) -> None:
    """Replace the file ``path`` with ``text`` in one step (temp file + ``os.replace``)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))
