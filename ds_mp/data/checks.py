"""Checks of a prepared dataset against the model it will train, run at open (no collective).

* **Token range.** Every id in a token file must be below its own tokenizer's vocabulary
  (``meta.json``'s ``vocab_size``), which must not exceed the model's ``vocab_size``
  (:func:`~ds_mp.data.default_corpus.datasets_for` checks that).  An id at or above the model's
  vocab would be masked by the vocab-parallel embedding at TP >= 2 (a zero embedding, silently)
  and fail in ``F.embedding`` at TP = 1.  An id between the dataset's vocab and the model's is a
  real embedding row, but one no token of the dataset's tokenizer maps to: the token file is
  not what ``meta.json`` says (damaged, or concatenated from another encoding), so it is refused
  as well, not trained on.  :func:`max_token_id` finds the largest id in one streamed pass
  (:data:`CHUNK_TOKENS` at a time); the result is cached in ``<dataset>/token_stats.json``
  (or, for a read-only dataset, under the ds_mp cache), keyed by the file's size, mtime, ctime,
  inode and the dataset's ``sha256``, so later opens read no token (a file rewritten in place with
  its mtime put back still has a new ctime, which no user can set back).
* **Tokenizer identity.** :func:`tokenizer_mismatch` compares the dataset's tokenizer with the
  model directory's (vocabulary, merges and added tokens of their ``tokenizer.json``): ids
  encoded by one mean other text to the other even when the sizes agree.  A warning, not an
  error: the user may mean it (a new tokenizer on a pretrained body), and a model directory
  without ``tokenizer.json`` leaves nothing to compare.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from ds_mp.atomic import write_text_atomic

from .errors import DataError

STATS_FILE = "token_stats.json"
CHUNK_TOKENS = 1 << 24  # tokens read per step of the max-id pass (32 MiB of uint16)
TOKENIZER_JSON = "tokenizer.json"


def _scan_max(tokens: np.ndarray) -> int:
    """The largest value of ``tokens`` (-1 if empty), read :data:`CHUNK_TOKENS` at a time."""
    top = -1
    for start in range(0, len(tokens), CHUNK_TOKENS):
        top = max(top, int(tokens[start:start + CHUNK_TOKENS].max()))
    return top


def _stats_paths(dataset_dir: str, cache_dir: str | None) -> list[str]:
    """Where the cached ids may live: the dataset's own folder, then the cache (read-only data)."""
    paths = [os.path.join(dataset_dir, STATS_FILE)]
    if cache_dir:
        key = hashlib.sha256(os.path.abspath(dataset_dir).encode()).hexdigest()[:16]
        paths.append(os.path.join(cache_dir, "token_stats", f"{key}.json"))
    return paths


def _read_stats(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            stats = json.load(f)
        return stats if isinstance(stats, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: recomputed


def max_token_id(dataset: Any, cache_dir: str | None = None) -> int:
    """The largest token id of ``dataset`` (a :class:`~ds_mp.data.dataset.TokenDataset`), -1 if it
    is empty: cached by file name, size, mtime, ctime, inode and the dataset's sha256, else one streamed pass."""
    info, tokens = dataset.info, dataset.tokens
    file = getattr(tokens, "filename", None)
    if file is None:  # an empty split: nothing mapped
        return -1
    st = os.stat(file)
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": info.sha256,  # ctime and inode: a rewrite
           "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}  # in place with its mtime put back (touch -r) still shows
    name = os.path.basename(file)
    paths = _stats_paths(info.path, cache_dir)
    for path in paths:
        entry = _read_stats(path).get(name)
        if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and isinstance(entry.get("max_id"), int):
            return entry["max_id"]
    top = _scan_max(tokens)
    for path in paths:  # the first place this process may write
        try:
            stats = _read_stats(path)
            stats[name] = {**key, "max_id": top}
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_text_atomic(path, json.dumps(stats, indent=1, sort_keys=True) + "\n")
            break
        except OSError:
            continue
    return top


def check_token_ids(dataset: Any, model_vocab: int, cache_dir: str | None = None) -> None:
    """Refuse ``dataset`` (:class:`DataError` naming the file, its largest id and the vocab) when a
    token id is >= the model's ``model_vocab`` or >= the dataset's own tokenizer vocab."""
    top = max_token_id(dataset, cache_dir)
    file = getattr(dataset.tokens, "filename", dataset.info.path)
    if top >= model_vocab:
        raise DataError(f"{file}: token id {top} >= the model's vocab_size {model_vocab}; the data was encoded "
                        "for a larger vocabulary: re-encode it with the model's tokenizer (ds-mp prepare-data "
                        "--tokenizer MODEL_DIR) or raise ds_mp.model.vocab_size")
    if top >= dataset.info.vocab_size:
        raise DataError(f"{file}: token id {top} >= vocab_size {dataset.info.vocab_size} of the dataset's own "
                        f"tokenizer ({dataset.info.tokenizer_dir}); the token file does not match its meta.json "
                        "(damaged or mixed encodings): rebuild the dataset with ds-mp prepare-data")


def tokenizer_fingerprint(tokenizer_dir: str) -> str | None:
    """sha256 (hex) of the vocabulary, merges and added tokens in ``tokenizer_dir/tokenizer.json``,
    or None without a readable one.  Serialisation details (merges as "a b" or ["a", "b"],
    normalizer and decoder settings) do not count: only what maps text to ids."""
    try:
        with open(os.path.join(tokenizer_dir, TOKENIZER_JSON), encoding="utf-8") as f:
            spec = json.load(f)
        model = dict(spec["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    merges = model.get("merges") or []
    model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in merges]
    added = sorted((t.get("id"), t.get("content")) for t in spec.get("added_tokens") or [])
    blob = json.dumps({"model": model, "added": added}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def tokenizer_mismatch(info: Any, model_dir: str | None) -> str | None:
    """A one-line warning when the dataset's tokenizer (``info``: its :class:`DatasetInfo`)
    differs from the tokenizer in ``model_dir``; None when they agree or there is nothing to
    compare (no model directory, or either side without ``tokenizer.json``)."""
    if not model_dir:
        return None
    theirs, ours = tokenizer_fingerprint(info.tokenizer_dir), tokenizer_fingerprint(model_dir)
    if theirs is None or ours is None or theirs == ours:
        return None
    data_name = info.tokenizer_source or f"trained by prepare-data in {info.tokenizer_dir}"
    return (f"ds_mp: warning: dataset {info.path} was encoded with tokenizer {data_name} (sha256 {theirs[:12]}), "
            f"the model {model_dir} has another (sha256 {ours[:12]}): its ids mean other tokens to this model; "
            f"re-encode with `ds-mp prepare-data --tokenizer {model_dir}` unless that is intended")
