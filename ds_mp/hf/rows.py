"""The Trainer's micro-batches as ds_mp's fixed rows.

A pipeline announces its activation shape once, so every micro-batch of a run has the same
``(rows, seq_len)``: ``rows`` = ``per_device_train_batch_size``, ``seq_len`` = ``ds_mp.data.seq_len``.
A collator's batch (dynamic padding, a short last batch) is padded on the right and at the bottom:

    input_ids -> 0,   labels -> -100,   attention_mask -> 0,   position_ids -> 0, 1, 2, ... (a new document)

Right padding changes no target's logits (causal attention reads only earlier tokens), padded
labels are -100 (no target), so the per-token loss, its gradient and the target count are those of
the unpadded batch.  A step with fewer than ``gradient_accumulation_steps`` micro-batches (the end
of an epoch) is filled with micro-batches without targets.

Under a launcher (any world > 1, one DP replica included), Accelerate's ``BatchSamplerShard``
(``even_batches``) fills the epoch's last round of batches with rows repeated from its start, so that
every replica reads a full batch (a short last batch is topped up even for one replica); the plain
Trainer on one process trains those rows once.  :class:`RealRowsShard` drops the repeated rows of a
partly filled batch (its padding then has no targets), and :func:`real_rows` tells which batches
hold none (the mixin trains them as micro-batches without targets).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ds_mp.models.batch import HF_KEYS

_PAD = {"input_ids": 0, "labels": -100, "attention_mask": 0}


def fixed_rows(batch: dict, rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``batch`` (HF keys, ``(B, T)`` with B ≤ rows, T ≤ seq_len) padded to ``(rows, seq_len)``."""
    extra = [k for k in batch if k not in HF_KEYS]
    if extra:
        raise ValueError(f"batch: key {extra[0]!r} is not used by ds_mp (accepted: {', '.join(HF_KEYS)}); drop it in "
                         "the data collator or the dataset's columns")
    if "labels" not in batch:
        raise ValueError("batch: no 'labels'; a causal-LM collator (DataCollatorForLanguageModeling(mlm=False)) adds "
                         "them")
    B, T = batch["input_ids"].shape
    if B > rows or T > seq_len:
        raise ValueError(f"batch: shape {(B, T)} exceeds ({rows}, {seq_len}) = (per_device_train_batch_size, "
                         "ds_mp.data.seq_len); raise data.seq_len or cut the sequences")
    out = {}
    for key, x in batch.items():
        if key == "position_ids":
            x = x.expand(B, T)
            tail = torch.arange(seq_len - T, device=x.device, dtype=x.dtype).expand(B, -1)
            x = torch.cat([x, tail], dim=1)
            out[key] = torch.cat([x, torch.arange(seq_len, device=x.device, dtype=x.dtype).expand(rows - B, -1)])
        else:
            out[key] = F.pad(x, (0, seq_len - T, 0, rows - B), value=_PAD[key])
    return out


def empty_rows(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch of the shape of ``like`` without a target (fills a short step); a loss's extra
    tensor (a key beyond HF's, e.g. DPO's ``ref_logps``) is zeros."""
    out = {k: torch.full_like(v, _PAD.get(k, 0)) for k, v in like.items() if k != "position_ids"}
    if "position_ids" in like:
        out["position_ids"] = torch.arange(like["input_ids"].shape[1], device=like["input_ids"].device).expand_as(
            like["input_ids"]).contiguous()
    return out


def step_rows(batches: list[dict], n: int, rows: int, seq_len: int) -> list[dict[str, Any]]:
    """One optimizer step's ``n`` micro-batches in fixed rows (short steps filled without targets)."""
    fixed = [fixed_rows(b, rows, seq_len) for b in batches]
    return fixed + [empty_rows(fixed[0]) for _ in range(n - len(fixed))]


def real_rows(total: int, per_batch: int, index: int) -> int:
    """Rows of the dataset (``total`` rows, cut in batches of ``per_batch``) in the epoch's batch
    ``index`` (over every replica: replica d's k-th batch is k·DP + d); 0 for a batch of repeats."""
    return max(0, min(per_batch, total - index * per_batch))


@functools.cache
def _shard_class() -> type:
    from accelerate.data_loader import BatchSamplerShard

    class RealRowsShard(BatchSamplerShard):
        """Accelerate's shard over DP replicas whose batches end at the dataset's last row: the
        repeated rows ``even_batches`` appends are dropped (a batch of repeats only is kept whole,
        for :func:`real_rows` to find)."""

        ds_mp_total: int = 0

        def __iter__(self) -> Any:
            for k, batch in enumerate(super().__iter__()):
                real = real_rows(self.ds_mp_total, self.batch_size, k * self.num_processes + self.process_index)
                yield batch[:real] if real else batch
    return RealRowsShard


def keep_real_rows(shard: Any, total: int) -> bool:
    """Make Accelerate's ``shard`` (a ``BatchSamplerShard`` that fills the last round) drop the
    repeated rows; returns whether it fills at all (no drop_last, no split_batches, a fixed
    batch size)."""
    if shard.split_batches or shard.drop_last or not shard.even_batches or shard.batch_size is None:
        return False
    shard.__class__ = _shard_class()  # the loader's batch_sampler cannot be replaced once it is built
    shard.ds_mp_total = total
    return True


class Repeats:
    """Which batches of the train loader over ``shard`` (a :func:`keep_real_rows` shard, read in
    steps of ``accumulation`` batches) hold only Accelerate's repeats: they train without targets."""

    def __init__(self, shard: Any, accumulation: int) -> None:
        self.total, self.per_batch, self.dp, self.dp_rank = (shard.ds_mp_total, shard.batch_size,
                                                             shard.num_processes, shard.process_index)
        self.steps_per_epoch = -(-len(shard) // accumulation)  # the Trainer's num_update_steps_per_epoch
        self.accumulation = accumulation
        self.epoch: tuple[Any, int] = (None, 0)  # (the epoch's iterator, batches it gave)

    def real(self, epoch_iterator: Any, n: int, global_step: int) -> list[bool]:
        """For the next ``n`` batches of ``epoch_iterator`` (before optimizer step ``global_step``):
        False where the batch holds repeats only."""
        seen_iter, seen = self.epoch
        if seen_iter is not epoch_iterator:  # a new epoch, or a resumed one: where this step starts in it
            seen = (global_step % self.steps_per_epoch) * self.accumulation
        self.epoch = (epoch_iterator, seen + n)
        return [real_rows(self.total, self.per_batch, (seen + i) * self.dp + self.dp_rank) > 0 for i in range(n)]


__all__ = ["fixed_rows", "empty_rows", "step_rows", "real_rows", "keep_real_rows", "Repeats"]
