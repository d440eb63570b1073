"""Context parallelism in the engine: each CP rank's share of a micro-batch.

Under context parallelism (``topology.cp`` = C > 1) the C ranks of a CP group read the same rows
(they share ``dp_rank``) and each runs ``T/C`` tokens of every row through every layer and stage:
the full-row indices :func:`ds_mp.context_parallel.shard.shard_index` gives (contiguous for
``ulysses``, the 2·C-chunk zigzag for ``allgather``; ``Ctx.cp_balanced``).  Everything that
depends on the whole row is computed on it before the cut, on every CP rank alike:

* the **targets**: HF's shift (``labels[t+1]``) and the cut at document starts
  (``MicroBatch.targets``) happen on the full row, then the targets are sliced — a target whose
  token sits in another shard is that shard's;
* the **count** N: each target counted once on its full row, all-reduced over the ranks that read
  distinct rows (``topology.dp_group``, not dp × cp): ``ds_mp.engine.batches.prepare_step``;
* the **layout**: positions and documents stay full-row (RoPE, GPT-2's position table, sliding
  windows and document masks are the full row's); a plain causal row gets one too, so the attention
  has one code path; ``Layout.q_index`` says which tokens this rank holds.

The gradient group is dp × cp, so the loss spec's D = N / (M · dp · cp) (``LossSpec.denominators``
with ``topology.grad_size``) and each CP rank's micro-batch loss is its shard's S / D: summed by the
gradient average over dp × cp (and the reported loss, ``deepspeed_compat.grid.grad_group_loss``)
they give Σ S / N, the one-process loss.  ``"micro_batch"`` normalisation's D is a micro-batch's own
full-row count, so it is divided by C here (the C shards' parts add up to the micro-batch's mean).
"""
from __future__ import annotations

import torch

from ds_mp.context_parallel.rules import check_seq_len
from ds_mp.context_parallel.shard import shard_index
from ds_mp.models.batch import Layout, MicroBatch
from ds_mp.models.ctx import Ctx


def check_rows(seq_len: int, ctx: Ctx) -> None:
    """Raise ``ValueError`` (``batch: …``, one line) unless this step's rows of ``seq_len`` tokens cut
    as the CP impl needs (a batch may be shorter than ``data.seq_len``, which load_config checked)."""
    try:
        check_seq_len(seq_len, ctx.cp, ctx.cp_balanced, ctx.tp if ctx.sp else 1)
    except ValueError as err:
        raise ValueError(f"batch: rows of {seq_len} tokens: {err}") from None


def full_layout(mb: MicroBatch, layout: Layout | None) -> Layout:
    """``layout``, or for a plain causal micro-batch (None) its layout spelled out: positions
    0 … T-1, one document per row."""
    if layout is not None:
        return layout
    B, T = mb.input_ids.shape
    positions = torch.arange(T, device=mb.input_ids.device).expand(B, T)
    return Layout(positions, torch.ones_like(positions), None)


def sharded(layout: Layout, ctx: Ctx, device: torch.device) -> Layout:
    """``layout`` (full-row, on ``device``) with this CP rank's token indices ``q_index``."""
    T = layout.positions.shape[1]
    q_index = shard_index(T, ctx.cp, ctx.cp_rank, ctx.cp_balanced, device=device)
    return Layout(layout.positions.to(device), layout.docs.to(device), layout.window, q_index)


def shard_micro_batch(mb: MicroBatch, layout: Layout, targets: torch.Tensor
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """This CP rank's ``((input_ids, positions), targets, extras)`` of a micro-batch: the full-row
    ``targets`` (shifted and cut at document starts already) and the ``(B, T)`` extras at the
    columns ``layout.q_index``; per-row extras whole."""
    q = layout.q_index.to(mb.input_ids.device)
    T = mb.input_ids.shape[1]
    extras = {k: (x[:, q] if x.dim() >= 2 and x.shape[1] == T else x) for k, x in mb.extras.items()}
    return (mb.input_ids[:, q], layout.positions.to(q.device)[:, q]), targets[:, q], extras


def shard_denominators(denominators: list[float], normalization: str, ctx: Ctx) -> list[float]:
    """The loss spec's denominators for this CP rank (module docstring): ``"tokens"``' already count
    the C shards in the gradient group; ``"micro_batch"``'s are divided by C."""
    return [d / ctx.cp for d in denominators] if normalization == "micro_batch" else denominators


__all__ = ["check_rows", "full_layout", "sharded", "shard_micro_batch", "shard_denominators"]
