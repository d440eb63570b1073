"""Preference data for DPO (``"loss": {"type": "dpo"}``): TRL 1.16's records, tokenization and rows.

Records (one JSON object a line): ``prompt``, ``chosen``, ``rejected``, either plain strings or
conversational message lists (``[{"role": ..., "content": ...}]``) — TRL's explicit-prompt
preference format.  Tokenized as TRL's ``DPOTrainer._prepare_dataset`` does: plain text gets the
tokenizer's EOS appended to each completion (unless it ends with it) and is tokenized as
``prompt`` and ``prompt + completion``; conversational records go through the chat template
(``add_generation_prompt=True`` for the prompt alone); the completion starts where the prompt's ids
and the full ids stop agreeing (TRL's ``common_prefix_length``).  A pair whose prompt alone fills
``max_length`` is dropped (TRL's ``keep_start`` filter).

Rows (:func:`pair_rows`): TRL's ``DataCollatorForPreference`` — ``[chosen_1..b; rejected_1..b]``,
each ``prompt + completion`` cut to its first ``max_length`` tokens, right-padded to ``pad_to``
columns; ``labels`` are the ids with every non-completion position -100 (the DPO spec's rows).
:func:`pair_order` is the run's order of pairs: a seeded permutation per epoch, each step's
``dp · gas · b`` pairs split as ``(gas, dp, b)`` (replica ``d``'s micro-batch ``k`` is ``[k, d]``).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .errors import DataError

Pair = dict[str, list[int]]


def read_preference_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a preference JSONL file; a record without ``prompt``/``chosen``/``rejected``
    (or mixing plain and conversational fields) is refused in one line naming its line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"data.path: {path}:{n}: not JSON ({err.msg})") from None
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
            if missing:
                raise DataError(f"data.path: {path}:{n}: a preference record needs prompt, chosen and rejected; "
                                f"missing {missing} (TRL's implicit-prompt format: split the prompt out first)")
            kinds = {isinstance(rec[k], str) for k in ("prompt", "chosen", "rejected")}
            if len(kinds) > 1 or not all(isinstance(rec[k], (str, list)) for k in ("prompt", "chosen", "rejected")):
                raise DataError(f"data.path: {path}:{n}: prompt, chosen and rejected must all be strings or all "
                                "message lists")
            out.append(rec)
    if not out:
        raise DataError(f"data.path: {path}: no preference records")
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(tokenizer: Any, record: dict[str, Any]) -> Pair:
    """One record as TRL's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (module docstring)."""
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, list):
        def ids(messages: list, **kw: Any) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])
        prompt_ids = ids(prompt, add_generation_prompt=True)
        full_c, full_r = ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        full_c, full_r = list(tokenizer(prompt + chosen)["input_ids"]), list(tokenizer(prompt + rejected)["input_ids"])
    cut = min(_common_prefix(prompt_ids, full_c), _common_prefix(prompt_ids, full_r))
    return {"prompt_ids": prompt_ids[:cut], "chosen_ids": full_c[cut:], "rejected_ids": full_r[cut:]}


def tokenize_pairs(tokenizer: Any, records: list[dict[str, Any]], max_length: int) -> tuple[list[Pair], int]:
    """Every record tokenized, those whose prompt alone fills ``max_length`` dropped: ``(pairs, dropped)``."""
    pairs = [tokenize_pair(tokenizer, r) for r in records]
    kept = [p for p in pairs if len(p["prompt_ids"]) < max_length]
    return kept, len(pairs) - len(kept)


def pair_rows(pairs: list[Pair], max_length: int, pad_to: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``b`` pairs as one micro-batch ``{"input_ids", "labels"}`` of ``2b × pad_to`` (module docstring)."""
    rows, labels = [], []
    for half in ("chosen_ids", "rejected_ids"):
        for p in pairs:
            ids = (p["prompt_ids"] + p[half])[:max_length]
            lab = ([-100] * len(p["prompt_ids"]) + p[half])[:max_length]
            rows.append(ids + [pad_id] * (pad_to - len(ids)))
            labels.append(lab + [-100] * (pad_to - len(lab)))
    return {"input_ids": torch.tensor(rows, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}


def pair_order(n_pairs: int, step: int, pairs_per_micro: int, gas: int, dp: int, seed: int,
               shuffle: bool = True) -> np.ndarray:
    """The pair indices of global step ``step``, shaped ``(gas, dp, b)``: a permutation of every
    pair per epoch (seeded by ``seed`` and the epoch; file order if not ``shuffle``), read on."""
    per_step = pairs_per_micro * gas * dp
    start, parts = step * per_step, []
    while sum(len(p) for p in parts) < per_step:
        epoch, pos = divmod(start, n_pairs)
        perm = np.random.default_rng([seed, epoch]).permutation(n_pairs) if shuffle else np.arange(n_pairs)
        take = min(per_step - sum(len(p) for p in parts), n_pairs - pos)
        parts.append(perm[pos:pos + take])
        start += take
    return np.concatenate(parts).reshape(gas, dp, pairs_per_micro)


__all__ = ["Pair", "read_preference_jsonl", "tokenize_pair", "tokenize_pairs", "pair_rows", "pair_order"]
