"""The micro-batches ds_mp accepts, and the attention layout a micro-batch gives the model.

Accepted forms (every tensor ``(B, T)``, integer):

    (input_ids, labels)
    ((input_ids,), labels)  ((input_ids, position_ids), labels)
    {"input_ids": …, "labels": …, "position_ids": …, "attention_mask": …}   (HF's key names; the last two optional)

plus, in a dict batch, the extra tensors the run's loss names (``LossSpec.extras``, e.g. a preference
loss's reference log-probs): each a tensor whose first dimension is the batch's rows, carried to the
loss with the targets (``MicroBatch.extras``).

``position_ids`` follow HF's packing convention (``transformers.DataCollatorWithFlattening``): within
a row they count up by one and restart at 0 where a new document starts; a token attends only to
earlier tokens of its own document, and its position (GPT-2's absolute embedding, Llama's rotary
angle) is its place in the document.  ``attention_mask`` is a padding mask (1 = token, 0 = padding,
left or right): no token attends to a padding key, and a padding query attends to nothing (its
attention output is 0, torch's SDPA convention for a fully masked row, which HF's default ``sdpa``
attention relies on).  Labels are HF's, shifted: with left padding and the first real token's label
a target, the last padding position predicts it from its own embedding (attention output 0), exactly
as HF's model does with the same ``attention_mask``; put -100 there to train as HF on the unpadded
row (HF's ``eager`` attention instead averages such a query over the whole row, later tokens
included: another number, and one that sees the answer).  A model with a sliding window (Mistral) also
limits each query to the ``window`` latest keys (itself included), as HF does.  Anything else
(another key, a third element, a float mask) is refused, naming it: ds_mp never ignores an input.

:class:`Layout` holds a micro-batch's ``positions`` and ``docs`` (document id per token, -1 for a
padding key); the attention mask it builds is, for query index i and key index j,

    allowed(i, j) = j <= i  and  docs[j] == docs[i]  and  docs[j] >= 0  and  i - j < window

so a padding query (docs[i] = -1) has no key: SDPA gives it 0, as HF with the mask (see above).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

HF_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


@dataclass
class MicroBatch:
    """One micro-batch in ds_mp's terms (see the module docstring)."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 = not a target; HF's shift applies (logits[t] predicts labels[t+1])
    position_ids: torch.Tensor | None = None  # (B, T) packed documents, or None (0 … T-1)
    attention_mask: torch.Tensor | None = None  # (B, T) 1 = token, 0 = padding, or None (all tokens)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss's extra tensors, rows first

    def targets(self) -> torch.Tensor:
        """Shifted labels: ``targets[:, t] = labels[:, t+1]``, the last position -100, and -100 where
        token t+1 starts a new document (no prediction crosses a document boundary)."""
        targets = F.pad(self.labels[:, 1:], (0, 1), value=-100)
        if self.position_ids is not None:
            starts = F.pad(self.position_ids.expand_as(self.labels)[:, 1:] == 0, (0, 1), value=False)
            targets = targets.masked_fill(starts, -100)
        return targets

    def layout(self, window: int | None = None) -> "Layout | None":
        """The attention layout, or None when plain causal attention over 0 … T-1 is exact."""
        B, T = self.input_ids.shape
        window = window if window is not None and window < T else None
        if self.position_ids is None and self.attention_mask is None and window is None:
            return None
        arange = torch.arange(T, device=self.input_ids.device).expand(B, T)
        pos = arange if self.position_ids is None else self.position_ids.expand(B, T)
        docs = torch.cumsum((pos == 0).long(), dim=1)  # a new document wherever the positions restart
        if self.attention_mask is not None:
            docs = torch.where(self.attention_mask.bool(), docs, torch.full_like(docs, -1))
        plain = torch.equal(pos, arange) and bool((docs >= 0).all())
        if plain and window is None:
            return None
        return Layout(pos.contiguous(), docs, window)


@dataclass
class Layout:
    """A micro-batch's positions and documents (module docstring), rows ``(B, T)``.

    Under context parallelism (CP) ``positions`` and ``docs`` stay the FULL row's ``(B, T)`` (so
    RoPE, GPT-2's position table, sliding windows and document masks are the full row's) and
    ``q_index`` ``(T/C,)`` holds the ascending full-row indices of the tokens this CP rank holds
    (``ds_mp.context_parallel.shard.shard_index``; the same for every row); None without CP."""

    positions: torch.Tensor  # (B, T) long
    docs: torch.Tensor  # (B, T) long, -1 = padding key
    window: int | None = None
    q_index: torch.Tensor | None = None  # (T/C,) long: this CP rank's full-row token indices, None = all
    masks: dict = field(default_factory=dict, repr=False)  # (q_len, k_len, …) -> mask(s): built once, read by every block

    def rows(self, r0: int, r1: int) -> "Layout":
        return Layout(self.positions[r0:r1], self.docs[r0:r1], self.window, self.q_index)

    def kept_tokens(self) -> torch.Tensor | None:
        """``(B·T,)`` fp32, 1 where a token is no padding (``docs >= 0``), in row-major order; None when
        every token is kept.  Built once per micro-batch (cached with the masks): one host sync, not one
        per layer that reads it (every MoE layer's router statistics, ``ds_mp.models.carry``)."""
        if "kept" not in self.masks:
            keep = self.docs >= 0
            self.masks["kept"] = None if bool(keep.all()) else keep.reshape(-1).float()
        return self.masks["kept"]

    def local_positions(self) -> torch.Tensor:
        """The positions of the tokens this rank holds: ``positions[:, q_index]`` ``(B, T/C)`` under
        CP, else ``positions``."""
        return self.positions if self.q_index is None else self.positions[:, self.q_index]

    def mask(self, q_len: int, k_len: int, windowed: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Boolean SDPA mask ``(B, 1, q_len, k_len)`` (True = attend) for the queries at indices
        ``k_len - q_len … k_len - 1`` against the keys ``0 … k_len - 1`` (a TeraPipe slice attends
        to its sequence's earlier slices: the keys before its own); ``windowed`` False: without the
        window (Gemma 3's full-attention layers between its sliding-window ones).  CP's ``ulysses``
        attends over the full row: ``mask(T, T)``.  ``dtype``: the additive form (0 = attend, -inf
        = not) in that dtype, built once and passed to every layer's SDPA, which holds this one
        tensor for backward (given the boolean one it converts and holds a copy per call)."""
        key = (q_len, k_len, windowed and self.window is not None, dtype)
        if key not in self.masks:
            self.masks[key] = self._mask(torch.arange(k_len - q_len, k_len), k_len, key[2], dtype)
        return self.masks[key]

    def causal_only(self, windowed: bool = True) -> bool:
        """Whether the full row's mask is plain causality: one document per row, no padding, no window
        shorter than the row (``windowed``).  CP's ``ulysses`` then asks SDPA for ``is_causal`` and
        holds no ``T × T`` mask at all (``allgather``'s chunks are lower-right blocks, which SDPA's
        ``is_causal`` does not express)."""
        key = ("causal", windowed and self.window is not None and self.window < self.docs.shape[1])
        if key not in self.masks:
            self.masks[key] = not key[1] and bool(((self.docs == self.docs[:, :1]) & (self.docs >= 0)).all())
        return self.masks[key]

    def run_masks(self, runs: int, windowed: bool = True, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """CP's ``allgather``: this rank's tokens ``q_index`` cut into ``runs`` equal runs (the zigzag's
        two chunks), and for each run the rows of the full mask against the keys up to its last token
        ``(B, 1, T/(C·runs), last + 1)``: every later key is masked by causality, so SDPA need not
        score it (the zigzag then gives every rank the same work).  Built once, as :meth:`mask`."""
        key = ("runs", runs, windowed and self.window is not None, dtype)
        if key not in self.masks:
            self.masks[key] = [self.run_mask(runs, i, windowed, dtype) for i in range(runs)]
        return self.masks[key]

    def run_mask(self, runs: int, i: int, windowed: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Run ``i``'s mask of :meth:`run_masks`, built anew on every call (not cached): CP's
        ``allgather`` builds it in forward and again in backward, and holds none between."""
        key = ("run_ends", runs)
        if key not in self.masks:
            if self.q_index is None or len(self.q_index) % runs:
                raise ValueError(f"Layout.run_masks: q_index of {None if self.q_index is None else len(self.q_index)} "
                                 f"tokens does not cut into {runs} runs")
            self.masks[key] = self.q_index.view(runs, -1)[:, -1].tolist()  # each run's last index: one sync
        run = self.q_index.view(runs, -1)[i]
        return self._mask(run, self.masks[key][i] + 1, windowed and self.window is not None, dtype)

    def _mask(self, q_idx: torch.Tensor, k_len: int, windowed: bool, dtype: torch.dtype | None) -> torch.Tensor:
        """The rows ``q_idx`` (full-row indices) of the mask against the keys ``0 … k_len - 1``."""
        dev = self.docs.device
        qi, kj = q_idx.to(dev)[:, None], torch.arange(k_len, device=dev)[None, :]
        allowed = kj <= qi  # (q, k)
        if windowed:
            allowed = allowed & (qi - kj < self.window)
        dq, dk = self.docs[:, qi[:, 0], None], self.docs[:, None, :k_len]  # (B, q, 1), (B, 1, k)
        allowed = (allowed & (dq == dk) & (dk >= 0)).unsqueeze(1)  # a padding query: no key (SDPA's output 0, HF's)
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, float("-inf"))


def _tensor(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"batch: {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex():
        raise ValueError(f"batch: {what} must be an integer tensor, got {x.dtype}")
    return x


def parse_micro_batch(batch: Any, extras: tuple[str, ...] = ()) -> MicroBatch:
    """One micro-batch of any accepted form (module docstring) as a :class:`MicroBatch`; ``extras``
    are the keys the run's loss reads besides HF's (a dict batch must have each); anything ds_mp
    would not use raises ``ValueError`` naming it."""
    if extras and not isinstance(batch, dict):
        raise ValueError(f"batch: the loss needs the extras {list(extras)}; pass each micro-batch as a dict "
                         f"with {', '.join(HF_KEYS[:2])} and {', '.join(extras)}")
    if isinstance(batch, dict):
        extra = [k for k in batch if k not in HF_KEYS and k not in extras]
        if extra:
            flat = extra[0] in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
            raise ValueError(f"batch: key {extra[0]!r} is not used by ds_mp (accepted: {', '.join(HF_KEYS)}); " + (
                "a flattened batch (DataCollatorWithFlattening, TRL padding-free): re-form it into fixed rows with "
                "ds_mp.data.flatten.unflatten_all (docs/batches.md)" if flat else "remove it from the batch"))
        for key in ("input_ids", "labels", *extras):
            if key not in batch:
                raise ValueError(f"batch: dict batch without {key!r} (accepted keys: {', '.join(HF_KEYS + extras)})")
        mb = MicroBatch(*(batch.get(k) for k in HF_KEYS), extras={k: batch[k] for k in extras})
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, labels = batch
        if isinstance(inputs, (tuple, list)):
            if not 1 <= len(inputs) <= 2:
                raise ValueError(f"batch: inputs tuple of {len(inputs)} tensors; ds_mp uses (input_ids,) or "
                                 "(input_ids, position_ids); pass an attention_mask in a dict batch")
            mb = MicroBatch(inputs[0], labels, inputs[1] if len(inputs) == 2 else None)
        else:
            mb = MicroBatch(inputs, labels)
    else:
        n = len(batch) if isinstance(batch, (tuple, list)) else None
        raise ValueError(f"batch: expected (inputs, labels) or a dict with {', '.join(HF_KEYS)}, got "
                         f"{type(batch).__name__}" + (f" of {n} elements" if n is not None else ""))
    return _checked(mb)


def _checked(mb: MicroBatch) -> MicroBatch:
    ids, labels = _tensor(mb.input_ids, "input_ids"), _tensor(mb.labels, "labels")
    if ids.dim() != 2:
        raise ValueError(f"batch: input_ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
    if labels.shape != ids.shape:
        raise ValueError(f"batch: labels of shape {tuple(labels.shape)}, input_ids {tuple(ids.shape)}; they must match")
    if mb.position_ids is not None:
        pos = _tensor(mb.position_ids, "position_ids")
        if pos.dim() != 2 or pos.shape[1] != ids.shape[1] or pos.shape[0] not in (1, ids.shape[0]):
            raise ValueError(f"batch: position_ids of shape {tuple(pos.shape)}, input_ids {tuple(ids.shape)}")
        steps = pos[:, 1:]
        ok = bool((pos >= 0).all()) and bool(((steps == 0) | (steps == pos[:, :-1] + 1)).all())
        if not ok:
            raise ValueError("batch: position_ids must count up by 1 within a document and restart at 0 at the next "
                             "(HF's DataCollatorWithFlattening); a padding mask goes under 'attention_mask' "
                             "in a dict batch")
        mb.position_ids = pos
    if mb.attention_mask is not None:
        mask = _tensor(mb.attention_mask, "attention_mask")
        if mask.shape != ids.shape or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"batch: attention_mask must be 0/1 of the shape of input_ids {tuple(ids.shape)} "
                             "(a padding mask: 1 = token, 0 = padding)")
    for key, x in mb.extras.items():
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != ids.shape[0]:
            raise ValueError(f"batch: {key!r} must be a tensor with one row per sequence ({ids.shape[0]}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return mb


__all__ = ["HF_KEYS", "MicroBatch", "Layout", "parse_micro_batch"]
