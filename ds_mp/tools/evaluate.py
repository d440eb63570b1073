"""Evaluation: sliding-window perplexity and LAMBADA-style cloze accuracy.

Both take a ``logits_fn(input_ids[1, T]) -> logits[1, T, V]`` so they work with an HF
model (``hf_logits_fn``), an exported ds_mp checkpoint, or a fake in a test.

Sliding window (tokens x_0 .. x_{N-1}; every x_t with t >= 1 is a target, predicted from
x_{<t}). A forward pass sees at most ``window`` tokens; windows end ``stride`` targets
apart and each window scores only targets no earlier window scored:

    window k scores targets [lo_k, hi_k):   hi_0 = min(window + 1, N), lo_0 = 1
                                            lo_k = hi_{k-1}, hi_k = min(hi_{k-1} + stride, N)
    its input is x[b_k : hi_k - 1] with     b_k = max(hi_k - 1 - window, 0)

so target t is scored once, with at least ``window - stride + 1`` tokens of context once
t > window. The last window is aligned to the end of the data (full context). With
stride == window the windows do not overlap (Megatron's default); a smaller stride buys
context with more compute (Megatron's ``--overlapping-eval``).

    ppl = exp(total_nll / scored_tokens)        (per BPE token)
    ppl = exp(total_nll / original_token_count)  (per original token: Megatron's WikiText-103
                                                  number, comparable across tokenizers)

SFT records (``--format chat|prompt-completion|text``, prepare-data's formats and flags): each
record is encoded with its template and loss mask (ds_mp.data.sft_format), cut to its first
``window`` tokens (training's ``data.overlong: truncate`` at ``data.seq_len``), run on its own, and

    loss = Σ_documents Σ_targets -log p(x_t | x_<t)  /  Σ_documents targets,   ppl = exp(loss)

the per-target-token loss over the whole file: training's ``val_loss`` for the same documents
(``data.val_path`` = the file, ``--window`` = ``data.seq_len``; ds_mp.data.validation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["LogitsFn", "sliding_window_nll", "perplexity", "cloze_predictions",
           "cloze_accuracy", "load_jsonl_texts", "hf_logits_fn", "sft_nll", "eval_cli"]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]   # input_ids[1, T] -> logits[1, T, V]


@torch.no_grad()
def sliding_window_nll(logits_fn: LogitsFn, tokens: torch.Tensor, window: int,
                       stride: int) -> tuple[float, int]:
    """Sum of -log p(x_t | context) over t = 1..N-1, each scored once (module docstring).

    Returns ``(total_nll, scored_tokens)`` with ``scored_tokens == N - 1``.
    """
    tokens = torch.as_tensor(tokens).long().flatten().cpu()
    n = tokens.numel()
    if n < 2:
        raise ValueError(f"sliding_window_nll: need at least 2 tokens, got {n}")
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"sliding_window_nll: need 1 <= stride <= window, "
                         f"got window={window}, stride={stride}")
    total, scored = 0.0, 0
    lo, hi = 1, min(window + 1, n)
    while True:
        begin = max(hi - 1 - window, 0)
        logits = logits_fn(tokens[begin:hi - 1].unsqueeze(0))       # (1, T, V), T <= window
        # logits[0, j] predicts x_{begin + j + 1}; targets lo..hi-1 -> j = lo-begin-1 .. hi-begin-2
        rows = logits[0, lo - begin - 1:hi - begin - 1].float()      # (hi - lo, V)
        targets = tokens[lo:hi].to(rows.device)
        total += float(torch.nn.functional.cross_entropy(rows, targets, reduction="sum"))
        scored += hi - lo
        if hi >= n:
            return total, scored
        lo, hi = hi, min(hi + stride, n)


def perplexity(logits_fn: LogitsFn, tokens: torch.Tensor, window: int, stride: int,
               original_token_count: int | None = None) -> float:
    """exp(total_nll / scored_tokens), or exp(total_nll / original_token_count) if given."""
    total, scored = sliding_window_nll(logits_fn, tokens, window, stride)
    denom = scored if original_token_count is None else original_token_count
    if denom <= 0:
        raise ValueError(f"perplexity: token count must be > 0, got {denom}")
    return math.exp(total / denom)


@torch.no_grad()
def sft_nll(logits_fn: LogitsFn, docs: Any, window: int) -> tuple[float, int, int]:
    """``(total_nll, targets, truncated)`` over ``docs`` (``(ids, mask)`` pairs, mask[t] = 1: token t
    is a target; a document's first token never is): each cut to ``window`` tokens, run alone."""
    total, count, cut = 0.0, 0, 0
    for ids, mask in docs:
        cut += len(ids) > window
        ids, mask = torch.as_tensor(ids[:window]).long(), torch.as_tensor(mask[:window]).bool()
        keep = mask[1:]
        if len(ids) < 2 or not keep.any():
            continue
        logits = logits_fn(ids[None, :-1])[0].float()  # position t-1 predicts token t
        targets = ids[1:][keep].to(logits.device)
        total += float(torch.nn.functional.cross_entropy(logits[keep], targets, reduction="sum"))
        count += int(keep.sum())
    return total, count, cut


def _records_kind(path: Path) -> str | None:
    """The SFT format a JSON-lines file's first record looks like (None: not JSON records)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    return "chat" if "messages" in record else "prompt-completion" if "prompt" in record else "text"


def _split_docs(path: str, fmt: str) -> Any:
    """``(ids, mask)`` of every document of a prepared SFT dataset's val split."""
    from ds_mp.data import DataError, SftDataset, TokenDataset

    ds = SftDataset(TokenDataset(path, "val"))
    if ds.info.format != fmt:
        raise DataError(f"{path} holds {ds.info.format} data, not {fmt}; pass --format {ds.info.format}")
    o = ds.offsets
    return ((ds.tokens[o[d]:o[d + 1]].astype(np.int64), np.array(ds.mask[o[d]:o[d + 1]])) for d in range(len(ds)))


def _sft_eval(args: argparse.Namespace, logits_fn: LogitsFn, tok: Any, window: int) -> dict[str, Any]:
    from ds_mp.data.sft_prepare import encode_documents

    counts: dict = {"records": None, "bad": 0}
    if os.path.isdir(args.data):  # a prepared dataset: its held-out split, encoded as training reads it
        docs = _split_docs(args.data, args.format)
    else:
        docs = ((ids, mask) for _, _, ids, mask in encode_documents([args.data], tok, args.format,
                                                                    bad_records=args.bad_records, counts=counts))
    total, targets, cut = sft_nll(logits_fn, docs, window)
    if not targets:
        raise ValueError(f"{args.data}: no target token in any record; check --format and the data")
    return {"data": args.data, "format": args.format, "records": counts["records"], "bad_records": counts["bad"],
            "window": window, "truncated": cut, "targets": targets, "loss": total / targets,
            "ppl": math.exp(total / targets)}


def _encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` as a list of ids (HF tokenizers or ``tokenizers.Tokenizer``)."""
    out = tokenizer.encode(text)
    return list(getattr(out, "ids", out))


def split_last_word(text: str) -> tuple[str, str]:
    """LAMBADA split: (text up to the last word without its trailing space, " " + last word)."""
    text = text.strip()
    cut = text.rfind(" ")
    if cut <= 0:
        raise ValueError(f"cloze example has no context before its last word: {text!r}")
    return text[:cut], " " + text[cut + 1:]


@torch.no_grad()
def cloze_predictions(logits_fn: LogitsFn, tokenizer: Any, examples: Sequence[str],
                      max_len: int | None = None) -> list[bool]:
    """Per example: is every sub-token of the last word the greedy (argmax) prediction?

    Teacher forcing: input = context ids + target ids[:-1], one forward per example; target
    sub-token i is predicted by the logits at position len(context) - 1 + i. With
    ``max_len`` the context is cut from the left so the input fits.
    """
    results = []
    for text in examples:
        context, target = split_last_word(text)
        ctx, tgt = _encode(tokenizer, context), _encode(tokenizer, target)
        if not ctx or not tgt:
            raise ValueError(f"cloze example encodes to an empty context or target: {text!r}")
        if max_len is not None:
            keep = max_len - (len(tgt) - 1)
            if keep < 1:
                raise ValueError(f"cloze target longer than max_len={max_len}: {text!r}")
            ctx = ctx[-keep:]
        ids = torch.tensor([ctx + tgt[:-1]], dtype=torch.long)             # (1, T)
        logits = logits_fn(ids)                                            # (1, T, V)
        pred = logits[0, len(ctx) - 1:].argmax(dim=-1).cpu()               # (len(tgt),)
        results.append(bool(torch.equal(pred, torch.tensor(tgt, dtype=pred.dtype))))
    return results


def cloze_accuracy(logits_fn: LogitsFn, tokenizer: Any, examples: Sequence[str],
                   max_len: int | None = None) -> float:
    """Fraction of examples whose whole last word is predicted greedily (``cloze_predictions``)."""
    preds = cloze_predictions(logits_fn, tokenizer, examples, max_len=max_len)
    if not preds:
        raise ValueError("cloze_accuracy: no examples")
    return sum(preds) / len(preds)


def load_jsonl_texts(path: str | Path) -> list[str]:
    """The ``"text"`` field of every non-blank line of a JSONL file (LAMBADA format)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def hf_logits_fn(model: torch.nn.Module) -> LogitsFn:
    """Adapter for an HF causal LM: puts it in eval mode, moves ids to its device."""
    model.eval()
    device = next(model.parameters()).device

    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids.to(device)).logits

    return logits_fn


def _load_tokens(path: Path, tokenizer: Any, token_dtype: str) -> torch.Tensor:
    """A token file (``.npy``, or raw ``.bin`` of ``token_dtype``) or a text file to encode."""
    if path.suffix == ".npy":
        arr = np.load(path)
    elif path.suffix == ".bin":
        arr = np.fromfile(path, dtype=np.dtype(token_dtype))
    else:
        return torch.tensor(_encode(tokenizer, path.read_text(encoding="utf-8")), dtype=torch.long)
    return torch.from_numpy(arr.astype(np.int64).ravel())


def eval_cli(argv: Sequence[str] | None = None) -> int:
    """``ds-mp eval``: perplexity of a token/text file and/or cloze accuracy; prints JSON."""
    p = argparse.ArgumentParser(prog="ds-mp eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory, ds_mp sharded directory, or training "
                   "checkpoint (<output_dir>/checkpoints[/<tag>]; exported to a temporary HF dir)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's, or a training "
                   "checkpoint's dataset tokenizer)")
    p.add_argument("--data", default=None, help="text file, or token file (.npy / raw .bin); with --format a file of "
                   "SFT records, or a prepared SFT dataset directory (its val split: training's val_loss)")
    p.add_argument("--token-dtype", default="uint16", help="dtype of a raw .bin token file")
    p.add_argument("--window", type=int, default=None, help="tokens per forward (default: n_positions)")
    p.add_argument("--stride", type=int, default=None, help="new targets per window (default: window)")
    p.add_argument("--original-tokens", default=None,
                   help="normalise by this many original tokens; 'auto' = len(text.strip().split(' '))"
                        " of the text file, as Megatron does for WikiText-103")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    p.add_argument("--cloze", default=None, help="LAMBADA-format JSONL (field 'text')")
    p.add_argument("--format", choices=("chat", "prompt-completion", "text"), default=None,
                   help="--data holds SFT records (.jsonl/.parquet/.arrow): score the targets of each record with its "
                        "template and loss mask (prints loss and ppl per target token, training's val_loss)")
    p.add_argument("--chat-template", metavar="FILE", default=None, help="with --format chat: Jinja chat template to "
                   "use instead of the tokenizer's (the one the data was prepared with)")
    p.add_argument("--bad-records", choices=("error", "skip"), default="error",
                   help="with --format: stop at a bad record (error) or skip and count it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.data is None and args.cloze is None:
        print("ds-mp eval: nothing to do; pass --data and/or --cloze", file=sys.stderr)
        return 2

    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_mp.tools.generate import resolve_model

    if args.format is None and args.data is not None and Path(args.data).suffix == ".jsonl":
        kind = _records_kind(Path(args.data))
        if kind is not None:
            print(f"ds-mp eval: {args.data} holds {kind} records; pass --format {kind} to score their targets with "
                  "the template and loss mask (without --format a file is scored as plain text)", file=sys.stderr)
            return 2
    if args.format is not None and args.data is None:
        print("ds-mp eval: --format needs --data FILE of records", file=sys.stderr)
        return 2
    needs_tok = args.cloze is not None or (
        args.data is not None and Path(args.data).suffix not in (".npy", ".bin"))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = resolve_model("ds-mp eval", args.model, args.tokenizer, tmp)
        if dirs is None:
            return 2
        model_dir, tok_dir = dirs
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(args.device)
        try:
            if args.format is not None:  # the tokenizer with its (or --chat-template's) template, checked
                from ds_mp.data import DataError
                from ds_mp.data.sft_prepare import load_sft_tokenizer

                try:
                    tokenizer = None if os.path.isdir(args.data) else \
                        load_sft_tokenizer(tok_dir, args.format, args.chat_template)
                except DataError as e:
                    print(f"ds-mp eval: {e}", file=sys.stderr)
                    return 2
            else:
                tokenizer = AutoTokenizer.from_pretrained(tok_dir) if needs_tok else None
        except (OSError, ValueError) as e:
            print(f"ds-mp eval: no tokenizer in {tok_dir!r} ({e}); pass --tokenizer DIR", file=sys.stderr)
            return 2
    logits_fn = hf_logits_fn(model)
    max_len = args.window or getattr(model.config, "max_position_embeddings", None) or 1024  # GPT-2: n_positions
    out: dict[str, Any] = {"model": args.model}

    if args.format is not None:
        from ds_mp.data import DataError

        try:
            out.update(_sft_eval(args, logits_fn, tokenizer, max_len))
        except (DataError, ValueError) as e:
            print(f"ds-mp eval: {e}", file=sys.stderr)
            return 2
    elif args.data is not None:
        path = Path(args.data)
        tokens = _load_tokens(path, tokenizer, args.token_dtype)
        if args.max_tokens is not None:
            tokens = tokens[:args.max_tokens]
        stride = args.stride or max_len
        total, scored = sliding_window_nll(logits_fn, tokens, max_len, stride)
        out.update(data=str(path), tokens=int(tokens.numel()), window=max_len, stride=stride,
                   scored_tokens=scored, nll=total / scored, ppl=math.exp(total / scored))
        if args.original_tokens is not None:
            if args.original_tokens == "auto":
                if path.suffix in (".npy", ".bin") or args.max_tokens is not None:
                    print("ds-mp eval: --original-tokens auto needs a whole text file "
                          "(no token file, no --max-tokens)", file=sys.stderr)
                    return 2
                original = len(path.read_text(encoding="utf-8").strip().split(" "))
            else:
                original = int(args.original_tokens)
            out.update(original_tokens=original, ppl_original=math.exp(total / original))
    if args.cloze is not None:
        preds = cloze_predictions(logits_fn, tokenizer, load_jsonl_texts(args.cloze), max_len)
        out.update(cloze=args.cloze, cloze_examples=len(preds), cloze_correct=sum(preds),
                   accuracy=sum(preds) / max(len(preds), 1))
    print(json.dumps(out))
    return 0
