"""``ds-mp show-rows``: a packed SFT training row, decoded, as the model sees it.

A row is what :meth:`ds_mp.data.sft.SftRows.batch` hands the engine: ``input_ids``, ``position_ids``
(restarting at 0 where a document starts) and ``labels`` (HF's convention: ``labels[t]`` is the target
predicted at t-1, -100 = none).  The same plan as training (``seq_len``, ``packing``, ``overlong``,
``seed`` of ``ds_mp.data``, from ``--config`` or the flags) gives the same rows; row N is the plan's
N-th row (the sampler visits them in a seeded order per epoch).  Printed per row::

    row 3 of 57 (train, seq_len 256): 4 documents, 131 targets, 9 padding tokens
    --- document 1 of 4: dataset document 17, tokens [0, 83), 40 targets
    <|im_start|>user
    why is the sky blue<|im_end|>
    <|im_start|>assistant
    [[because ...<|im_end|>]]
    --- padding: tokens [247, 256)

Text between ``[[`` and ``]]`` (``--mark``) is target tokens: the loss is computed on them, each
predicted from the tokens before it in its own document.  ``--tokens`` adds one line per token
(index, position, id, target or not, the token's text).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .dataset import TokenDataset
from .errors import DataError
from .prepare import TOKENIZER_DIR
from .sft import IGNORE, SftDataset, SftRows


def _segments(ids: np.ndarray, target: np.ndarray) -> list[tuple[bool, np.ndarray]]:
    """``ids`` cut where ``target`` changes: ``[(is_target, ids), …]`` in order."""
    cuts = np.flatnonzero(np.diff(target.astype(np.int8))) + 1
    return [(bool(target[s[0] if len(s) else 0]), ids[s]) for s in np.split(np.arange(len(ids)), cuts) if len(s)]


def describe_row(rows: SftRows, row: int, tokenizer: Any, mark: tuple[str, str] = ("[[", "]]"),
                 tokens: bool = False) -> str:
    """Row ``row`` of ``rows`` decoded: a header, each document with its token range, dataset index
    and target count (targets inside ``mark``), the padding; with ``tokens``, one line per token."""
    n_rows = len(rows.rows)
    if not 0 <= row < n_rows:
        raise DataError(f"--row {row}: the {rows.dataset.split} split has {n_rows} rows at seq_len={rows.seq_len} "
                        f"(0 … {n_rows - 1})")
    (ids_t, pos_t), labels_t = rows.batch(np.array([row]), rows.seq_len)
    ids, pos, labels = ids_t[0].numpy(), pos_t[0].numpy(), labels_t[0].numpy()
    target = labels != IGNORE
    docs = rows.rows[row]
    used = int(rows.lengths[docs].sum())
    out = [f"row {row} of {n_rows} ({rows.dataset.split}, seq_len {rows.seq_len}): {len(docs)} document"
           f"{'s' * (len(docs) != 1)}, {int(target.sum())} targets, {rows.seq_len - used} padding tokens"]
    t = 0
    for k, d in enumerate(docs):
        n = int(rows.lengths[d])
        index = int(np.searchsorted(rows.dataset.offsets, rows.starts[d]))  # the document in the dataset
        cut = " (cut to seq_len)" if rows.dataset.offsets[index + 1] - rows.starts[d] > n else ""
        out.append(f"--- document {k + 1} of {len(docs)}: dataset document {index}, tokens [{t}, {t + n}), "
                   f"{int(target[t:t + n].sum())} targets{cut}")
        out.append("".join(mark[0] + tokenizer.decode(seg) + mark[1] if is_target else tokenizer.decode(seg)
                           for is_target, seg in _segments(ids[t:t + n], target[t:t + n])))
        t += n
    if t < rows.seq_len:
        out.append(f"--- padding: tokens [{t}, {rows.seq_len}), id {rows.dataset.pad_id}, no targets")
    if tokens:
        out.append("--- tokens: index position id target text")
        out += [f"{i:5d} {int(pos[i]):5d} {int(ids[i]):7d} {'T' if target[i] else '-'} "
                f"{json.dumps(tokenizer.decode([int(ids[i])]), ensure_ascii=False)}" for i in range(rows.seq_len)]
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-mp show-rows", description="Print packed SFT training rows decoded: their "
                                "documents' boundaries and which tokens are targets.")
    p.add_argument("--data", required=True, help="an SFT dataset directory (ds-mp prepare-data --format ...)")
    p.add_argument("--split", default="train", choices=("train", "val"))
    p.add_argument("--row", type=int, action="append", help="row index (repeatable; default: row 0)")
    p.add_argument("--config", help="a DeepSpeed JSON: its ds_mp.data (seq_len, packing, overlong, seed) plans the rows")
    p.add_argument("--seq-len", type=int, help="tokens per row (overrides --config; default: ds_mp's 128)")
    p.add_argument("--no-packing", action="store_true", help="one document per row (data.packing: false)")
    p.add_argument("--overlong", choices=("truncate", "drop"), help="documents longer than seq_len (data.overlong)")
    p.add_argument("--seed", type=int, help="the packing seed (data.seed)")
    p.add_argument("--tokenizer", help="tokenizer or model directory (default: the dataset's tokenizer/)")
    p.add_argument("--mark", default="[[,]]", help="the two strings around target text, comma-separated (default [[,]])")
    p.add_argument("--tokens", action="store_true", help="also one line per token: index, position, id, target, text")
    return p


def show_rows_cli(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ds_mp.config.schema import ConfigError, DataConfig, parse_config
    from ds_mp.data.tokenizer import load_tokenizer

    try:
        data = DataConfig()
        if args.config:
            with open(args.config) as f:
                data = parse_config(json.load(f).get("ds_mp", {})).data
        seq_len = args.seq_len or data.seq_len
        mark = tuple(args.mark.split(",", 1))
        if len(mark) != 2:
            raise DataError(f"--mark {args.mark!r}: give two strings separated by a comma, e.g. '<<,>>'")
        dataset = SftDataset(TokenDataset(args.data, args.split))
        rows = SftRows(dataset, seq_len, packing=data.packing and not args.no_packing,
                       overlong=args.overlong or data.overlong, seed=data.seed if args.seed is None else args.seed)
        tokenizer = load_tokenizer(args.tokenizer or f"{args.data}/{TOKENIZER_DIR}")
        print("\n\n".join(describe_row(rows, r, tokenizer, mark, args.tokens) for r in (args.row or [0])))
    except (DataError, ConfigError, OSError, json.JSONDecodeError) as err:
        print(f"ds-mp show-rows: {err}", file=sys.stderr)
        return 2
    return 0


__all__ = ["describe_row", "show_rows_cli"]
