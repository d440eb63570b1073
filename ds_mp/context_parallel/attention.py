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
    held     for backward: q, k, v (``T/C`` tokens) and SDPA's outputs — not the gathered ``K``,
             ``V`` nor the chunks' masks (``T``-wide, per layer): the backward all-gathers k and v
             again (the same collective on the same data: bitwise the forward's ``K``, ``V``, so
             the gradients are those of holding them) and rebuilds the masks (:class:`_Rebuilt`).
    Traffic per layer: ``2·(C−1)/C · T·h_kv·hd`` forward, twice that backward (the re-gather and
    the reduce-scatter), any head count; GQA gathers only the key/value heads.

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
``h_kv`` key/value heads for backward, not ``h`` copies; the layout's mask may be additive (for
``ulysses`` one float tensor built per micro-batch and held once for every layer, where SDPA would
convert a boolean one per call and hold each copy; ``allgather`` builds its chunks' masks per call
and holds none).

Dropout on the attention probabilities keeps its semantics (each probability dropped
independently with ``dropout_p``): CP peers share the caller's RNG stream (the same TP rank), so
each draws one seed per CP rank from it and uses its own (:func:`_cp_rng`); activation
checkpointing restores the stream, so a recomputation draws the same masks.

Every collective runs on the inputs' device (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_mp.context_parallel.shard import shard_order
from ds_mp.deepspeed_compat.torch_private import enclosing_saved_tensors_hooks


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


def _gather_row(x: torch.Tensor, group: Any, cp: int, order: torch.Tensor) -> torch.Tensor:
    """``(…, Tl, hd)`` on each rank -> ``(…, T, hd)`` in full-row order (dim -2): a view of a fresh
    ``(T, …, hd)`` storage, the same layout every call (what :class:`_Rebuilt` relies on)."""
    gathered = _all_gather(x.movedim(-2, 0), group, cp)  # (T, …, hd) in shard order
    full = torch.empty_like(gathered).index_copy_(0, order, gathered)  # full[order[p]] = gathered[p]
    return full.movedim(0, -2)


class _GatherSequence(torch.autograd.Function):
    """:func:`_gather_row`; backward: the reduce-scatter of the gradient back to each rank's tokens
    (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int, order: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.order = group, cp, order  # (T,) long: not an activation
        return _gather_row(x, group, cp, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        in_shard_order = grad.movedim(-2, 0).index_select(0, ctx.order)
        return _reduce_scatter(in_shard_order, ctx.group, ctx.cp).movedim(0, -2), None, None, None


class _Rebuilt:
    """Saved-tensor hooks around one :func:`allgather_attention`'s SDPA calls, so that it holds
    this rank's ``k`` and ``v`` for backward, not the gathered row's.

    A tensor autograd saves there whose storage was :meth:`register` ed (the gathered K/V, a head
    pick of them, a run's mask built by the caller's function) is kept as that storage's recipe and
    the tensor's (shape, stride, offset) and rebuilt at unpack, in backward: the gathered K/V by the
    forward's all-gather of the same ``k`` and ``v`` (bitwise the forward's tensors, so SDPA's backward
    is exactly the one it would have run on the held ones), once per backward of the call (cached
    until every rebuilt tensor of the call is unpacked).  Every other saved tensor goes to the
    enclosing hooks (the held-memory census, torch's non-reentrant checkpoint), or is kept.  ``k`` and
    ``v`` themselves are given to the enclosing hooks too (a checkpoint recomputes them)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group: Any, cp: int, order: torch.Tensor) -> None:
        self.outer = enclosing_saved_tensors_hooks()
        self.versions = (k._version, v._version)
        self.local = tuple(self._keep(t) for t in (k, v))
        self.group, self.cp, self.order = group, cp, order
        self.recipes: dict[int, Callable[[], torch.Tensor]] = {}  # storage address -> its rebuild
        self.gathered: torch.Tensor | None = None
        self.pending = 0  # rebuilt tensors packed and not yet unpacked

    def _keep(self, t: torch.Tensor) -> Any:
        return (None, self.outer[0](t)) if self.outer is not None else (None, t.detach())

    def _get(self, packed: tuple) -> torch.Tensor:
        return self.outer[1](packed[1]) if self.outer is not None else packed[1]

    def register(self, t: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> None:
        """Saved views of ``t``'s storage are rebuilt by ``recipe()``: a tensor laid out as ``t``."""
        self.recipes[t.untyped_storage().data_ptr()] = recipe

    def kv(self) -> torch.Tensor:
        """The gathered ``(2, B, h_kv, T, hd)``, all-gathered again from this rank's k and v."""
        if self.gathered is None:
            k, v = (self._get(p) for p in self.local)
            if self.outer is None and (k._version, v._version) != self.versions:
                raise RuntimeError("allgather_attention: k or v was modified in place after the forward; "
                                   "its backward re-gathers them")
            with torch.no_grad():
                self.gathered = _gather_row(torch.stack((k, v)), self.group, self.cp, self.order)
        return self.gathered

    def pack(self, t: torch.Tensor) -> Any:
        address = t.untyped_storage().data_ptr()
        recipe = self.recipes.get(address) if address else None
        if recipe is None:
            return self._keep(t)
        self.pending += 1
        return recipe, t.shape, t.stride(), t.storage_offset()

    def unpack(self, packed: tuple) -> torch.Tensor:
        if packed[0] is None:
            return self._get(packed)
        recipe, shape, stride, offset = packed
        out = recipe().as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending <= 0:  # the call's last one (or a second backward: one gather per tensor)
            self.gathered = None
        return out


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
                        masks: Sequence[torch.Tensor] | Callable[[int], torch.Tensor], *, group: Any, cp: int,
                        cp_rank: int, dropout_p: float = 0.0, scale: float | None = None, runs: int = 2
                        ) -> torch.Tensor:
    """CP attention by all-gathering keys and values (module docstring).

    ``q`` ``(B, h, Tl, hd)``, ``k``/``v`` ``(B, h_kv, Tl, hd)``: this rank's tokens of the zigzag
    split (``shard_index(T, cp, cp_rank, balanced=True)``), rotated; query head j reads key/value
    head ``kv_index[j]``, or ``j // (h / h_kv)`` when ``kv_index`` is None (:func:`grouped_kv`);
    ``masks``: for each of the ``runs`` equal runs of this rank's tokens (the zigzag's two chunks),
    its rows of the causal mask, boolean or additive, against the keys up to its last token — the
    list (``Layout.run_masks(2)``), or a function of the run's index building it
    (``Layout.run_mask``), called again in backward, so that no mask is held in between; each run
    attends over that prefix of the gathered row only.  For backward it holds ``q``, ``k`` and ``v``
    (``Tl`` tokens), SDPA's outputs, not the gathered ``T`` (:class:`_Rebuilt`).  Returns ``(B, h, Tl, hd)``."""
    order = shard_order(q.shape[2] * cp, cp, True, q.device)
    mask_of = masks if callable(masks) else masks.__getitem__
    kv = _GatherSequence.apply(torch.stack((k, v)), group, cp, order)  # (2, B, h_kv, T, hd)
    saving = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    rebuilt = _Rebuilt(k, v, group, cp, order) if saving else None
    hooks = (torch.autograd.graph.saved_tensors_hooks(rebuilt.pack, rebuilt.unpack) if rebuilt is not None
             else contextlib.nullcontext())
    outs = []
    with hooks:
        for i, run in enumerate(q.chunk(runs, dim=2)):
            mask = mask_of(i)
            e = mask.shape[-1]
            kr, vr = kv[0, :, :, :e], kv[1, :, :, :e]
            if kv_index is not None:  # picked per query head: h copies, rebuilt from the gathered h_kv too
                kr, vr = kr.index_select(1, kv_index), vr.index_select(1, kv_index)
            if rebuilt is not None:  # this run's only: an earlier run's mask and picks are freed (addresses reusable)
                rebuilt.recipes = {}
                rebuilt.register(kv, rebuilt.kv)
                rebuilt.register(mask, functools.partial(mask_of, i))
                if kv_index is not None:
                    for j, t in enumerate((kr, vr)):
                        rebuilt.register(t, functools.partial(_pick, rebuilt.kv, j, e, kv_index))
            outs.append(_sdpa(run, kr, vr, None, mask, cp, cp_rank, dropout_p, scale))
    if rebuilt is not None:
        rebuilt.recipes = {}
    return torch.cat(outs, dim=2)


def _pick(kv: Callable[[], torch.Tensor], j: int, e: int, kv_index: torch.Tensor) -> torch.Tensor:
    """The query heads' copies of the gathered keys (j = 0) or values (j = 1) up to ``e``."""
    return kv()[j, :, :, :e].index_select(1, kv_index)


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
