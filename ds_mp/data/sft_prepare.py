"""Build an SFT dataset: records -> tokens, loss mask, document boundaries (``ds-mp prepare-data --format``).

Output layout (beside the pretraining files, so token-level tools read both alike)::

    tokens.bin / val_tokens.bin          every document's ids back to back (uint16 or uint32), no separator
    loss_mask.bin / val_loss_mask.bin    one uint8 per token: 1 = the token is a target (sft_format)
    documents.bin / val_documents.bin    int64 offsets, n_documents + 1 of them: document d = [o[d], o[d+1])
    meta.json                            "format": "chat" | "prompt-completion" | "text", and an "sft"
                                         block: pad id, max_tokens, overlong policy and its counts
    tokenizer/                           the tokenizer, with the chat template used (if any)

Inputs are ``.jsonl`` files (one record per line), ``.parquet`` / ``.arrow`` files (read with HF
``datasets``, ``pip install ds_mp[sft]``), or in Python a list of dicts or a ``datasets.Dataset``.
``val_fraction`` of the records (seeded) are held out whole. Records longer than ``max_tokens``
are cut to their first ``max_tokens`` tokens (``overlong="truncate"``; dropped if no target is
left) or dropped (``"drop"``); both are counted in meta.json and in the returned info.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from .corpus import find_files
from .errors import DataError
from .prepare import META_FILE, TOKENIZER_DIR, TRAIN_FILE, VAL_FILE, DatasetInfo, _check_out_dir, staging_dir
from .sft_format import FORMATS, check_chat_template, encode_record
from .tokenizer import load_tokenizer

MASK_FILES = ("loss_mask.bin", "val_loss_mask.bin")  # (train, val)
DOC_FILES = ("documents.bin", "val_documents.bin")
OVERLONG = ("truncate", "drop")
BAD_RECORDS = ("error", "skip")
TABLE_SUFFIXES = (".parquet", ".arrow")


def _table_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading {os.path.splitext(path)[1]} files needs HF datasets; "
                        "pip install 'ds_mp[sft]' (or convert the file to .jsonl)") from None
    ds = datasets.Dataset.from_parquet(path) if path.endswith(".parquet") else datasets.Dataset.from_file(path)
    for i, row in enumerate(ds):
        yield f"{path}: row {i}", row


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip().lstrip("\ufeff")
            except UnicodeDecodeError as e:
                yield f"{path}:{lineno}", DataError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); convert the "
                                                    "file to UTF-8")
                continue
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                record = DataError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}); fix or remove the line")
            yield f"{path}:{lineno}", record


def iter_records(inputs: Sequence[str] | Iterable[dict]) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of every record: files (``.jsonl``, ``.parquet``, ``.arrow``, or folders of
    ``.jsonl``), or the rows of a list of dicts / ``datasets.Dataset`` (``where`` = ``record N``).
    A JSONL line that cannot be read yields its :class:`DataError` as the record."""
    items = list(inputs) if isinstance(inputs, (list, tuple)) else None
    if items is not None and all(isinstance(x, str) for x in items):
        for path in find_files(items):
            if path.endswith(TABLE_SUFFIXES):
                yield from _table_rows(path)
            elif path.endswith(".jsonl"):
                yield from _jsonl_rows(path)
            else:
                raise DataError(f"{path}: SFT data must be .jsonl, .parquet or .arrow; convert it to JSON lines")
        return
    for i, row in enumerate(items if items is not None else inputs):
        yield f"record {i}", row


def _split(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out records: a seeded subset of round(n * f) (>= 1 if f > 0), one left to train."""
    held = np.zeros(n, dtype=bool)
    if val_fraction > 0:
        k = max(1, round(n * val_fraction))
        if k >= n:
            raise DataError(f"val_fraction={val_fraction} leaves no training records ({n} records); "
                            "lower --val-fraction (0 disables validation) or add records")
        held[np.random.default_rng(seed).permutation(n)[:k]] = True
    return held


def encode_documents(inputs: Sequence[str] | Iterable[dict], tok: Any, fmt: str, max_tokens: int | None = None,
                     overlong: str = "truncate", bad_records: str = "error", counts: dict | None = None,
                     show_progress: bool = False) -> Iterator[tuple[str, Any, list[int], list[int]]]:
    """``(where, record, ids, mask)`` of every record kept: encoded (:func:`encode_record`), cut or
    dropped over ``max_tokens`` (``overlong``), dropped without a target token.  A bad record (no
    assistant turn, a missing field, invalid JSON, ...) raises its :class:`DataError` naming
    file:line, or with ``bad_records="skip"`` is skipped; ``counts`` (filled in place) holds
    records read, truncated, dropped, no_target, bad, and the first few bad records' messages."""
    if bad_records not in BAD_RECORDS:
        raise DataError(f"bad_records={bad_records!r} is unknown; use 'error' or 'skip' (--bad-records)")
    counts = {} if counts is None else counts
    counts.update(records=0, truncated=0, dropped=0, no_target=0, bad=0, bad_examples=[])
    for where, record in tqdm(iter_records(inputs), desc="encoding", unit=" records", disable=not show_progress):
        counts["records"] += 1
        try:
            if isinstance(record, DataError):
                raise record
            ids, mask = encode_record(tok, fmt, record, where)
        except DataError as e:
            if bad_records == "error":
                raise
            counts["bad"] += 1
            if len(counts["bad_examples"]) < 3:
                counts["bad_examples"].append(str(e))
            continue
        if max_tokens is not None and len(ids) > max_tokens:
            if overlong == "drop" or not any(mask[:max_tokens]):
                counts["dropped"] += 1
                continue
            ids, mask, counts["truncated"] = ids[:max_tokens], mask[:max_tokens], counts["truncated"] + 1
        if not any(mask[1:]):  # the first token of a document is never a target
            counts["no_target"] += 1
            continue
        yield where, record, ids, mask


def load_sft_tokenizer(tokenizer: str, fmt: str, chat_template: str | None = None) -> Any:
    """``tokenizer`` (an HF directory) with ``chat_template`` (Jinja text, or a file holding it)
    in place of its own; for ``fmt="chat"`` its template is checked (:func:`check_chat_template`)."""
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is unknown; use one of {', '.join(FORMATS)} (--format)")
    tok = load_tokenizer(tokenizer)
    if chat_template is not None:
        tok.chat_template = open(chat_template).read() if os.path.isfile(chat_template) else chat_template
    if fmt == "chat":
        check_chat_template(tok, tokenizer)
    return tok


def prepare_sft_data(
    inputs: Sequence[str] | Iterable[dict],
    out_dir: str,
    tokenizer: str,
    fmt: str,
    *,
    chat_template: str | None = None,
    max_tokens: int | None = None,
    overlong: str = "truncate",
    val_fraction: float = 0.01,
    seed: int = 0,
    overwrite: bool = False,
    show_progress: bool = True,
    bad_records: str = "error",
) -> DatasetInfo:
    """Encode SFT records into a dataset at ``out_dir`` (layout in the module docstring).

    ``tokenizer`` is an HF checkpoint/tokenizer directory; ``chat_template`` (Jinja text, or a
    file holding it) replaces or supplies its chat template. Contract: deterministic for the
    same inputs and arguments; the output appears atomically; a bad record raises
    :class:`DataError` naming its file and line (or row / record index), unless
    ``bad_records="skip"``: then it is skipped and counted (meta.json's ``sft.bad``).
    """
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is unknown; use one of {', '.join(FORMATS)} (--format)")
    if bad_records not in BAD_RECORDS:
        raise DataError(f"bad_records={bad_records!r} is unknown; use 'error' or 'skip' (--bad-records)")
    if overlong not in OVERLONG:
        raise DataError(f"overlong={overlong!r} is unknown; use 'truncate' or 'drop' (--overlong)")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"max_tokens={max_tokens} must be at least 2 (--max-tokens)")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1); e.g. --val-fraction 0.01")
    _check_out_dir(out_dir, overwrite)
    tok = load_sft_tokenizer(tokenizer, fmt, chat_template)
    docs, counts, h, sources = [], {}, hashlib.sha256(), []
    for where, record, ids, mask in encode_documents(inputs, tok, fmt, max_tokens, overlong, bad_records, counts,
                                                     show_progress):
        src = where.rsplit(":", 1)[0] if ":" in where else None
        if src and (not sources or sources[-1] != src):
            sources.append(src)
        h.update(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        docs.append((ids, mask))
    if not docs:
        raise DataError(f"no record left after filtering ({counts['records']} read, {counts['dropped']} dropped as "
                        f"over --max-tokens={max_tokens}, {counts['no_target']} without a target token, "
                        f"{counts['bad']} bad); raise --max-tokens or check the data")
    held = _split(len(docs), val_fraction, seed)
    vocab, eos = len(tok), int(tok.eos_token_id)
    dtype = np.uint16 if vocab < 65536 else np.uint32
    out_dir = os.path.abspath(out_dir)
    totals = {}
    with staging_dir(out_dir, overwrite) as tmp:
        tok.save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
        for s, (tok_file, mask_file, doc_file) in enumerate(zip((TRAIN_FILE, VAL_FILE), MASK_FILES, DOC_FILES)):
            part = [d for d, v in zip(docs, held) if v == bool(s)]
            lengths = np.array([len(ids) for ids, _ in part], dtype=np.int64)
            ids = np.concatenate([np.asarray(i, dtype=dtype) for i, _ in part]) if part else np.empty(0, dtype)
            mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in part]) if part else np.empty(0, np.uint8)
            ids.tofile(os.path.join(tmp, tok_file))
            mask.tofile(os.path.join(tmp, mask_file))
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tofile(os.path.join(tmp, doc_file))
            totals[s] = (len(ids), len(part), int(mask.sum()))
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        info = DatasetInfo(
            path=out_dir, dtype=np.dtype(dtype).name, vocab_size=vocab, eos_id=eos,
            train_tokens=totals[0][0], val_tokens=totals[1][0], train_documents=totals[0][1],
            val_documents=totals[1][1], sha256=h.hexdigest(), source_files=[os.path.abspath(p) for p in sources],
            tokenizer_source=tokenizer, val_fraction=val_fraction, seed=seed, format=fmt,
            sft={"pad_id": int(pad), "max_tokens": max_tokens, "overlong": overlong, **counts,
                 "train_targets": totals[0][2], "val_targets": totals[1][2]},
        )
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            f.write(info.to_json())
    return info
