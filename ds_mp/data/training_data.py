"""The batches a training run reads: the sampler over the training split and the held-out batches."""
from __future__ import annotations

from typing import Any

from .dataset import ChunkSampler, TokenDataset
from .sft import SftDataset, SftRows, SftSampler
from .validation import HeldOutBatches, validation_rows


def training_batches(cfg: Any, train: TokenDataset, val: TokenDataset, micro_batch: int, grad_accum: int,
                     dp_rank: int, dp_size: int) -> tuple[ChunkSampler, Any, dict | None]:
    """``(sampler, held-out batches, report)`` for a validated ds_mp config: chunks of a stream
    dataset, or rows of an SFT dataset (``report``: its overlong/packing counts, None for stream).
    The held-out batches (:class:`ds_mp.data.validation.HeldOutBatches`: every row of the split
    once, in passes of ``grad_accum`` micro-batches, at most ``training.eval_batches`` passes when
    that is > 0) are None when there is no held-out split (``--val-fraction 0``, no ``data.val_path``)."""
    seq_len, seed = cfg.data.seq_len, cfg.data.seed
    held = validation_rows(cfg, train, val)
    batches = None if held is None else HeldOutBatches(held, seq_len, micro_batch, grad_accum, dp_rank, dp_size,
                                                         cfg.training.eval_batches)
    if train.info.format == "stream":
        return ChunkSampler(train, seq_len, micro_batch, grad_accum, dp_rank, dp_size, seed), batches, None
    rows = SftRows(SftDataset(train), seq_len, packing=cfg.data.packing, overlong=cfg.data.overlong, seed=seed)
    return SftSampler(rows, micro_batch, grad_accum, dp_rank, dp_size, seed), batches, rows.report
