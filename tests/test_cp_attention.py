"""Context-parallel attention ops (ds_mp.context_parallel) at CP = 2 against one-process SDPA over the
full row with the same document/padding/window mask: outputs and the gradients of q, k and v, fp32,
1e-5.  The layouts are users': a document crossing the shard border, a position restart inside a
shard other than the first, left padding, a row whose real tokens all sit in one shard, a sliding
window shorter than a shard; GQA with split and with replicated key/value heads; a leak probe."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from ds_mp.context_parallel.rules import balanced_for, check_heads, check_seq_len
from ds_mp.context_parallel.shard import shard_index, shard_order
from ds_mp.models.batch import Layout, MicroBatch

T, HD = 16, 8


def _layout(window: int | None) -> Layout:
    """Three rows: packed documents [0..5][0..7][0..1] (doc 2 crosses both zigzag borders, a restart at
    14, in rank 0's second chunk); 5 left-padding tokens then one document; a row whose 4 real tokens
    are all in the last chunk (right-padded after a long padding run: the skew case)."""
    pos = torch.stack((torch.cat((torch.arange(6), torch.arange(8), torch.arange(2))),
                       torch.cat((torch.zeros(5, dtype=torch.long), torch.arange(11))),
                       torch.cat((torch.zeros(12, dtype=torch.long), torch.arange(4)))))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :12] = 0
    lay = MicroBatch(torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long), pos, mask).layout(window)
    assert lay is not None
    return lay


def _reference(q, k, v, lay: Layout, kv_index, g):
    """One-process SDPA over the full row (HF's repeat_kv), and the grads of sum(y · g)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k.index_select(1, kv_index), v.index_select(1, kv_index),
                                       attn_mask=lay.mask(T, T))
    (y * g).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad


def _ops_ranks(rank: int) -> None:
    import torch.distributed as dist

    from ds_mp.context_parallel.attention import allgather_attention, grouped_kv, ulysses_attention

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    # (query heads, key/value heads, window, kv_index): None = grouped as HF's repeat_kv (SDPA groups
    # them; ulysses splits them, repeated to lcm(h_kv, C) when C does not divide them); [1, 1, 2, 2] of 3 = a TP rank
    # reading a slice of replicated key/value heads (picked per query head)
    cases = ((4, 4, None, None), (4, 2, None, None), (4, 1, None, None), (4, 2, 3, None), (4, 3, None, [1, 1, 2, 2]))
    for impl in ("allgather", "ulysses"):
        for h, n_kv, window, heads in cases:
            gen = torch.Generator().manual_seed(h * 10 + n_kv + (window or 0))
            q, g = (torch.randn(3, h, T, HD, generator=gen) for _ in range(2))
            k, v = (torch.randn(3, n_kv, T, HD, generator=gen) for _ in range(2))
            kv_index = torch.arange(h) // (h // n_kv) if heads is None else torch.tensor(heads)
            assert grouped_kv(kv_index, n_kv) == (heads is None)
            lay = _layout(window)
            ref = _reference(q, k, v, lay, kv_index, g)
            idx = shard_index(T, 2, rank, balanced_for(impl))
            mine = dataclasses.replace(lay, q_index=idx, masks={})
            dtype = None if n_kv == 2 else torch.float32  # the boolean and the additive mask
            mask = mine.run_masks(2, dtype=dtype) if impl == "allgather" else mine.mask(T, T, dtype=dtype)
            op = allgather_attention if impl == "allgather" else ulysses_attention
            run = lambda ql, kl, vl: op(ql, kl, vl, None if heads is None else kv_index, mask, group=group, cp=2,
                                        cp_rank=rank)
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
            y = run(ql, kl, vl)
            (y * g[:, :, idx]).sum().backward()
            what = f"{impl} h={h} kv={n_kv} window={window} kv_index={heads}"
            for name, got, want in (("y", y, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                    ("dv", vl.grad, ref[3])):
                torch.testing.assert_close(got, want[:, :, idx], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")
            # leak probe: change the key/value of one token of document 1 (row 0, index 3): outputs
            # change only at document 1's queries, on both ranks
            k2, v2 = k.clone(), v.clone()
            k2[0, :, 3] += 1.0
            v2[0, :, 3] -= 1.0
            with torch.no_grad():
                y2 = run(ql, k2[:, :, idx], v2[:, :, idx])
            changed = (y2 - y.detach()).abs().amax(dim=(1, 3)) > 0  # (B, T/2)
            doc1 = torch.zeros(3, T, dtype=torch.bool)
            doc1[0, 3:6] = True  # document 1's queries at or after the changed key
            assert torch.equal(changed, doc1[:, idx]), (what, changed)
    _plain_rows(rank, group)
    _dropout_checks(rank, group)
    _regather_checks(rank, group)
    dist.destroy_process_group()


def _plain_rows(rank: int, group) -> None:
    """Rows of one document without padding: ulysses asks SDPA for is_causal (no T × T mask held),
    allgather its chunk masks; both equal full-row causal SDPA."""
    from ds_mp.context_parallel.attention import allgather_attention, ulysses_attention

    pos = torch.arange(T).expand(2, T)
    assert not _layout(None).causal_only() and not Layout(pos, torch.ones_like(pos), 3).causal_only()
    assert Layout(pos, torch.ones_like(pos), 3).causal_only(windowed=False)
    gen = torch.Generator().manual_seed(9)
    q, g = (torch.randn(2, 4, T, HD, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, T, HD, generator=gen) for _ in range(2))
    kv_index = torch.arange(4) // 2
    full = Layout(pos, torch.ones_like(pos))
    ref = _reference(q, k, v, full, kv_index, g)
    for impl, op in (("allgather", allgather_attention), ("ulysses", ulysses_attention)):
        idx = shard_index(T, 2, rank, balanced_for(impl))
        lay = Layout(pos, torch.ones_like(pos), None, idx)
        assert lay.causal_only()
        mask = lay.run_masks(2, dtype=torch.float32) if impl == "allgather" else None
        ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        y = op(ql, kl, vl, None, mask, group=group, cp=2, cp_rank=rank)
        (y * g[:, :, idx]).sum().backward()
        for name, got, want in (("y", y, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                ("dv", vl.grad, ref[3])):
            torch.testing.assert_close(got, want[:, :, idx], rtol=1e-5, atol=1e-5, msg=f"plain {impl} {name}")


def _dropout_checks(rank: int, group) -> None:
    """Attention dropout under CP: every head holds the same q/k/v, so a head's output depends only on
    its dropout mask.  CP peers share the RNG stream; each must still draw its own masks (ulysses:
    rank 0's head chunk and rank 1's differ), the same again from the same stream state
    (recomputation); the draw both impls make under ``_cp_rng`` differs by CP rank while the shared
    stream advances alike."""
    from ds_mp.context_parallel.attention import _cp_rng, ulysses_attention

    one = torch.randn(3, 1, T, HD, generator=torch.Generator().manual_seed(5))
    q = k = v = one.expand(3, 4, T, HD)[:, :, shard_index(T, 2, rank, False)]
    lay = dataclasses.replace(_layout(None), q_index=shard_index(T, 2, rank, False))
    outs = []
    for _ in range(2):
        torch.manual_seed(11)  # the same stream state on both ranks, and again for the second run
        outs.append(ulysses_attention(q, k, v, None, lay.mask(T, T), group=group, cp=2, cp_rank=rank,
                                      dropout_p=0.5))
    assert torch.equal(outs[0], outs[1])  # reproducible from the stream state
    assert not torch.equal(outs[0][:, :2], outs[0][:, 2:])  # heads 0-1 (rank 0's) vs 2-3 (rank 1's): own masks
    torch.manual_seed(11)
    with _cp_rng(2, rank, torch.device("cpu"), True):
        inside = torch.rand(8)
    after = torch.rand(8)  # the shared stream advanced alike on both ranks
    both = torch.empty(2, 2, 8)
    torch.distributed.all_gather_single(both, torch.stack((inside, after))[None].contiguous(), group=group)
    assert not torch.equal(both[0, 0], both[1, 0]) and torch.equal(both[0, 1], both[1, 1])


def _regather_checks(rank: int, group) -> None:
    """allgather holds this rank's k and v for backward and re-gathers them in backward: no tensor
    it saves spans more than this rank's T/2 tokens (the gathered keys of the late chunk span up to
    T, its mask T columns; a mask built by a function is rebuilt, not held), and the enclosing hooks
    (a census) see the ones it keeps; the gradients equal one-process SDPA's — under those hooks, under
    torch's non-reentrant checkpoint (whose hooks then enclose the op's), and in a second backward of
    a retained graph; an in-place change of k after the forward is refused."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from ds_mp.context_parallel.attention import allgather_attention

    idx = shard_index(T, 2, rank, True)
    lay = _layout(None)
    for n_kv, heads in ((2, None), (3, [1, 1, 2, 2])):
        gen = torch.Generator().manual_seed(21 + n_kv)
        q, g = (torch.randn(3, 4, T, HD, generator=gen) for _ in range(2))
        k, v = (torch.randn(3, n_kv, T, HD, generator=gen) for _ in range(2))
        kv_index = torch.arange(4) // 2 if heads is None else torch.tensor(heads)
        _, *want = _reference(q, k, v, lay, kv_index, g)
        want = [w[:, :, idx] for w in want]
        mine = dataclasses.replace(lay, q_index=idx, masks={})
        op = functools.partial(allgather_attention, kv_index=None if heads is None else kv_index,
                               masks=functools.partial(mine.run_mask, 2, dtype=torch.float32), group=group, cp=2,
                               cp_rank=rank)
        leaves = lambda: [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]  # noqa: E731
        what = f"allgather re-gather kv={n_kv} kv_index={heads}"

        saved: list[torch.Tensor] = []
        ins = leaves()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.detach()) or saved[-1], lambda t: t):
            y = op(*ins)
        wide = [tuple(t.shape) for t in saved if max(t.shape[-2:]) > T // 2]
        assert not wide, f"{what}: saved for backward beyond this rank's tokens: {wide}"
        assert ins[0].untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in saved}, what
        got = torch.autograd.grad((y * g[:, :, idx]).sum(), ins, retain_graph=True)
        again = torch.autograd.grad((y * g[:, :, idx]).sum(), ins)  # the retained graph: gathered once more
        ins = leaves()
        y = checkpoint(op, *ins, use_reentrant=False)
        under = torch.autograd.grad((y * g[:, :, idx]).sum(), ins)
        for how, grads in (("census hooks", got), ("second backward", again), ("non-reentrant checkpoint", under)):
            for name, a, b in zip(("dq", "dk", "dv"), grads, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{what} {how} {name}")
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    k_in = kl * 1.0
    y = allgather_attention(ql, k_in, vl, kv_index, mine.run_masks(2), group=group, cp=2, cp_rank=rank)
    k_in.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_cp_attention_ops_match_full_row_sdpa() -> None:
    run_ranks(_ops_ranks, 2, timeout=240)


def test_shards_cover_the_row_once() -> None:
    for cp in (1, 2, 3):
        for balanced in (False, True):
            order = shard_order(12, cp, balanced)
            assert sorted(order.tolist()) == list(range(12))
            for r in range(cp):
                idx = shard_index(12, cp, r, balanced)
                assert torch.equal(idx, idx.sort().values) and len(idx) == 12 // cp
    assert shard_index(8, 2, 0, True).tolist() == [0, 1, 6, 7]  # zigzag: chunks 0 and 3


def test_rules_refuse_in_one_line() -> None:
    with pytest.raises(ValueError, match="seq_len 10 does not split into 2·cp = 4 chunks"):
        check_seq_len(10, 2, True)
    with pytest.raises(ValueError, match="sequence-parallel"):
        check_seq_len(12, 2, False, tp=4)
    check_seq_len(12, 2, False, tp=2)
    with pytest.raises(ValueError, match="6 attention heads are not divisible by tp·cp = 4"):
        check_heads(6, 2, 2, 2, "ulysses")
    check_heads(6, 2, 2, 2, "allgather")
    with pytest.raises(ValueError, match="unknown impl 'ring'"):
        balanced_for("ring")


def test_ctx_refuses_an_unknown_impl_and_attention_without_q_index() -> None:
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology
    from helpers import tiny_gpt2

    cfg, topology = tiny_gpt2(n_layer=1).config, Topology(tp=1, pp=1, dp=1, cp=2, rank=1)
    with pytest.raises(ValueError, match="unknown impl 'ring'"):
        Ctx(topology, cfg, False, 1, cp_impl="ring")
    ctx = Ctx(topology, cfg, False, 1)
    assert (ctx.cp, ctx.cp_rank, ctx.cp_impl, ctx.cp_balanced) == (2, 1, "allgather", True)
    q = torch.zeros(1, 4, 8, 12)
    ctx.layout = _layout(None)  # no q_index: the engine did not set this rank's tokens
    with pytest.raises(RuntimeError, match="q_index of this rank's 8 tokens"):
        ctx.cp_attention(q, q, q, None)

