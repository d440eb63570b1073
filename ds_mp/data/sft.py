"""Training on SFT datasets: documents laid out in rows of ``seq_len``, packed or padded.

A batch is ``((input_ids, position_ids), labels)``, each a LongTensor (B, seq_len), in HF's
convention (the model shifts labels: ``labels[t]`` is the target predicted at t-1):

* a row holds whole documents back to back (packing: best-fit decreasing, ds_mp.data.packing)
  or one document (``packing: false``), then a padding "document" of pad tokens filling the tail;
* ``position_ids`` restart at 0 at every document, the padding included: they mark the
  documents (``DataCollatorWithFlattening``'s convention), so the model keeps them apart;
* ``labels[t]`` = ``input_ids[t]`` where the dataset's loss mask marks a target, -100 elsewhere,
  and -100 at every document's first token (nothing in its own document predicts it) and on
  the padding.

Rows are planned once per run (seeded); :class:`SftSampler` is :class:`ChunkSampler` over
rows instead of chunks: each epoch a seeded permutation of the rows, each step the next
``micro_batch × grad_accum × dp_size`` rows laid out ``[grad_accum, dp_size, micro_batch]``,
resumable mid-epoch and at another DP size. Documents longer than ``seq_len`` are cut to
their first ``seq_len`` tokens (``overlong: truncate``; dropped if no target is left) or
dropped (``overlong: drop``), counted in :attr:`SftRows.report`.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch

from .dataset import ChunkSampler, TokenDataset
from .errors import DataError
from .packing import best_fit_decreasing, one_per_row
from .sft_prepare import DOC_FILES, MASK_FILES, OVERLONG

SftBatch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]  # ((input_ids, position_ids), labels)
IGNORE = -100


class SftDataset:
    """One split of an SFT dataset: the token file (a :class:`TokenDataset`), loss mask, document offsets."""

    def __init__(self, tokens: TokenDataset) -> None:
        self.info, self.split, self.tokens = tokens.info, tokens.split, tokens.tokens
        if self.info.format == "stream":
            raise DataError(f"{self.info.path} is a pretraining (stream) dataset, not SFT; build one with "
                            "`ds-mp prepare-data --format chat|prompt-completion|text`")
        s = 0 if self.split == "train" else 1
        mask_file, doc_file = (os.path.join(self.info.path, f) for f in (MASK_FILES[s], DOC_FILES[s]))
        n = len(self.tokens)
        if not os.path.isfile(mask_file) or os.path.getsize(mask_file) != n:
            raise DataError(f"{mask_file} is missing or does not hold {n} mask bytes; rebuild the dataset")
        self.mask = np.memmap(mask_file, dtype=np.uint8, mode="r", shape=(n,)) if n else np.empty(0, np.uint8)
        self.offsets = np.fromfile(doc_file, dtype=np.int64) if os.path.isfile(doc_file) else np.empty(0, np.int64)
        if len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != n or np.any(np.diff(self.offsets) < 1):
            raise DataError(f"{doc_file} does not hold the document offsets of {n} tokens; rebuild the dataset")

    @classmethod
    def from_arrays(cls, info: Any, split: str, tokens: np.ndarray, mask: np.ndarray,
                    offsets: np.ndarray) -> "SftDataset":
        """A split held in memory (a held-out records file encoded at start-up,
        :func:`ds_mp.data.validation.records_split`): ``info`` its dataset's, ``split`` its name."""
        self = cls.__new__(cls)
        self.info, self.split, self.tokens, self.mask, self.offsets = info, split, tokens, mask, offsets
        return self

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def pad_id(self) -> int:
        return int(self.info.sft["pad_id"])


class SftRows:
    """The documents of ``dataset`` planned into rows of ``seq_len``: what :class:`SftSampler` and
    :class:`~ds_mp.data.validation.HeldOutBatches` draw from (``num_chunks`` rows, ``batch(row_ids, seq_len)``)."""

    def __init__(self, dataset: SftDataset, seq_len: int, packing: bool = True, overlong: str = "truncate",
                 seed: int = 0) -> None:
        if overlong not in OVERLONG:
            raise DataError(f"ds_mp.data.overlong: {overlong!r} is unknown; use 'truncate' or 'drop'")
        self.dataset, self.seq_len, self.packing = dataset, seq_len, packing
        starts, lengths = dataset.offsets[:-1], np.diff(dataset.offsets)
        targets = np.add.reduceat(dataset.mask.astype(np.int64), starts) if len(starts) else starts
        targets = targets - dataset.mask[starts]  # a document's first token is never a target
        over = lengths > seq_len
        if over.any() and overlong == "truncate":
            cut = np.flatnonzero(over)
            targets[cut] = [int(dataset.mask[s + 1:s + seq_len].sum()) for s in starts[cut]]
        if not len(lengths):
            raise DataError(f"{dataset.info.path}: the {dataset.split} split has no documents; "
                            "rebuild with more records or a larger --val-fraction")
        keep = (targets > 0) & ~(over & (overlong == "drop"))
        self.report = {"documents": len(lengths), "overlong": int(over.sum()), "overlong_policy": overlong,
                       "truncated": int((over & keep).sum()) if overlong == "truncate" else 0,
                       "dropped": int((~keep).sum())}
        if not keep.any():
            raise DataError(f"{dataset.info.path} ({dataset.split}): no document left after filtering "
                            f"({self.report['dropped']} of {len(lengths)} dropped: longer than data.seq_len={seq_len} or no "
                            "target token within it); raise data.seq_len or set data.overlong='truncate'")
        self.starts, self.lengths = starts[keep], np.minimum(lengths[keep], seq_len)
        self.targets = targets[keep]
        plan = best_fit_decreasing(self.lengths, seq_len, seed) if packing else one_per_row(len(self.lengths))
        self.rows = plan
        self.row_targets = np.array([self.targets[r].sum() for r in plan], dtype=np.int64)
        self.row_padding = np.array([seq_len - self.lengths[r].sum() for r in plan], dtype=np.int64)
        self.report.update(rows=len(plan), padding_fraction=float(self.row_padding.sum() / (len(plan) * seq_len)))

    def num_chunks(self, seq_len: int) -> int:
        self._check(seq_len)
        return len(self.rows)

    def _check(self, seq_len: int) -> None:
        if seq_len != self.seq_len:
            raise DataError(f"rows were planned for seq_len={self.seq_len}, not {seq_len}")

    def counts(self, row_ids: np.ndarray) -> tuple[int, int]:
        """``(target tokens, padding tokens)`` of the rows ``row_ids``."""
        return int(self.row_targets[row_ids].sum()), int(self.row_padding[row_ids].sum())

    def batch(self, row_ids: np.ndarray, seq_len: int) -> SftBatch:
        """The rows ``row_ids`` as ``((input_ids, position_ids), labels)``, each (len(row_ids), seq_len)."""
        self._check(seq_len)
        B, ds = len(row_ids), self.dataset
        ids = np.full((B, seq_len), ds.pad_id, dtype=np.int64)
        labels = np.full((B, seq_len), IGNORE, dtype=np.int64)
        pos = np.empty((B, seq_len), dtype=np.int64)
        for b, r in enumerate(row_ids):
            t = 0
            for d in self.rows[r]:
                s, n = self.starts[d], self.lengths[d]
                ids[b, t:t + n] = ds.tokens[s:s + n]
                labels[b, t + 1:t + n] = np.where(ds.mask[s + 1:s + n] > 0, ids[b, t + 1:t + n], IGNORE)
                pos[b, t:t + n] = np.arange(n)
                t += n
            pos[b, t:] = np.arange(seq_len - t)  # the padding "document"
        return (torch.from_numpy(ids), torch.from_numpy(pos)), torch.from_numpy(labels)


class SftSampler(ChunkSampler):
    """:class:`ChunkSampler` over the rows of :class:`SftRows` (same stream, DP split and resume
    contract); :attr:`step_counts` = (target, padding) tokens of the last step started, all DP
    ranks together."""

    dataset: SftRows

    def __init__(self, rows: SftRows, micro_batch: int, grad_accum: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0) -> None:
        super().__init__(rows, rows.seq_len, micro_batch, grad_accum, dp_rank, dp_size, seed)  # type: ignore[arg-type]
        self.step_counts = (0, 0)

    def _step_at(self, start: int) -> list:
        self.step_counts = self.dataset.counts(self._stream(start, self.global_batch))
        return super()._step_at(start)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "packing": self.dataset.packing}

    def load_state_dict(self, state: dict) -> None:
        if state.get("packing", self.dataset.packing) != self.dataset.packing:
            raise DataError(f"sampler state has data.packing={state['packing']} but this run has "
                            f"{self.dataset.packing}; resume with the same data.packing")
        super().load_state_dict(state)


class StepTokens(NamedTuple):
    counted: int  # the tokens tokens/s counts: target tokens (SFT) or batch × seq_len (stream)
    targets: int  # tokens whose shifted label is not -100, all DP ranks
    padding: int  # pad tokens in the step's rows, all DP ranks


def step_tokens(sampler: ChunkSampler, batch_size: int, seq_len: int) -> StepTokens:
    """Token counts of the step ``sampler`` started last (``batch_size`` rows of ``seq_len``)."""
    if isinstance(sampler, SftSampler):
        targets, padding = sampler.step_counts
        return StepTokens(targets, targets, padding)
    return StepTokens(batch_size * seq_len, batch_size * (seq_len - 1), 0)
