"""Tensor parallelism equals the unmodified HF GPT-2: sharding, layer algebra, and
multi-rank logits, loss, every gradient, trajectories (SP on/off, clipping) and dropout RNG.

Awkward sizes: vocab 1003 (padded to 1024), 3 heads per rank, head dim 8 (TP=2) and 4 (TP=4).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from ds_mp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   padded_vocab_size, shard, unshard, vocab_parallel_cross_entropy)
from helpers import batches, ds_config, tiny_gpt2, train_one_process

VOCAB, EMBD, SEQ, TOL = 1003, 48, 16, 1e-5


def tp_model(tp: int, dropout: float = 0.0, n_layer: int = 2):
    """Tiny GPT-2 with 3 heads per TP rank."""
    return tiny_gpt2(seed=0, n_layer=n_layer, n_embd=EMBD, n_head=3 * tp, vocab=VOCAB, n_positions=32,
                     dropout=dropout)


def data(steps: int, micro_batches: int, seed: int, micro: int = 2, seq: int = SEQ) -> list[list]:
    """``steps`` lists of ``micro_batches`` (ids, labels) pairs; some labels ignored (-100)."""
    out = []
    for i in range(steps):
        mbs = batches(micro_batches, micro, seq, VOCAB, seed=seed + i)
        for _, labels in mbs:
            labels[0, :3] = -100
        out.append(mbs)
    return out


def hf_train(model, steps: list[list], lr: float, clip: float = 0.0) -> tuple[list[float], list[float], dict]:
    """Single-process SGD: per step the mean loss over its micro-batches, the pre-clip
    gradient norm (``clip_grad_norm_``, 0 when off) and the final weights by HF name."""
    model = copy.deepcopy(model).train()
    losses, norms = train_one_process(model, steps, torch.optim.SGD(model.parameters(), lr=lr), clip)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def gather_weights(engine) -> tuple[dict, dict]:
    """This stage's weights unsharded to HF names, and each vocab shard's padding rows."""
    import torch.distributed as dist

    from ds_mp.models.pipeline import hf_param_name

    pipe, topo = engine.module, engine.topology
    ctx, full, pad = pipe.ds_mp_ctx, {}, {}
    for name, p in pipe.named_parameters():
        shards = [p.detach().clone()]
        if topo.tp > 1 and p.tp_kind != "replicated":
            shards = [torch.empty_like(p) for _ in range(topo.tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=topo.tp_group)
        hf = hf_param_name(name, pipe)
        full[hf] = unshard(shards, p.tp_kind, n_head=ctx.n_head, vocab=ctx.vocab).clone()
        if p.tp_kind == "vocab":
            pad[hf] = torch.cat(shards)[ctx.vocab:].clone()
    return full, pad


def max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the names of ``a`` (all of which ``b`` must have, same shapes)."""
    return max(float((a[n] - b[n]).abs().max()) if a[n].shape == b[n].shape else float("inf") for n in a)


def engine_run(model, steps: list[list], cfg: dict) -> tuple[list[float], list, dict, dict]:
    import ds_mp

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    losses, norms = [], []
    for micro_batches in steps:
        losses.append(float(engine.train_batch(iter(micro_batches))))
        norms.append(engine.last_grad_norm)
    weights, pad = gather_weights(engine)
    return losses, norms, weights, pad


# --- single process --------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(size: int) -> None:
    g = torch.Generator().manual_seed(0)
    n_head = 12
    tensors = {"column": torch.randn(EMBD, 4 * EMBD, generator=g), "row": torch.randn(4 * EMBD, EMBD, generator=g),
               "qkv": torch.randn(EMBD, 3 * EMBD, generator=g), "replicated": torch.randn(EMBD, generator=g)}
    for kind, full in tensors.items():
        parts = [shard(full, kind, r, size, n_head=n_head) for r in range(size)]
        assert torch.equal(unshard(parts, kind, n_head=n_head), full), kind
    bias = torch.randn(3 * EMBD, generator=g)
    parts = [shard(bias, "qkv", r, size, n_head=n_head) for r in range(size)]
    assert torch.equal(unshard(parts, "qkv", n_head=n_head), bias)
    hs, per = EMBD // n_head, n_head // size
    for r, part in enumerate(parts):  # rank r holds q, k, v of heads r·per … (r+1)·per − 1
        want = bias.view(3, n_head, hs)[:, r * per:(r + 1) * per].reshape(-1)
        assert torch.equal(part, want)
    emb = torch.randn(VOCAB, EMBD, generator=g)
    padded = padded_vocab_size(VOCAB, size)
    assert padded % (128 * size) == 0 and VOCAB <= padded < VOCAB + 128 * size
    parts = [shard(emb, "vocab", r, size, padded_vocab=padded) for r in range(size)]
    assert all(p.shape == (padded // size, EMBD) for p in parts)
    assert torch.equal(unshard(parts, "vocab", vocab=VOCAB), emb)
    assert torch.count_nonzero(torch.cat(parts)[VOCAB:]) == 0


def test_shard_errors() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        shard(torch.zeros(4, 30), "qkv", 0, 4, n_head=10)
    with pytest.raises(ValueError, match="unknown shard kind"):
        shard(torch.zeros(4), "diagonal", 0, 2)


def test_layer_algebra_single_process() -> None:
    """With no group, rank r's layer computes its term: Y = [X A_1 … X A_p] (column, per
    head for qkv), Y = Σ_r X_r B_r + b (row), E = Σ_r E_r (vocab), logits = h E_pᵀ."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    p, n_head = 3, 6
    x = torch.randn(2, 5, EMBD)
    attn, proj = Conv1D(3 * EMBD, EMBD), Conv1D(EMBD, 4 * EMBD)
    cols = [ColumnParallelLinear(attn.weight, attn.bias, None, r, p, kind="qkv", n_head=n_head)(x) for r in range(p)]
    assert torch.allclose(unshard(cols, "qkv", n_head=n_head), attn(x), atol=1e-6)
    h = torch.randn(2, 5, 4 * EMBD)
    rows = [RowParallelLinear(proj.weight, proj.bias, None, r, p)(h.chunk(p, -1)[r]) for r in range(p)]
    assert torch.allclose(sum(y - proj.bias for y in rows) + proj.bias, proj(h), atol=1e-5)
    emb, padded = torch.randn(VOCAB, EMBD), padded_vocab_size(VOCAB, p)
    layers = [VocabParallelEmbedding(emb, None, r, p, padded) for r in range(p)]
    ids = torch.tensor([[0, 1, 344, 345, 1002]])
    assert torch.allclose(sum(m(ids) for m in layers), F.embedding(ids, emb))
    logits = torch.cat([m.logits(x) for m in layers], dim=-1)
    assert logits.shape[-1] == padded and torch.count_nonzero(logits[..., VOCAB:]) == 0
    assert torch.allclose(logits[..., :VOCAB], x @ emb.t(), atol=1e-5)


def test_cross_entropy_single_rank_with_padding() -> None:
    torch.manual_seed(0)
    z = torch.randn(20, 1024, requires_grad=True)
    t = torch.randint(0, VOCAB, (20,))
    t[3] = -100
    ours = vocab_parallel_cross_entropy(z, t, vocab_start=0, true_vocab=VOCAB)
    ref = F.cross_entropy(z[:, :VOCAB], t, reduction="none")
    assert torch.allclose(ours, ref, atol=1e-6) and ours[3] == 0
    (g_ours,) = torch.autograd.grad(ours.sum(), z)
    (g_ref,) = torch.autograd.grad(ref.sum(), z)
    assert torch.allclose(g_ours, g_ref, atol=1e-6) and torch.count_nonzero(g_ours[:, VOCAB:]) == 0


# --- multi-rank ------------------------------------------------------------------------
def _overlapped_linear_rank(rank: int) -> list[dict]:
    """Each case: ``parallel_input_linear`` on this rank's shard vs torch autograd on the full,
    unsharded product (the oracle): output block, input gradient (summed over ranks, or this
    rank's sequence chunk with SP), weight and bias gradient blocks."""
    import itertools

    import torch.distributed as dist

    from ds_mp.tensor_parallel.mappings import parallel_input_linear

    dist.init_process_group("gloo")
    n, group = dist.get_world_size(), dist.group.WORLD
    out = []
    for sp, transposed, overlap in itertools.product((False, True), repeat=3):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            g = torch.Generator().manual_seed(5)  # the same full tensors on every rank
            x = torch.randn(2, 8, 12, generator=g)
            w = torch.randn(10, 12, generator=g) if transposed else torch.randn(12, 10, generator=g)
            b = None if transposed else torch.randn(10, generator=g)
            r = torch.randn(2, 8, 10, generator=g)  # loss = Σ y ∘ r
            xf, wf = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            bf = None if b is None else b.clone().requires_grad_(True)
            yf = xf @ (wf.t() if transposed else wf) + (0 if bf is None else bf)
            (yf * r).sum().backward()
            cols = slice(rank * 5, (rank + 1) * 5)
            xl = (x.chunk(n, dim=1)[rank] if sp else x).to(dtype).requires_grad_(True)
            wl = (w[cols] if transposed else w[:, cols]).to(dtype).requires_grad_(True)
            bl = None if b is None else b[cols].to(dtype).requires_grad_(True)
            y = parallel_input_linear(xl, wl, bl, group, sequence_parallel=sp, transposed=transposed,
                                      overlap=overlap)
            (y.float() * r[..., cols]).sum().backward()
            want_gx = xf.grad.chunk(n, dim=1)[rank] if sp else xf.grad
            want_gw = wf.grad[cols] if transposed else wf.grad[:, cols]
            pairs = [(y, yf[..., cols]), (xl.grad, want_gx), (wl.grad, want_gw)]
            if bl is not None:
                pairs.append((bl.grad, bf.grad[cols]))
            err = max(float(((a.float() - e).abs().max() / e.abs().max())) for a, e in pairs)
            out.append({"case": (sp, transposed, overlap, str(dtype)), "rel_err": err, "tol": tol})
    return out


def test_parallel_input_linear_matches_unsharded_autograd() -> None:
    """The fused column-parallel linear (dX all-reduce / reduce-scatter started before dW is
    computed) gives the unsharded product's output and gradients: SP on/off, Conv1D and
    transposed (LM head) layout, overlapped or not, fp32 and bf16 (gloo reduces bf16 in fp32)."""
    for rank_cases in run_ranks(_overlapped_linear_rank, 2, timeout=120):
        assert len(rank_cases) == 16
        for c in rank_cases:
            assert c["rel_err"] <= c["tol"], c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup_accumulates_only_touched_rows(dtype) -> None:
    """``embedding_lookup`` against ``F.embedding`` (the oracle) over three backwards into one
    ``.grad`` (a step's micro-batches or token slices), repeated ids included: the same sums,
    ``.grad`` stays dense, and the later backwards hand AccumulateGrad a sparse gradient of
    only the looked-up rows.  ``sparse_grads=False`` (``torch.autograd.grad`` users) and a
    first backward give the dense gradient."""
    from ds_mp.tensor_parallel.layers import embedding_lookup

    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, EMBD, generator=g).to(dtype).requires_grad_()
    oracle = w.detach().clone().requires_grad_()
    seen: list = []
    w.register_hook(lambda grad: seen.append(grad.layout))
    for _ in range(3):
        ids = torch.randint(0, 40, (2, SEQ), generator=g)  # few distinct rows: repeats
        dy = torch.randn(2, SEQ, EMBD, generator=g).to(dtype)
        embedding_lookup(ids, w).backward(dy)
        F.embedding(ids, oracle).backward(dy)
        assert w.grad.layout == torch.strided
        tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 0, "atol": 1e-6}  # bf16: sum order
        torch.testing.assert_close(w.grad, oracle.grad, **tol)
    assert seen == [torch.strided, torch.sparse_coo, torch.sparse_coo]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    (dense,) = torch.autograd.grad(embedding_lookup(ids, w, sparse_grads=False).sum(), [w])
    assert dense.layout == torch.strided
    torch.testing.assert_close(dense, torch.autograd.grad(F.embedding(ids, oracle).sum(), [oracle])[0])


def _rng_probe(engine, tp_group) -> dict:
    """Which RNG stream each dropout draws from: the CPU RNG state at every attention
    (SDPA, dropout inside the parallel region) and every F.dropout call (outside)."""
    import hashlib

    import torch.distributed as dist

    seen: dict = {"attn": [], "dropout": [], "p": set()}
    sdpa, drop = F.scaled_dot_product_attention, F.dropout

    def digest() -> str:
        return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()

    def sdpa_probe(*a, **k):
        seen["attn"].append(digest())
        seen["p"].add(k.get("dropout_p"))
        return sdpa(*a, **k)

    def drop_probe(x, p=0.5, training=True, inplace=False):
        seen["dropout"].append(digest())
        seen["p"].add(p if training else 0.0)
        return drop(x, p, training, inplace)

    F.scaled_dot_product_attention, F.dropout = sdpa_probe, drop_probe
    try:
        engine.module.train()
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
        engine.module(ids)
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, drop
    every: list = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(every, seen, group=tp_group)
    attn_differs = all(len({s["attn"][i] for s in every}) == len(every) for i in range(len(seen["attn"])))
    drop_agrees = all(len({s["dropout"][i] for s in every}) == 1 for i in range(len(seen["dropout"])))
    return {"attn_calls": len(seen["attn"]), "dropout_calls": len(seen["dropout"]), "dropout_p": seen["p"],
            "attn_masks_differ": attn_differs, "resid_embd_masks_agree": drop_agrees}


def _tp_rank(rank: int, tp: int) -> dict:
    import torch.distributed as dist

    import ds_mp

    out: dict = {}
    model = tp_model(tp)
    # 1. logits, loss and every gradient: one SGD step with lr = 1 gives Δw = −∇w.
    (step,) = data(1, 1, seed=3)
    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=ds_config(tp=tp, micro=2, gas=1, lr=1.0))
    w0, _ = gather_weights(engine)
    with torch.no_grad():
        local = engine.module.eval()(step[0][0])  # (B, T, V_p/p)
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=engine.topology.tp_group)
    engine.module.train()
    loss = float(engine.train_batch(iter(step)))
    w1, pad = gather_weights(engine)
    ref = copy.deepcopy(model).train()
    hf_out = ref(input_ids=step[0][0], labels=step[0][1])
    hf_out.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    out["logits"] = float((torch.cat(parts, -1)[..., :VOCAB] - hf_out.logits.detach()).abs().max())
    out["loss"] = abs(loss - float(hf_out.loss))
    out["grads"] = max_diff({n: w0[n] - w1[n] for n in w0}, grads)
    out["params_covered"] = sorted(w0) == sorted(grads)
    out["pad_rows_zero"] = all(torch.count_nonzero(x) == 0 for x in pad.values())
    # 2. fused vocab-parallel CE against F.cross_entropy on the full logits.
    g = torch.Generator().manual_seed(7)
    z, t = torch.randn(24, 1024, generator=g), torch.randint(0, VOCAB, (24,), generator=g)
    t[:2] = -100
    zl = z.chunk(tp, -1)[engine.topology.tp_rank].clone().requires_grad_(True)
    ce = vocab_parallel_cross_entropy(zl, t, vocab_start=engine.topology.tp_rank * (1024 // tp), true_vocab=VOCAB,
                                      group=engine.topology.tp_group)
    zf = z[:, :VOCAB].clone().requires_grad_(True)
    ref_ce = F.cross_entropy(zf, t, reduction="none")
    (ce * torch.arange(24.0)).sum().backward()
    (ref_ce * torch.arange(24.0)).sum().backward()
    full_grad = F.pad(zf.grad, (0, 1024 - VOCAB))
    out["ce"] = float((ce - ref_ce).abs().max())
    out["ce_grad"] = float((zl.grad - full_grad.chunk(tp, -1)[engine.topology.tp_rank]).abs().max())
    # 3. three steps (GAS 2) with clipping at 1.0, sequence parallel off and on, vs HF.
    steps = data(3, 2, seed=11)
    hf_losses, hf_norms, hf_w = hf_train(model, steps, lr=0.1, clip=1.0)
    out["clip_active"] = min(hf_norms) > 1.0
    for sp in (False, True):
        cfg = ds_config(tp=tp, micro=2, gas=2, lr=0.1, clip=1.0, tensor_parallel={"sequence_parallel": sp})
        losses, norms, w, pad = engine_run(model, steps, cfg)
        out[f"sp{int(sp)}_loss"] = max(abs(a - b) for a, b in zip(losses, hf_losses))
        out[f"sp{int(sp)}_norm"] = max(abs(a - b) for a, b in zip(norms, hf_norms))
        out[f"sp{int(sp)}_weights"] = max_diff(w, hf_w)
        out[f"sp{int(sp)}_pad_rows_zero"] = all(torch.count_nonzero(x) == 0 for x in pad.values())
    # 4. dropout: attention masks per rank, residual/embedding masks shared over TP.
    engine, *_ = ds_mp.initialize(model=tp_model(tp, dropout=0.1), config=ds_config(tp=tp, micro=2, gas=1))
    out.update(_rng_probe(engine, engine.topology.tp_group))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_hf(tp: int) -> None:
    for rank, r in enumerate(run_ranks(_tp_rank, tp, tp, timeout=300)):
        where = f"TP={tp} rank {rank}: {r}"
        assert r["params_covered"] and r["pad_rows_zero"] and r["clip_active"], where
        for key in ("logits", "loss", "grads", "ce", "ce_grad", "sp0_loss", "sp0_norm", "sp0_weights",
                    "sp1_loss", "sp1_norm", "sp1_weights"):
            assert r[key] <= TOL, f"{key}: {where}"
        assert r["sp0_pad_rows_zero"] and r["sp1_pad_rows_zero"], where
        assert r["attn_calls"] == 2 and r["dropout_calls"] == 5, where  # 2 blocks; embd + 2 × 2 resid
        assert r["dropout_p"] == {0.1} and r["attn_masks_differ"] and r["resid_embd_masks_agree"], where
