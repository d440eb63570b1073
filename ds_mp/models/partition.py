"""Splitting a family's pipeline layers into stages: DeepSpeed ``parts`` from a partition rule.

``uniform`` (blocks evenly), ``parameters`` (parameter counts), ``cost`` (measured per-layer
costs, :class:`LayerCosts`, balanced exactly by :func:`balanced_blocks`) or a list of blocks per
stage.  Family-free: a family's table contributes how many layers come before the first block
and after the last (``Family.lead_layers`` / ``tail_layers``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LayerCosts:
    """Measured seconds of one micro-batch's forward + backward through each kind of pipeline
    layer (``ds_mp.models.cost_profile`` measures them): ``embed`` = wte + wpe (stage 0),
    ``block`` = one transformer block, ``head`` = ln_f + tied LM head + loss (last stage)."""

    embed: float
    block: float
    head: float

    def blocks(self, n_layer: int, stages: int) -> list[int]:
        """Blocks per stage minimising the costliest stage (the pipeline runs at its pace); the
        first and last stage may hold no block when the embedding or head alone outweighs them."""
        return balanced_blocks(n_layer, stages, self.block, self.embed, self.head, min_end_blocks=0)

    def v_blocks(self, n_layer: int, stages: int) -> list[int]:
        """Blocks per chunk of ZB-V's 2·``stages`` chunks, balanced for the V placement
        (:func:`v_balanced_blocks`: rank 0 holds the embedding and the head)."""
        return v_balanced_blocks(n_layer, stages, self.block, self.embed, self.head)

    @property
    def head_blocks(self) -> float:
        """Embedding + head + loss in units of one block: what a stage holding both ends (Ouroboros'
        ring rank 0) carries besides its blocks (``split_modules(head_blocks=...)``)."""
        return (self.embed + self.head) / self.block


def stage_parts(n_layer: int, stages: int, partition: str | list, n_embd: int, vocab: int,
                costs: LayerCosts | None = None, *, lead: int = 2, tail: int = 2,
                block_params: int | None = None) -> list[int]:
    """DeepSpeed ``parts``: layer-index boundaries of each stage over the ``lead + L + tail`` layers
    of a family's table (``lead`` layers before the first block go to stage 0, the ``tail`` after
    the last to the last stage; GPT-2: 2 and 2).

    ``uniform`` gives blocks as evenly as possible (extra blocks to the middle stages,
    which carry no embedding/head).  ``parameters`` balances parameter counts, charging
    the embedding to the first stage and the (tied) head to the last (``block_params`` per block,
    default GPT-2's 12·n_embd²); each stage keeps at least one block.  ``cost`` balances the measured ``costs`` (:meth:`LayerCosts.blocks`).
    A list gives blocks per stage.
    """
    if isinstance(partition, list):
        blocks = list(partition)
    elif partition == "uniform":
        base, extra = divmod(n_layer, stages)
        order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), s))
        blocks = [base + (1 if s in order[:extra] else 0) for s in range(stages)]
    elif partition == "parameters":
        block_w, embed_w = block_params or 12 * n_embd * n_embd, vocab * n_embd
        blocks = balanced_blocks(n_layer, stages, block_w, embed_w, embed_w, min_end_blocks=1)
    elif partition == "cost":
        if costs is None:
            raise ValueError("partition 'cost' needs the measured layer costs (ds_mp.models.cost_profile."
                             "agreed_layer_costs; ds_mp.initialize measures them), or give a list of blocks")
        blocks = costs.blocks(n_layer, stages)
    else:
        raise ValueError(f"unknown partition {partition!r}")
    parts, at = [0], lead  # the layers before the first block (embedding, positions) go to stage 0
    for s, b in enumerate(blocks):
        at += b
        parts.append(at if s < stages - 1 else n_layer + lead + tail)
    return parts


def interleaved_layout(names: list[str], chunk_parts: list[int], stages: int) -> tuple[list[str], list[int]]:
    """Interleaved pipelines: ``names`` cut at ``chunk_parts`` into K·v chunks, rank r holding chunks
    r, r + K, r + 2K, … (K = ``stages``).  Returns ``(names, parts)`` reordered so each rank's chunks
    are consecutive, each chunk's layers in the model's order: rank r builds
    ``names[parts[r]:parts[r+1]]``."""
    chunks = len(chunk_parts) - 1
    if chunks % stages:
        raise ValueError(f"{chunks} chunks do not go evenly over {stages} stages")
    out, parts = [], [0]
    for r in range(stages):
        for c in range(r, chunks, stages):
            out += names[chunk_parts[c]:chunk_parts[c + 1]]
        parts.append(len(out))
    return out, parts


def v_layout(names: list[str], chunk_parts: list[int], stages: int) -> tuple[list[str], list[int]]:
    """ZB-V's V placement: ``names`` cut at ``chunk_parts`` into 2P chunks (P = ``stages``), rank r
    holding chunk r (down the V) then chunk 2P − 1 − r (back up), each chunk's layers in the
    model's order; rank 0 thus holds the first and the last layers.  Returns ``(names, parts)``:
    rank r builds ``names[parts[r]:parts[r+1]]``."""
    if len(chunk_parts) - 1 != 2 * stages:
        raise ValueError(f"the V placement needs 2·{stages} chunks, got {len(chunk_parts) - 1}")
    out, parts = [], [0]
    for r in range(stages):
        for c in (r, 2 * stages - 1 - r):
            out += names[chunk_parts[c]:chunk_parts[c + 1]]
        parts.append(len(out))
    return out, parts


def v_balanced_blocks(n_layer: int, stages: int, block: float, first: float, last: float) -> list[int]:
    """Blocks per chunk (the model's order) of ZB-V's 2P chunks (P = ``stages``) minimising the
    costliest rank, where rank r holds chunks r and 2P − 1 − r (:func:`v_layout`); every chunk
    holds ≥ 1 block.

    Rank r holding n_r blocks costs ``n_r·block + (first + last)·[r = 0]`` (the embedding goes with
    chunk 0, the head with chunk 2P − 1: both on rank 0).  Any n_r ≥ 2 splits into two chunks, so
    the rank problem stands alone and is solved exactly: ranks 1 … P − 1 cost alike, so for each
    n_0 the rest is spread as evenly as possible (the extra blocks to the ranks nearest the turn),
    which is the least max and the least sum of squares among them.  Rank 0's two chunks
    (embedding + blocks, blocks + head) take the split with the least max chunk cost (ties: fewer
    blocks down the V), the other ranks' halves the odd block on the way back up.  Over n_0: the
    least max rank cost, then the least sum of squared rank costs, then the least max chunk cost on
    rank 0, then fewer blocks on rank 0.  Equal inputs give equal outputs on every rank.
    """
    P = stages
    if P < 1 or n_layer < 2 * P:
        raise ValueError(f"cannot cut {n_layer} blocks into 2·{P} chunks with at least 1 block each")

    def chunks(n0: int) -> list[int]:
        base, extra = divmod(n_layer - n0, P - 1) if P > 1 else (0, 0)
        n = [n0] + [base + (r >= P - extra) for r in range(1, P)]
        down = [min(range(1, n0), key=lambda a: (max(a * block + first, (n0 - a) * block + last), a))]
        down += [c // 2 for c in n[1:]]
        return down + [c - d for c, d in zip(reversed(n), reversed(down))]

    def key(c: list[int]) -> tuple[float, float, float, int]:
        w = [(c[r] + c[2 * P - 1 - r]) * block + (first + last if r == 0 else 0.0) for r in range(P)]
        return max(w), sum(x * x for x in w), max(c[0] * block + first, c[-1] * block + last), c[0] + c[-1]

    return min((chunks(n0) for n0 in ([n_layer] if P == 1 else range(2, n_layer - 2 * (P - 1) + 1))), key=key)


def balanced_blocks(n_layer: int, stages: int, block: float, first: float, last: float,
                    min_end_blocks: int = 1) -> list[int]:
    """Contiguous blocks per stage minimising the costliest stage (linear partition, exact).

    Stage s holding c blocks costs ``c·block + first·[s = 0] + last·[s = K−1]``; middle stages
    hold ≥ 1 block, the first and last ≥ ``min_end_blocks``.  Two dynamic programs over
    (stage s, blocks n left for stages s…K−1), O(K·L²) each: the least max-cost M*, then, among
    the splits whose every stage costs ≤ M*, the one with the least sum of squared stage costs
    (the most even: idle stages absorb less jitter), ties to fewer blocks on earlier stages.
    Equal inputs give equal outputs on every rank.
    """
    K = stages
    low = [min_end_blocks if s in (0, K - 1) else 1 for s in range(K)]
    if K < 1 or n_layer < sum(low):
        raise ValueError(f"cannot split {n_layer} blocks over {K} stages with at least {low} blocks each")

    def cost(s: int, c: int) -> float:
        return c * block + (first if s == 0 else 0.0) + (last if s == K - 1 else 0.0)

    def table(combine: Callable[[float, float], float], allowed: Callable[[float], bool]) -> list[list[float]]:
        """``t[s][n]``: best ``combine``-fold of stage costs for stages s… holding n blocks."""
        t = [[inf] * (n_layer + 1) for _ in range(K + 1)]
        t[K][0] = 0.0
        for s in range(K - 1, -1, -1):
            for n in range(rest_low[s], n_layer + 1):
                top = n if s == K - 1 else n - rest_low[s + 1]
                t[s][n] = min((combine(cost(s, c), t[s + 1][n - c]) for c in range(low[s], top + 1)
                               if allowed(cost(s, c))), default=inf)
        return t

    inf = float("inf")
    rest_low = [sum(low[s:]) for s in range(K)] + [0]
    bound = table(max, lambda _: True)[0][n_layer]
    def square_sum(x: float, rest: float) -> float:
        return x * x + rest

    even = table(square_sum, lambda x: x <= bound)
    blocks, left = [], n_layer
    for s in range(K - 1):  # smallest count that keeps the optimum
        c = next(c for c in range(low[s], left - rest_low[s + 1] + 1)
                 if cost(s, c) <= bound and square_sum(cost(s, c), even[s + 1][left - c]) == even[s][left])
        blocks.append(c)
        left -= c
    return blocks + [left]


__all__ = ["LayerCosts", "stage_parts", "interleaved_layout", "v_layout", "v_balanced_blocks", "balanced_blocks"]
