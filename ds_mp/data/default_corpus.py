"""The embedded default corpus: the running interpreter's standard library sources.

It needs no download, is identical on every machine with the same Python version, and
is code-heavy text large enough to train a small GPT-2. The first ``max_bytes`` of the
sorted ``*.py`` files (test folders, ``site-packages`` and ``test_*.py`` excluded) are
used so the build stays fast.
"""
from __future__ import annotations

import fcntl
import os
import sys
import sysconfig
from typing import Any

from .checks import check_token_ids
from .dataset import TokenDataset
from .errors import DataError
from .prepare import META_FILE, prepare_data

DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_CACHE_DIR = os.environ.get("DS_MP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ds_mp"))
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[str]:
    """The interpreter's stdlib ``*.py`` files, sorted by relative path, tests excluded."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS)
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py") and not n.startswith("test_")]
    return sorted(files, key=lambda p: os.path.relpath(p, root).split(os.sep))


def default_dataset_key(vocab_size: int = DEFAULT_VOCAB_SIZE, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Cache folder name: changes whenever the content could (Python version, vocab, size)."""
    v = sys.version_info
    return f"stdlib-py{v.major}.{v.minor}.{v.micro}-v{vocab_size}-b{max_bytes}"


def ensure_default_dataset(cache_dir: str = DEFAULT_CACHE_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           max_bytes: int = DEFAULT_MAX_BYTES, show_progress: bool = False) -> str:
    """Build the stdlib dataset under ``cache_dir`` once and return its directory.

    Contract: a later call with the same arguments returns the cached directory without
    rebuilding; concurrent callers (e.g. every rank of a launcher) build it once, the
    others wait on a file lock. 2% of the files are held out for validation.
    """
    out_dir = os.path.join(os.path.abspath(cache_dir), default_dataset_key(vocab_size, max_bytes))
    if os.path.isfile(os.path.join(out_dir, META_FILE)):
        return out_dir
    os.makedirs(cache_dir, exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(out_dir, META_FILE)):
            prepare_data(stdlib_files(), out_dir, None, vocab_size, max_bytes, val_fraction=0.02, seed=0,
                         encoding_errors="replace", overwrite=True, show_progress=show_progress)
    return out_dir


def datasets_for(cfg: Any) -> tuple[str, Any, Any]:
    """``(path, train, val)`` of a validated ds_mp config: ``data.path`` or the embedded default
    corpus (built once into ``data.cache_dir``); checks length, vocabulary and every token id
    (:mod:`ds_mp.data.checks`) before any collective."""
    cache = cfg.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ds_mp")
    path = cfg.data.path or ensure_default_dataset(cache, cfg.data.vocab_size)
    train, val = TokenDataset(path, "train"), TokenDataset(path, "val")
    if train.info.format == "stream":  # SFT datasets are checked when their rows are planned (ds_mp.data.sft)
        train.num_chunks(cfg.data.seq_len)  # DataError if shorter than a sequence
        if len(val):  # an empty val split (--val-fraction 0): no validation (ds_mp.data.validation)
            val.num_chunks(cfg.data.seq_len)
    if train.vocab_size > cfg.shape.vocab_size:
        raise DataError(f"data: tokenizer vocab {train.vocab_size} exceeds the model's vocab_size "
                        f"{cfg.shape.vocab_size}; raise ds_mp.model.vocab_size or use the model's tokenizer")
    for split in (train, val):  # every id below both vocabularies (one cached pass over each file)
        check_token_ids(split, cfg.shape.vocab_size, cache)
    return path, train, val
