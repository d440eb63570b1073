"""Reading token datasets: a memmap reader, the training sampler, validation batches.

A sample is a fixed-length chunk ``tokens[i*L:(i+1)*L]`` (L = seq_len); ``input_ids``
and ``labels`` are the same chunk (HF convention: the model shifts labels internally).

Training order is a *stream*: epoch e is a seeded permutation of all chunk indices,
epochs are concatenated, and every optimizer step takes the next
``global_batch = micro_batch * grad_accum * dp_size`` samples of the stream (a step may
straddle two epochs; nothing is dropped). Within a step the samples are laid out as
``[grad_accum, dp_size, micro_batch]``: DP rank r gets ``[:, r, :]``, so DP shards are
disjoint and together cover the step. The sampler knows nothing of TP or pipeline
ranks: every rank constructed with the same DP rank gets identical batches.
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import torch

from .errors import DataError
from .prepare import TRAIN_FILE, VAL_FILE, DatasetInfo

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels), each LongTensor [micro_batch, seq_len]


class TokenDataset:
    """Read-only memmap over one split (``"train"`` or ``"val"``) of a prepared dataset."""

    def __init__(self, path: str, split: str = "train") -> None:
        if split not in ("train", "val"):
            raise DataError(f"split={split!r} is unknown; use 'train' or 'val'")
        self.info = DatasetInfo.load(path)
        self.split = split
        n = self.info.train_tokens if split == "train" else self.info.val_tokens
        file = os.path.join(path, TRAIN_FILE if split == "train" else VAL_FILE)
        dtype = np.dtype(self.info.dtype)
        if not os.path.isfile(file) or os.path.getsize(file) != n * dtype.itemsize:
            raise DataError(f"{file} is missing or does not hold {n} {dtype.name} tokens; rebuild the dataset")
        self.tokens: np.ndarray = np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.empty(0, dtype)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def num_chunks(self, seq_len: int) -> int:
        """Number of whole chunks of ``seq_len`` tokens; raises :class:`DataError` if zero."""
        n = len(self) // seq_len
        if n < 1:
            raise DataError(
                f"{self.split} split of {self.info.path} has {len(self)} tokens, fewer than one sequence "
                f"(seq_len={seq_len}); add data or lower seq_len"
                + (" or raise --val-fraction" if self.split == "val" else "")
            )
        return n

    def batch(self, chunk_ids: np.ndarray, seq_len: int) -> Batch:
        """Stack the chunks ``chunk_ids`` into ``(input_ids, labels)`` of shape [len(chunk_ids), seq_len]."""
        x = np.stack([self.tokens[i * seq_len:(i + 1) * seq_len] for i in chunk_ids]).astype(np.int64)
        ids = torch.from_numpy(x)  # (B, T)
        return ids, ids.clone()


def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v < 1:
            raise DataError(f"{k}={v!r} must be a positive integer")


def _check_dp(dp_rank: int, dp_size: int) -> None:
    _check_positive(dp_size=dp_size)
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


class ChunkSampler:
    """Deterministic, resumable training sampler for one DP rank (see module docstring).

    Two ways to consume it, not to be mixed within a step:
    - ``next_step()`` -> ``grad_accum`` micro-batches of this rank for the next step;
    - as an infinite iterator (``next(sampler)`` -> one micro-batch), the form
      ``PipelineEngine.train_batch(data_iter=sampler)`` expects. In a pipeline only the
      first and last stages call ``next``; restore other stages with ``load_state_dict``
      from a consuming rank's state or with ``set_step`` from the global step.
    ``state_dict()`` / ``load_state_dict()`` resume exactly (also mid-step in iterator
    form): no sample is repeated or skipped.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch: int, grad_accum: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        _check_positive(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum)
        _check_dp(dp_rank, dp_size)
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        self.micro_batch, self.grad_accum, self.dp_rank, self.dp_size = micro_batch, grad_accum, dp_rank, dp_size
        self.num_chunks = dataset.num_chunks(seq_len)
        self.global_batch = micro_batch * grad_accum * dp_size
        self._consumed = 0  # samples of the stream taken by started steps
        self._pending: list[Batch] = []  # micro-batches of the started step not yet returned by next()
        self._perms: dict[int, np.ndarray] = {}

    # --- the stream ---------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_chunks)
        return self._perms[epoch]

    def _stream(self, start: int, count: int) -> np.ndarray:
        """Chunk ids at stream positions ``start .. start+count-1``."""
        parts = []
        while count > 0:
            epoch, pos = divmod(start, self.num_chunks)
            take = min(count, self.num_chunks - pos)
            parts.append(self._perm(epoch)[pos:pos + take])
            start, count = start + take, count - take
        return np.concatenate(parts)

    def _step_at(self, start: int) -> list[Batch]:
        ids = self._stream(start, self.global_batch).reshape(self.grad_accum, self.dp_size, self.micro_batch)
        return [self.dataset.batch(ids[k, self.dp_rank], self.seq_len) for k in range(self.grad_accum)]

    # --- public API -----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be drawn."""
        return self._consumed // self.num_chunks

    @property
    def steps_per_epoch(self) -> float:
        return self.num_chunks / self.global_batch

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of global step ``step`` (random access, no state change),
        assuming the current global batch size was used since step 0."""
        return self._step_at(step * self.global_batch)

    def next_step(self) -> list[Batch]:
        """This rank's ``grad_accum`` micro-batches, each [micro_batch, seq_len], of the next step."""
        if self._pending:
            raise RuntimeError("next_step() called in the middle of a step consumed with next(); finish the step first")
        batches = self._step_at(self._consumed)
        self._consumed += self.global_batch
        return batches

    def set_grad_accum(self, grad_accum: int) -> None:
        """From the next step on, take ``grad_accum`` micro-batches per rank (global batch =
        micro_batch × grad_accum × dp_size; a batch-size ramp).  Only between steps."""
        _check_positive(grad_accum=grad_accum)
        if self._pending:
            raise RuntimeError("set_grad_accum() called in the middle of a step; change the batch between steps")
        self.grad_accum, self.global_batch = grad_accum, self.micro_batch * grad_accum * self.dp_size

    def set_step(self, step: int) -> None:
        """Position the sampler at the start of global step ``step`` (constant global batch assumed)."""
        self._consumed, self._pending = step * self.global_batch, []

    def __iter__(self) -> "ChunkSampler":
        return self

    def __next__(self) -> Batch:
        if not self._pending:
            self._pending = self._step_at(self._consumed)
            self._consumed += self.global_batch
        return self._pending.pop(0)

    @property
    def consumed_samples(self) -> int:
        """Samples of the stream taken by the steps started so far (all DP ranks together)."""
        return self._consumed

    def state_dict(self) -> dict:
        """``{"epoch", "position", "consumed_samples", "micro_step", "global_batch", ...}``: where the
        next sample comes from.  Between steps (``micro_step`` 0) the state is independent of
        the layout: a sampler with another DP size or micro-batch resumes from the same stream
        position (the stream is one seeded permutation per epoch, whatever the global batch)."""
        micro_step = (self.grad_accum - len(self._pending)) % self.grad_accum
        start = self._consumed - (self.global_batch if self._pending else 0)
        epoch, position = divmod(start, self.num_chunks)
        return {"epoch": epoch, "position": position, "consumed_samples": start, "micro_step": micro_step,
                "global_batch": self.global_batch, "seed": self.seed, "num_chunks": self.num_chunks,
                "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the sampler that produced ``state`` stopped.

        At a step boundary any DP size / global batch may resume (no sample repeated or
        skipped); in the middle of a step (``micro_step`` > 0) only the same global batch can.
        """
        for key in ("seed", "num_chunks", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(f"sampler state has {key}={state[key]} but this run has {getattr(self, key)}; "
                                f"resume with the same dataset, seq_len and data seed")
        if state.get("micro_step", 0) and state.get("global_batch", self.global_batch) != self.global_batch:
            raise DataError(f"sampler state was saved {state['micro_step']} micro-batches into a step of global batch "
                            f"{state['global_batch']}; this run's global batch is {self.global_batch}: resume "
                            "mid-step with the same micro_batch × grad_accum × DP, or from a step checkpoint")
        self._consumed = state["epoch"] * self.num_chunks + state["position"]
        self._pending = []
        if state.get("micro_step", 0):
            self._pending = self._step_at(self._consumed)[state["micro_step"]:]
            self._consumed += self.global_batch


class ValidationBatches:
    """A fixed, re-iterable sequence of validation micro-batches for one DP rank.

    Chunks are read in order (no shuffle); batch b of rank r holds chunks
    ``(b * dp_size + r) * micro_batch + j``, wrapping around the split if
    ``num_batches`` asks for more than it holds. ``num_batches=None`` takes every whole
    batch (at least one). Each ``iter()`` starts from the beginning.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch: int, num_batches: int | None = None,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        _check_positive(seq_len=seq_len, micro_batch=micro_batch)
        _check_dp(dp_rank, dp_size)
        self.dataset, self.seq_len, self.micro_batch = dataset, seq_len, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_chunks = dataset.num_chunks(seq_len)
        if num_batches is None:
            num_batches = max(1, self.num_chunks // (micro_batch * dp_size))
        _check_positive(num_batches=num_batches)
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for b in range(self.num_batches):
            first = (b * self.dp_size + self.dp_rank) * self.micro_batch
            yield self.dataset.batch((first + np.arange(self.micro_batch)) % self.num_chunks, self.seq_len)
