"""A padding-free flattened micro-batch re-formed into ds_mp's fixed row shape ``(rows, seq_len)``.

TRL's ``SFTTrainer(packing=True)`` (best-fit packing, padding-free) and transformers'
``DataCollatorWithFlattening`` hand over each micro-batch as ONE row ``(1, T)``: the examples (or
packed sequences) of the micro-batch concatenated, ``position_ids`` restarting at 0 per document,
labels -100 on each document's first token, and derived keys (``cu_seq_lens_q/k``,
``max_length_q/k``, ``seq_idx``).  ``T`` varies between micro-batches and may exceed ``max_length``.
ds_mp's pipelines need one shape for every micro-batch of a run, so :func:`unflatten` re-forms it:

1. split the row into documents where ``position_ids`` restart at 0 (``cu_seq_lens_*`` and
   ``seq_idx``, when present, must say the same; they are derived keys, checked and dropped);
2. drop documents without a target (labels -100 on every token after the first: they change no
   loss, e.g. ``pad_to_multiple_of`` padding, whose tokens are one-token documents);
3. place the documents, in order, into ``rows`` rows of ``seq_len`` tokens by next-fit (a row is
   closed when the next document does not fit).  In-order next-fit needs no more rows than any
   in-order split of the row into groups of at most ``seq_len`` tokens, so a micro-batch that the
   collator built from ``per_device_train_batch_size`` sequences of at most ``max_length`` tokens
   always fits ``rows = per_device_train_batch_size`` rows of ``seq_len >= max_length``;
4. fill each row's tail with one padding document (id ``pad_id``, positions restarting at 0,
   labels -100, ``attention_mask`` 0); rows left empty are whole padding documents.  The mask keeps
   the filler out of what HF computes over every token of the flattened row: a mixture of experts'
   aux loss counts the tokens its ``attention_mask`` keeps (``ds_mp.models.carry``).

Every document keeps its tokens, labels and positions 0 … n-1, and ds_mp's packed-document attention
(a token attends only to earlier tokens of its own document; no target crosses a document, see
docs/batches.md) runs it exactly as HF runs it alone: the per-token loss sum and the target count
``(labels[..., 1:] != -100).sum()`` are those of the flattened row.  A document longer than
``seq_len`` is refused (never split: its later tokens would lose their context), as are more
documents than ``rows × seq_len`` holds.
"""
from __future__ import annotations

from typing import Any

import torch

FLAT_KEYS = ("input_ids", "labels", "position_ids")
DERIVED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "attention_mask")


def is_flattened(batch: Any) -> bool:
    """True for a dict micro-batch in the flattened form: one row with ``position_ids``."""
    return (isinstance(batch, dict) and "position_ids" in batch and isinstance(batch.get("input_ids"), torch.Tensor)
            and batch["input_ids"].dim() == 2 and batch["input_ids"].shape[0] == 1)


def _documents(batch: dict) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the flattened row's documents, after checking the derived keys."""
    extra = [k for k in batch if k not in FLAT_KEYS + DERIVED_KEYS]
    if extra:
        raise ValueError(f"flattened batch: key {extra[0]!r} is not used by ds_mp (accepted: "
                         f"{', '.join(FLAT_KEYS + DERIVED_KEYS)}); remove it from the batch")
    ids, labels, pos = (batch[k] for k in FLAT_KEYS)
    if ids.shape != labels.shape or pos.shape != ids.shape or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"flattened batch: input_ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and "
                         f"position_ids {tuple(pos.shape)} must all be one row (1, T)")
    pos = pos[0]
    if int(pos[0]) != 0 or not bool(((pos[1:] == 0) | (pos[1:] == pos[:-1] + 1)).all()):
        raise ValueError("flattened batch: position_ids must start at 0, count up by 1 within a document and restart "
                         "at 0 at the next (HF's DataCollatorWithFlattening)")
    starts = torch.nonzero(pos == 0).flatten().tolist()
    ends = starts[1:] + [pos.numel()]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key in batch and batch[key].flatten().tolist() != starts + [pos.numel()]:
            raise ValueError(f"flattened batch: {key} disagrees with the documents of position_ids; "
                             "build both with one collator")
    if "seq_idx" in batch:
        want = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(ends) - torch.tensor(starts))
        if not torch.equal(batch["seq_idx"].flatten().long(), want):
            raise ValueError("flattened batch: seq_idx disagrees with the documents of position_ids; "
                             "build both with one collator")
    if "attention_mask" in batch and not bool((batch["attention_mask"] == 1).all()):
        raise ValueError("flattened batch: an attention_mask with zeros beside position_ids; padding-free batches "
                         "carry no padding (drop the mask or the position_ids)")
    late_targets = [s for s in starts[1:] if int(labels[0, s]) != -100]
    if late_targets:
        raise ValueError(f"flattened batch: labels[{late_targets[0]}] is a target at a document's first token; a "
                         "target never crosses a document (set labels to -100 there, as DataCollatorWithFlattening does)")
    return list(zip(starts, ends))


def unflatten(batch: dict, rows: int, seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The flattened micro-batch ``batch`` re-formed into ``{"input_ids", "labels", "position_ids",
    "attention_mask"}`` of shape ``(rows, seq_len)`` (module docstring); raises ``ValueError`` with one
    line when it cannot."""
    spans = _documents(batch)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    spans = [(s, e) for s, e in spans if bool((labels[s + 1:e] != -100).any())]
    long_doc = next(((s, e) for s, e in spans if e - s > seq_len), None)
    if long_doc is not None:
        raise ValueError(f"flattened batch: a document of {long_doc[1] - long_doc[0]} tokens exceeds ds_mp.data.seq_len "
                         f"= {seq_len}; raise seq_len to the collator's max_length or truncate to it (max_length)")
    placed: list[list[tuple[int, int]]] = [[]]
    used = 0
    for s, e in spans:
        if used + e - s > seq_len:
            placed.append([])
            used = 0
        placed[-1].append((s, e))
        used += e - s
    if len(placed) > rows:
        raise ValueError(f"flattened batch: its {sum(e - s for s, e in spans)} tokens in {len(spans)} documents need "
                         f"{len(placed)} rows of seq_len {seq_len}, the run has {rows}; set ds_mp.data.seq_len >= the "
                         "collator's max_length and the rows (micro-batch size) to per_device_train_batch_size")
    out_ids = torch.full((rows, seq_len), pad_id, dtype=ids.dtype)
    out_labels = torch.full((rows, seq_len), -100, dtype=labels.dtype)
    out_pos = torch.zeros((rows, seq_len), dtype=batch["position_ids"].dtype)
    out_mask = torch.zeros((rows, seq_len), dtype=torch.long)
    for r in range(rows):
        t = 0
        for s, e in placed[r] if r < len(placed) else []:
            n = e - s
            out_ids[r, t:t + n], out_labels[r, t:t + n] = ids[s:e], labels[s:e]
            out_pos[r, t:t + n] = torch.arange(n)
            out_labels[r, t] = -100  # never a target: not counted by (labels[..., 1:] != -100) either
            out_mask[r, t:t + n] = 1
            t += n
        out_pos[r, t:] = torch.arange(seq_len - t)  # the tail's padding document restarts at 0
    return {"input_ids": out_ids, "labels": out_labels, "position_ids": out_pos, "attention_mask": out_mask}


def unflatten_all(batches: Any, rows: int, seq_len: int, pad_id: int = 0) -> Any:
    """``batches`` (an iterable of micro-batches) with every flattened one re-formed by :func:`unflatten`;
    other forms pass unchanged.  ``engine.train_batch(unflatten_all(loader, rows, seq_len))``."""
    return (unflatten(b, rows, seq_len, pad_id) if is_flattened(b) else b for b in batches)


__all__ = ["FLAT_KEYS", "DERIVED_KEYS", "is_flattened", "unflatten", "unflatten_all"]
