"""TRL's preference batches as ds_mp's DPO micro-batches, and TRL's DPO metrics from the last stage's rows.

TRL's ``DataCollatorForPreference`` collates ``b`` pairs into ``2b`` rows ``[c_1 … c_b; r_1 … r_b]``
(``input_ids``, ``attention_mask``, ``completion_mask``, and ``ref_chosen_logps`` /
``ref_rejected_logps`` ``(b,)`` where they were precomputed).  :func:`preference_rows` turns one into
the fixed ``(2·pairs, seq_len)`` micro-batch of the ``"dpo"`` loss spec (``ds_mp.losses.dpo``):

    rows 0 … pairs-1 = the chosen halves, rows pairs … 2·pairs-1 = the rejected halves, pair k = rows (k, pairs+k)
    labels     = input_ids where completion_mask is 1, else -100 (TRL's labels; the engine shifts them)
    ref_logps  = (2·pairs,) float: [ref_chosen; ref_rejected] (0 where not yet known, and on padding)

A short batch (``b < pairs``) is padded *per half* (``[c_1 … c_b, pad …; r_1 … r_b, pad …]``), so a
pair never straddles the halves; padding rows are all -100 with ``attention_mask`` 0.

:func:`step_stats` reads the spec's per-row values of a step (policy and reference completion
log-prob sums, ``engine.step_rows()``) into the sums TRL's metrics average, per micro-batch; :func:`micro_batch_means` averages them the way TRL
logs them: the mean over micro-batches (in the order a single process reads them) of each
micro-batch's mean over its pairs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: TRL 1.16's logged DPO metric names, in the order :func:`pair_stats` sums them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
#: The loss spec's extra: the reference completion log-prob sum of each row.
REF_KEY = "ref_logps"


def _halves(x: torch.Tensor, pairs: int, seq_len: int | None, value: float) -> torch.Tensor:
    """``x`` (``2b`` rows, chosen then rejected) with each half padded to ``pairs`` rows (and the
    columns to ``seq_len``, when given) with ``value``."""
    b = x.shape[0] // 2
    cols = (0, seq_len - x.shape[1]) if seq_len is not None else (0, 0)
    pad = (*cols, 0, pairs - b) if x.dim() == 2 else (0, pairs - b)
    return torch.cat([F.pad(x[:b], pad, value=value), F.pad(x[b:], pad, value=value)])


def preference_rows(batch: dict[str, Any], pairs: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One TRL preference batch (module docstring) as the ``"dpo"`` spec's ``(2·pairs, seq_len)``
    micro-batch; raises ``ValueError`` naming what does not fit."""
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    rows, length = ids.shape
    if rows % 2 or rows // 2 > pairs:
        raise ValueError(f"batch: {rows} rows; a preference batch is [chosen; rejected] rows of at most "
                         f"{pairs} pairs (per_device_train_batch_size)")
    if length > seq_len:
        raise ValueError(f"batch: {length} tokens exceed ds_mp.data.seq_len={seq_len}; set max_length (it sets "
                         "seq_len) or raise data.seq_len")
    labels = ids.masked_fill(completion == 0, -100)
    out = {"input_ids": _halves(ids, pairs, seq_len, 0), "attention_mask": _halves(mask, pairs, seq_len, 0),
           "labels": _halves(labels, pairs, seq_len, -100)}
    ref = torch.zeros(rows, dtype=torch.float32)
    if "ref_chosen_logps" in batch:
        ref = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).float()
    out[REF_KEY] = _halves(ref, pairs, None, 0.0)
    return out


def step_stats(rows: dict[str, torch.Tensor], rows_per_micro: int, beta: float) -> list[torch.Tensor]:
    """The :func:`pair_stats` of every micro-batch of a step, from the engine's ``step_rows()``
    (``logps``, ``ref_logps``, ``targets`` per row, ``rows_per_micro`` rows per micro-batch, every
    replica's in turn): a pair is real where its chosen or rejected row has a completion token."""
    out = []
    for start in range(0, rows["logps"].shape[0], rows_per_micro):
        cut = slice(start, start + rows_per_micro)
        has = (rows["targets"][cut] > 0).cpu()
        real = has.chunk(2)[0] | has.chunk(2)[1]
        out.append(pair_stats(rows["logps"][cut], rows["ref_logps"][cut], real, beta))
    return out


def pair_stats(logps: torch.Tensor, ref_logps: torch.Tensor, real: torch.Tensor, beta: float) -> torch.Tensor:
    """``(1 + len(METRICS),)`` float64: the micro-batch's real pairs and the sum over them of each of
    :data:`METRICS` (TRL's definitions: reward = β · (policy - reference) completion log-prob sum)."""
    logps, ref_logps, real = logps.double().cpu(), ref_logps.double().cpu(), real.double().cpu()
    c_logps, r_logps = logps.chunk(2)
    c_ref, r_ref = ref_logps.chunk(2)
    c_rew, r_rew = beta * (c_logps - c_ref), beta * (r_logps - r_ref)
    values = torch.stack([c_rew, r_rew, (c_rew > r_rew).double(), c_rew - r_rew, c_logps, r_logps])
    return torch.cat([real.sum().view(1), (values * real).sum(dim=1)])


def pairs_loss(spec: Any, logps: torch.Tensor, ref_logps: torch.Tensor, counts: torch.Tensor) -> float:
    """The mean over pairs of the loss ``spec`` (``ds_mp.losses.dpo.DPOLossSpec``) gives pairs whose
    rows ``[chosen; rejected]`` have the completion log-prob sums ``logps``, ``ref_logps`` and
    completion token counts ``counts`` (TRL's loss of a batch of these pairs; its ``sft`` term, the
    mean token loss over the chosen completions, is Σ -logps / Σ counts over the chosen rows, so each
    row's tokens are given its mean token loss)."""
    counts = counts.long().cpu()
    width = max(int(counts.max()), 1)
    has = torch.arange(width)[None, :] < counts[:, None]
    targets = torch.where(has, 0, -100)
    per_token = (-logps.double().cpu() / counts.clamp(min=1)).unsqueeze(1)
    token_losses = torch.where(has, per_token, 0.0)
    return float(spec.pair_losses(logps.double().cpu(), ref_logps.double().cpu(), token_losses, targets).mean())


def micro_batch_means(stats: list[torch.Tensor]) -> dict[str, float]:
    """TRL's logged value of each of :data:`METRICS` over micro-batches with :func:`pair_stats`
    ``stats`` (in reading order): the mean over the micro-batches with a pair of each one's pair
    mean; {} without one."""
    means = [s[1:] / s[0] for s in stats if s[0] > 0]
    if not means:
        return {}
    avg = torch.stack(means).mean(dim=0)
    return {name: float(v) for name, v in zip(METRICS, avg)}


__all__ = ["METRICS", "REF_KEY", "preference_rows", "step_stats", "pair_stats", "pairs_loss", "micro_batch_means"]
