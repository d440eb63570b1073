"""The held-out data training validates on: every row of the split once, and its per-token loss.

``val_loss`` is the loss per target token over the whole held-out split (or the first rows of
it, ``training.eval_batches`` > 0):

    val_loss = Σ_rows Σ_targets ℓ  /  Σ_rows targets

The rows (chunks of a stream dataset, planned rows of an SFT split) are read in order, in passes
of ``per_pass`` micro-batches on each of the ``dp_size`` replicas, laid out like a training step
(``[pass, per_pass, dp_size, micro_batch]``); the last pass is filled with empty rows (labels all
-100), so no row is read twice and none is left out, whatever the split's size.  The engine's
``eval_batch`` returns a pass's per-target-token mean over all replicas (``loss.normalization =
"tokens"``, ds_mp.engine.batches) and ``step_info.count`` its target count N_p; the passes are
summed as Σ_p L_p · N_p / Σ_p N_p (:func:`held_out_loss`), the same number ``ds-mp eval --format``
prints for the same documents (:func:`ds_mp.tools.evaluate.sft_nll`).  Under the opt-in
``loss.normalization = "micro_batch"`` a pass's L_p is DeepSpeed's mean of micro-batch means, and
so the sum is weighted by target counts but not exactly per token.

A mixture of experts with its aux loss on (``output_router_logits``, ``ds_mp.models.carry``) adds HF's
term as HF's model adds it to the loss it returns in evaluation, pooled per forward — here per held-out
micro-batch, the unit the launcher's training pools it over:

    val_loss = (the per-target-token LM loss above) + Σ_mb n_mb · coef · aux(mb) / Σ_mb n_mb

over the micro-batches mb holding n_mb > 0 rows of the split (HF's Trainer averages its eval batches'
losses alike, each weighted by its rows).  The last pass's filler
rows then carry an ``attention_mask`` of 0 (:attr:`HeldOutBatches.mask_filler`), so they pool into no
micro-batch's router statistics; micro-batches of filler only pool nowhere.  The aux part comes from
each eval step's carries (``engine.step_carries()``) summed per micro-batch (:class:`PooledAux`).

The held-out split is the dataset's own (``--val-fraction``), or a records file named by
``data.val_path`` (encoded at start-up with the dataset's tokenizer, format and chat template),
or none (``--val-fraction 0`` and no ``data.val_path``: no validation).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from .errors import DataError
from .sft import IGNORE, SftDataset, SftRows

if TYPE_CHECKING:
    from ds_mp.engine_view import EngineView


class HeldOutBatches:
    """Every row of ``rows`` (a :class:`~ds_mp.data.TokenDataset` or :class:`SftRows`) once, as this
    DP rank's micro-batches in passes of ``per_pass`` (module docstring); ``max_passes`` > 0 reads
    only the first ``max_passes`` passes' rows.  Re-iterable: each ``iter()`` starts again."""

    def __init__(self, rows: Any, seq_len: int, micro_batch: int, per_pass: int, dp_rank: int = 0, dp_size: int = 1,
                 max_passes: int = 0) -> None:
        if min(micro_batch, per_pass, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"held-out batches: micro_batch={micro_batch}, per_pass={per_pass}, dp_size={dp_size} "
                            f"must be >= 1 and dp_rank={dp_rank} in [0, dp_size)")
        self.rows, self.seq_len, self.micro_batch, self.per_pass = rows, seq_len, micro_batch, per_pass
        self.dp_rank, self.dp_size = dp_rank, dp_size
        per = micro_batch * per_pass * dp_size
        self.num_rows = rows.num_chunks(seq_len)
        if max_passes > 0:
            self.num_rows = min(self.num_rows, max_passes * per)
        self.passes = math.ceil(self.num_rows / per)
        self.mask_filler = False  # filler rows beside real ones as padding (attention_mask 0): a MoE's aux loss

    def groups(self, dp_rank: int) -> list[int | None]:
        """For each micro-batch replica ``dp_rank`` reads (all passes, in order): its first row if it
        holds a row of the split, else None (filler only): the pooling of :class:`PooledAux`."""
        out: list[int | None] = []
        for p in range(self.passes):
            for k in range(self.per_pass):
                first = ((p * self.per_pass + k) * self.dp_size + dp_rank) * self.micro_batch
                out.append(first if first < self.num_rows else None)
        return out

    def pooled_aux(self, carry: Any) -> "PooledAux":
        """The aux term of ``carry`` pooled per micro-batch, each weighted by its rows of the split."""
        groups = [self.groups(d) for d in range(self.dp_size)]
        weights = {g: float(min(self.micro_batch, self.num_rows - g)) for gs in groups for g in gs if g is not None}
        return PooledAux(carry, groups, weights)

    def __len__(self) -> int:
        """Micro-batches this rank reads in all passes."""
        return self.passes * self.per_pass

    def __iter__(self) -> Iterator[Any]:
        for p in range(self.passes):
            for k in range(self.per_pass):
                first = ((p * self.per_pass + k) * self.dp_size + self.dp_rank) * self.micro_batch
                ids = first + np.arange(self.micro_batch)
                real = ids < self.num_rows
                batch = self.rows.batch(np.where(real, ids, 0), self.seq_len)
                if not real.all():  # the last pass's filler rows: read as row 0, no target
                    batch[-1][torch.from_numpy(~real)] = IGNORE
                    if self.mask_filler and real.any():
                        batch = _masked(batch, torch.from_numpy(real))
                yield batch


def _masked(batch: Any, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """``batch`` (``(ids, labels)`` or ``((ids, positions), labels)``) as a dict whose
    ``attention_mask`` is 1 on the rows ``real`` and 0 on the others."""
    inputs, labels = batch
    ids, pos = inputs if isinstance(inputs, (tuple, list)) else (inputs, None)
    out = {"input_ids": ids, "labels": labels, "attention_mask": real[:, None].expand_as(ids).long().contiguous()}
    if pos is not None:
        out["position_ids"] = pos
    return out


class PooledAux:
    """A MoE's aux term pooled per group of eval micro-batches: ``groups[d][j]`` names the group of
    replica d's j-th micro-batch (over every eval step, in order; None: it pools nowhere).  Each group's
    carries are summed (the carry's sums are linear, ``ds_mp.models.carry``), and :meth:`value` is the
    mean over groups of ``carry.loss(Σ carries)`` = ``coef · E · Σ_e (C_e / R)(S_e / R)``, each group
    weighted by ``weights[group]`` (its rows, as HF's ``evaluation_loop`` weights its batches)."""

    def __init__(self, carry: Any, groups: list[list[Any]], weights: dict[Any, float]) -> None:
        self.carry, self.groups, self.weights = carry, groups, weights
        self.sums: dict[Any, torch.Tensor] = {}
        self.read = 0  # micro-batches per replica read so far

    def add(self, carries: torch.Tensor) -> None:
        """One eval step's ``engine.step_carries()`` (``(dp · M, size)``, replica-major)."""
        n = carries.shape[0] // len(self.groups)
        for d, groups in enumerate(self.groups):
            for i in range(n):
                j = self.read + i
                g = groups[j] if j < len(groups) else None
                if g is not None:
                    c = carries[d * n + i].double().cpu()
                    self.sums[g] = self.sums[g] + c if g in self.sums else c
        self.read += n

    def value(self) -> float:
        """The weighted mean over groups of their pooled ``coef · aux`` (0 without a group)."""
        if not self.sums:
            return 0.0
        total = sum(self.weights[g] for g in self.sums)
        return sum(self.weights[g] * float(self.carry.loss(c)) for g, c in self.sums.items()) / total


def held_out_loss(engine: EngineView, batches: HeldOutBatches) -> float:
    """The per-target-token loss over ``batches``, plus a MoE's aux term per micro-batch (module
    docstring); collective like ``engine.eval_batch``, every rank returns the same value."""
    carry = getattr(engine.module, "carry", None)
    batches.mask_filler = carry is not None
    pool = None if carry is None else batches.pooled_aux(carry)
    return pass_weighted_loss(engine, iter(batches), batches.passes, batches.per_pass, pool)


def pass_weighted_loss(engine: EngineView, micro_batches: Iterator[Any], passes: int, per_pass: int,
                       aux: PooledAux | None = None) -> float:
    """Σ_p L_p · N_p / Σ_p N_p over ``passes`` ``eval_batch`` calls of ``per_pass`` micro-batches each
    from ``micro_batches`` (this rank's, in order; a pass's L_p is its per-target-token LM loss over
    every replica, N_p its target count): the per-target-token loss of everything read, NaN without
    a target; with ``aux``, each pass's carries go to it and its :meth:`PooledAux.value` is added.
    Collective like ``engine.eval_batch``."""
    total = count = 0.0
    for _ in range(passes):
        loss = float(engine.eval_batch(micro_batches, num_micro_batches=per_pass))
        n = int(engine.step_info.count)
        total, count = total + loss * n, count + n
        if aux is not None:
            aux.add(engine.step_carries())
    lm = total / count if count else math.nan
    return lm if aux is None else lm + aux.value()


def records_split(path: str, info: Any) -> SftDataset:
    """The records file ``path`` (.jsonl/.parquet/.arrow) as a held-out SFT split, encoded like the
    dataset ``info`` describes: its saved tokenizer (with its chat template) and format.  Bad
    records raise (one line naming file:line); deterministic, so every rank builds the same."""
    from .sft_prepare import encode_documents, load_sft_tokenizer

    if info.format == "stream":
        raise DataError(f"ds_mp.data.val_path: {path} needs an SFT dataset (prepare-data --format); "
                        f"{info.path} is a pretraining stream")
    if not os.path.exists(path):
        raise DataError(f"ds_mp.data.val_path: {path} does not exist; name a .jsonl/.parquet/.arrow file of "
                        f"{info.format} records")
    tok = load_sft_tokenizer(info.tokenizer_dir, info.format)
    docs = [(ids, mask) for _, _, ids, mask in encode_documents([path], tok, info.format)]
    if not docs:
        raise DataError(f"ds_mp.data.val_path: {path} holds no record with a target token; check the file")
    lengths = np.array([len(i) for i, _ in docs], dtype=np.int64)
    dtype = np.dtype(info.dtype)
    return SftDataset.from_arrays(info, f"held-out file {path}",
                                  np.concatenate([np.asarray(i, dtype=dtype) for i, _ in docs]),
                                  np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in docs]),
                                  np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def validation_rows(cfg: Any, train: Any, val: Any) -> Any:
    """What validation reads for a validated ds_mp config: ``data.val_path``'s records, the dataset's
    val split, or None when there is no held-out split (``--val-fraction 0``)."""
    val_path = getattr(cfg.data, "val_path", "")
    if train.info.format == "stream":
        if val_path:
            records_split(val_path, train.info)  # raises: stream datasets take no records file
        return val if len(val) >= cfg.data.seq_len else None
    plan = dict(packing=cfg.data.packing, overlong=cfg.data.overlong, seed=cfg.data.seed)
    if val_path:
        return SftRows(records_split(val_path, train.info), cfg.data.seq_len, **plan)
    if val.info.val_documents == 0 or len(val) == 0:
        return None
    return SftRows(SftDataset(val), cfg.data.seq_len, **plan)
