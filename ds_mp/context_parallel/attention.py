"""Attention over a sequence split across a context-parallel (CP) group.

Every CP rank holds ``Tl = T/C`` tokens of each row (``shard.shard_index``): its queries, keys and
values ``(B, heads, Tl, hd)``, already rotated at their own full-row positions.  Two exchanges give
each query the keys of the whole row; both are exact (the same SDPA over the same keys and mask):

``allgather`` (:func:`allgather_attention`, the zigzag split):
    forward  ``K = P · gather(k)``, ``V = P · gather(v)`` over the group (one all-gather of k and v
             stacked; ``P`` undoes the zigzag into full-row order), then for each of this rank's
             two chunks ``y = SDPA(q_chunk, K[:e], V[:e], its mask rows)`` with ``e`` the chunk's
             end: causality masks every later key, so it is not scored — rank r scores
             ``(2C + 1)·(T/2C)²`` pairs, the same on every rank, about half of ``(T/C)·T``;
    backward autograd gives each rank ``dK, dV`` ``(B, h_kv, T, hd)``: the contributions of ITS
             queries to every key.  The key at full-row index j lives on one rank, and its gradient
             is the sum of every rank's queries' contributions, so ``dk = scatter(Pᵀ · Σ_ranks dK)``:
             one reduce-scatter of dK and dV stacked (the all-gather's adjoint).  dq stays local.
    Traffic per layer: ``2·(C−1)/C · T·h_kv·hd`` forward (and the same backward), any head count;
    GQA gathers only the key/value heads.

``ulysses`` (:func:`ulysses_attention`, the contiguous split):
    forward  an all-to-all turns ``(B, h, Tl, hd)`` (a sequence split) into ``(B, h/C, T, hd)`` (a
             head split, the whole row in order) for q, k and v; SDPA with the full ``(T, T)`` mask
             (``is_causal`` on a plain causal row);
             the inverse all-to-all brings ``y`` back to ``(B, h, Tl, hd)``;
    backward an all-to-all is a permutation of the group's data, so its adjoint is its inverse:
             the backward of sequence→head is head→sequence and vice versa; SDPA's backward is
             local (each rank owns whole rows for its heads).
    Needs ``h`` divisible by C on each TP rank (``rules.check_heads``).  Grouped key/value heads
    (:func:`grouped_kv`) split the same way, chunk c of the query heads reading chunk c of them —
    repeated first to ``lcm(h_kv, C)`` heads when fewer than C or not divisible by it; heads TP
    replicated in slices are expanded to the query heads (HF's ``repeat_kv``), at ``h/h_kv`` times
    the key/value traffic.

Grouped heads (GQA) are grouped by SDPA itself (``enable_gqa``), so the attention holds the
``h_kv`` key/value heads for backward, not ``h`` copies; the layout's mask may be additive (one
float tensor built per micro-batch and held once for every layer, where SDPA would convert a
boolean one per call and hold each copy).

Dropout on the attention probabilities keeps its semantics (each probability dropped
independently with ``dropout_p``): CP peers share the caller's RNG stream (the same TP rank), so
each draws one seed per CP rank from it and uses its own (:func:`_cp_rng`); activation
checkpointing restores the stream, so a recomputation draws the same masks.

Every collective runs on the inputs' device (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_mp.context_parallel.shard import shard_order


def _all_gather(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """``(C·n, …)``: every rank's ``x`` ``(n, …)`` laid end to end along dim 0 in rank order."""
    out = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """This rank's block ``(n, …)`` of ``Σ_ranks x`` (``x`` ``(C·n, …)``), the all-gather's adjoint."""
    out = torch.empty((x.shape[0] // cp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """``(…, Tl, hd)`` on each rank -> ``(…, T, hd)`` in full-row order (dim -2); backward: the
    reduce-scatter of the gradient back to each rank's tokens (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int, order: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        ctx.save_for_backward(order)
        gathered = _all_gather(x.movedim(-2, 0), group, cp)  # (T, …, hd) in shard order
        full = torch.empty_like(gathered).index_copy_(0, order, gathered)  # full[order[p]] = gathered[p]
        return full.movedim(0, -2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (order,) = ctx.saved_tensors
        in_shard_order = grad.movedim(-2, 0).index_select(0, order)
        return _reduce_scatter(in_shard_order, ctx.group, ctx.cp).movedim(0, -2), None, None, None


def _seq_to_head(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """``(B, h, Tl, hd)`` (this rank's contiguous tokens, every head) -> ``(B, h/C, C·Tl, hd)``
    (every token, head chunk ``cp_rank``): an all-to-all."""
    B, h, Tl, hd = x.shape
    send = x.reshape(B, cp, h // cp, Tl, hd).transpose(0, 1).contiguous()  # (C, B, h/C, Tl, hd): chunk c to rank c
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * Tl, hd)


def _head_to_seq(y: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The inverse of :func:`_seq_to_head`: ``(B, h/C, T, hd)`` -> ``(B, h, T/C, hd)``."""
    B, hc, T, hd = y.shape
    send = y.reshape(B, hc, cp, T // cp, hd).permute(2, 0, 1, 3, 4).contiguous()  # (C, B, h/C, Tl, hd)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my tokens of rank r's heads
    return recv.transpose(0, 1).reshape(B, cp * hc, T // cp, hd)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _seq_to_head(x, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _head_to_seq(grad, ctx.group, ctx.cp), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _head_to_seq(y, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_to_head(grad, ctx.group, ctx.cp), None, None


@contextlib.contextmanager
def _cp_rng(cp: int, cp_rank: int, device: torch.device, active: bool) -> Iterator[None]:
    """Inside the block, the RNG of ``device`` (SDPA's dropout draws from it) gives this CP rank's own
    numbers (``active``): one seed per CP rank is drawn from the caller's stream on that device (the
    model-parallel stream: equal on CP peers, so it advances equally, and restored by activation
    checkpointing) and this rank's seeds that device's generator, forked around the block."""
    if not active:
        yield
        return
    seeds = torch.randint(0, 2**62, (cp,), dtype=torch.long, device=device).tolist()
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        gen = torch.cuda.default_generators[index] if cuda else torch.random.default_generator
        gen.manual_seed(seeds[cp_rank])  # this device's generator only
        yield


def grouped_kv(kv_index: torch.Tensor, n_kv: int) -> bool:
    """Whether query head j reads key/value head ``j // (h / n_kv)`` (HF's ``repeat_kv`` order over
    this rank's ``h`` query and ``n_kv`` key/value heads), so SDPA can group them itself
    (``enable_gqa``: it holds the ``n_kv`` heads for backward, not ``h`` copies).  False where TP
    replicated the key/value heads and this rank's query heads read a slice of them."""
    h = kv_index.numel()
    return h % n_kv == 0 and torch.equal(kv_index.cpu(), torch.arange(h) // (h // n_kv))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor | None,
          mask: torch.Tensor | None, cp: int, cp_rank: int, dropout_p: float, scale: float | None) -> torch.Tensor:
    """SDPA with key/value heads grouped by SDPA (``kv_index`` None) or picked per query head, the
    mask or (None) plain causality over square q/k, and this CP rank's own dropout masks."""
    if kv_index is not None:
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    with _cp_rng(cp, cp_rank, q.device, dropout_p > 0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor | None,
                        masks: Sequence[torch.Tensor], *, group: Any, cp: int, cp_rank: int, dropout_p: float = 0.0,
                        scale: float | None = None) -> torch.Tensor:
    """CP attention by all-gathering keys and values (module docstring).

    ``q`` ``(B, h, Tl, hd)``, ``k``/``v`` ``(B, h_kv, Tl, hd)``: this rank's tokens of the zigzag
    split (``shard_index(T, cp, cp_rank, balanced=True)``), rotated; query head j reads key/value
    head ``kv_index[j]``, or ``j // (h / h_kv)`` when ``kv_index`` is None (:func:`grouped_kv`);
    ``masks``: for each equal run of this rank's tokens (the zigzag's two chunks), its rows of the
    causal mask, boolean or additive, against the keys up to its last token
    (``Layout.run_masks(2)``): each run attends over that prefix of the gathered row only.
    Returns ``(B, h, Tl, hd)``."""
    order = shard_order(q.shape[2] * cp, cp, True, q.device)
    kv = _GatherSequence.apply(torch.stack((k, v)), group, cp, order)  # (2, B, h_kv, T, hd)
    runs = q.chunk(len(masks), dim=2)
    return torch.cat([_sdpa(run, kv[0, :, :, :m.shape[-1]], kv[1, :, :, :m.shape[-1]], kv_index, m, cp, cp_rank,
                            dropout_p, scale) for run, m in zip(runs, masks)], dim=2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor | None,
                      mask: torch.Tensor | None, *, group: Any, cp: int, cp_rank: int, dropout_p: float = 0.0,
                      scale: float | None = None) -> torch.Tensor:
    """CP attention by all-to-all between a sequence split and a head split (module docstring).

    ``q`` ``(B, h, Tl, hd)``, ``k``/``v`` ``(B, h_kv, Tl, hd)``: this rank's contiguous chunk
    (``shard_index(T, cp, cp_rank, balanced=False)``), rotated; ``kv_index`` as in
    :func:`allgather_attention`; ``mask`` ``(B, 1, T, T)``, the full row's (``Layout.mask(T, T)``), or
    None for plain causality (``Layout.causal_only``: SDPA's ``is_causal``, no mask held).
    With grouped heads (``kv_index`` None) the all-to-all splits the key/value heads as it splits the
    query heads (chunk c of each reads chunk c), each first repeated ``lcm(h_kv, C)/h_kv`` times when
    C does not divide them (h divides ``lcm(h_kv, C)``, so the grouping holds); picked heads are
    replicated to every query head first.  Returns ``(B, h, Tl, hd)``."""
    if q.shape[1] % cp:
        raise ValueError(f"ulysses: {q.shape[1]} query heads on this rank are not divisible by cp = {cp}")
    if kv_index is not None:  # picked per query head: every query head brings its own key/value head
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    elif k.shape[1] % cp:  # grouped, C does not divide them: each repeated to lcm(h_kv, C) heads, still grouped
        r = math.lcm(k.shape[1], cp) // k.shape[1]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    qh = _SeqToHead.apply(q, group, cp)  # (B, h/C, T, hd)
    B, n_kv, Tl, hd = k.shape
    kv = torch.cat((k.reshape(B, cp, n_kv // cp, Tl, hd), v.reshape(B, cp, n_kv // cp, Tl, hd)), 2)  # chunk c: k's c, v's c
    kvh = _SeqToHead.apply(kv.view(B, 2 * n_kv, Tl, hd), group, cp)  # (B, 2·h_kv/C, T, hd)
    n = n_kv // cp
    y = _sdpa(qh, kvh[:, :n], kvh[:, n:], None, mask, cp, cp_rank, dropout_p, scale)
    return _HeadToSeq.apply(y, group, cp)


__all__ = ["allgather_attention", "grouped_kv", "ulysses_attention"]
