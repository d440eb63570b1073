"""``ds-mp prepare-data``: command-line front end of :func:`prepare_data`."""
from __future__ import annotations

import argparse
import sys

from .default_corpus import (DEFAULT_CACHE_DIR, DEFAULT_MAX_BYTES, DEFAULT_VOCAB_SIZE, ensure_default_dataset,
                             stdlib_files)
from .errors import DataError
from .prepare import DatasetInfo, prepare_data
from .sft_format import FORMATS
from .sft_prepare import BAD_RECORDS, OVERLONG, prepare_sft_data


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-mp prepare-data",
        description="Encode .txt/.jsonl files (or the Python stdlib with --default) into a token dataset; "
                    "with --format, SFT records (.jsonl/.parquet/.arrow) with a loss mask (docs/sft.md).",
    )
    p.add_argument("inputs", nargs="*", help=".txt / .jsonl files or folders (searched recursively); "
                   "with --format also .parquet / .arrow")
    p.add_argument("--out", help="output dataset directory (with --default: defaults to the cache)")
    p.add_argument("--tokenizer", metavar="HF_DIR", help="use this HF checkpoint's tokenizer instead of training one")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="size of the trained BPE vocabulary")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first N bytes of text")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out for validation")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split")
    p.add_argument("--encoding-errors", choices=("strict", "replace", "ignore"), default="strict",
                   help="what to do with non-UTF-8 bytes (strict = stop with an error)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--default", action="store_true", help="build the embedded Python-stdlib corpus")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    sft = p.add_argument_group("SFT datasets (docs/sft.md)")
    sft.add_argument("--format", choices=FORMATS, default=None,
                     help="records are chat ({\"messages\": [...]}), prompt-completion or text; loss mask stored "
                          "(needs --tokenizer); without it: a pretraining token stream")
    sft.add_argument("--chat-template", metavar="FILE", help="Jinja chat template to use instead of the tokenizer's")
    sft.add_argument("--max-tokens", type=int, default=None, help="longest record kept, in tokens (default: no limit)")
    sft.add_argument("--overlong", choices=OVERLONG, default="truncate",
                     help="records over --max-tokens: keep their first tokens (truncate) or drop them")
    sft.add_argument("--bad-records", choices=BAD_RECORDS, default="error",
                     help="a record that cannot be used (invalid JSON, a missing field, a chat without an assistant "
                          "turn): stop naming file:line (error, the default) or skip and count it (skip)")
    return p


def prepare_data_cli(argv: list[str] | None = None) -> int:
    """Run ``ds-mp prepare-data``; returns the exit code (0 ok, 2 for a :class:`DataError`)."""
    args = build_parser().parse_args(argv)
    try:
        if args.default:
            if args.inputs or args.tokenizer or args.format:
                raise DataError("--default builds the stdlib corpus; drop the inputs/--tokenizer/--format or drop --default")
            if args.out is None:
                path = ensure_default_dataset(DEFAULT_CACHE_DIR, args.vocab_size,
                                              args.max_bytes or DEFAULT_MAX_BYTES, not args.no_progress)
                info = DatasetInfo.load(path)
            else:
                info = prepare_data(stdlib_files(), args.out, None, args.vocab_size,
                                    args.max_bytes or DEFAULT_MAX_BYTES, args.val_fraction, args.seed,
                                    encoding_errors="replace", overwrite=args.overwrite,
                                    show_progress=not args.no_progress)
        elif args.format is not None:
            if args.out is None or args.tokenizer is None:
                raise DataError("--format needs --out DIR and --tokenizer HF_DIR (the checkpoint you fine-tune)")
            info = prepare_sft_data(args.inputs, args.out, args.tokenizer, args.format,
                                    chat_template=args.chat_template, max_tokens=args.max_tokens,
                                    overlong=args.overlong, val_fraction=args.val_fraction, seed=args.seed,
                                    overwrite=args.overwrite, show_progress=not args.no_progress,
                                    bad_records=args.bad_records)
        else:
            if args.out is None:
                raise DataError("--out is required; pass --out DIR for the dataset")
            info = prepare_data(args.inputs, args.out, args.tokenizer, args.vocab_size, args.max_bytes,
                                args.val_fraction, args.seed, encoding_errors=args.encoding_errors,
                                overwrite=args.overwrite, show_progress=not args.no_progress)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{info.path}: {info.train_tokens} train / {info.val_tokens} val tokens "
          f"({info.train_documents}/{info.val_documents} documents), vocab {info.vocab_size}, {info.dtype}")
    if info.sft is not None:
        c = info.sft
        print(f"{info.format}: {c['train_targets']} train target tokens; {c['records']} records read, "
              f"{c['truncated']} truncated and {c['dropped']} dropped over --max-tokens={c['max_tokens']} "
              f"({c['overlong']}), {c['no_target']} dropped without a target token"
              + (f", {c['bad']} bad records skipped" if c.get("bad") else ""))
        for example in c.get("bad_examples", []):
            print(f"  skipped: {example}")
    return 0
