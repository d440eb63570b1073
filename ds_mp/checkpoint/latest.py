"""The ``latest`` pointer of a checkpoint root: the one file that says which tag ``--resume`` and
``load_checkpoint(engine, root)`` continue from.  It is read as one plain UTF-8 tag name; bytes
that are not, NULs, a path (``../..``: out of the run) or a ``nan-stepN`` diagnostic are refused as
damaged, naming the finished checkpoints that exist (before the engine is built)."""
from __future__ import annotations

import os

from ds_mp.checkpoint.sharded import META, CheckpointError

LATEST = "latest"


def read_latest(ckpt_root: str) -> str | None:
    """The tag ``<ckpt_root>/latest`` points at, or None when there is no finished checkpoint.
    A pointer that is not one plain UTF-8 name (other bytes, NULs, a path such as ``../..`` that
    leads out of ``ckpt_root``) raises :class:`CheckpointError` naming the tags that exist."""
    path = os.path.join(ckpt_root, LATEST)
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise damaged_latest(ckpt_root, "it holds bytes that are not UTF-8") from None
    if not tag:
        return None
    if any(c in tag for c in "\0\n/" + os.sep) or tag in (".", ".."):
        raise damaged_latest(ckpt_root, f"it names {tag[:40]!r}, not one checkpoint directory of this run")
    return tag


def damaged_latest(ckpt_root: str, why: str) -> CheckpointError:
    """The one line for a ``latest`` pointer that cannot be followed: which tags exist instead."""
    regular = [t for t in tags(ckpt_root) if not t.startswith("nan-")]
    found = ", ".join(regular[-5:]) or "none"
    fix = f"resume one with --resume TAG or write its name into {os.path.join(ckpt_root, LATEST)}" if regular else \
        "remove it and start without --resume"
    return CheckpointError(f"{os.path.join(ckpt_root, LATEST)} is damaged: {why} (finished checkpoints here: "
                           f"{found}); {fix}")


def resolve_checkpoint(path: str) -> str:
    """``path`` itself, or (a checkpoint root) the directory its ``latest`` pointer names."""
    tag = read_latest(path)
    return os.path.join(path, tag) if tag else path


def latest_tag(ckpt_root: str) -> str:
    tag = read_latest(ckpt_root)
    if tag is None:
        raise CheckpointError(f"{ckpt_root}: no '{LATEST}' file, so no finished checkpoint; pass tag= "
                              "or check the path")
    if tag.startswith("nan-"):  # diagnostics never move latest: a hand-made pointer
        raise damaged_latest(ckpt_root, f"it names the NaN diagnostic {tag!r}, which is never resumed from")
    return tag


def tags(ckpt_root: str) -> list[str]:
    """The finished checkpoints under ``ckpt_root`` (directories with a sharded meta)."""
    try:
        return sorted(t for t in os.listdir(ckpt_root) if os.path.isfile(os.path.join(ckpt_root, t, META)))
    except OSError:
        return []
