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

    from ds_mp.context_parallel.attention import allgather_attention, ulysses_attention, ulysses_kv_index

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    for impl in ("allgather", "ulysses"):
        for h, n_kv, window in ((4, 4, None), (4, 2, None), (4, 1, None), (4, 2, 3)):
            gen = torch.Generator().manual_seed(h * 10 + n_kv + (window or 0))
            q, g = (torch.randn(3, h, T, HD, generator=gen) for _ in range(2))
            k, v = (torch.randn(3, n_kv, T, HD, generator=gen) for _ in range(2))
            kv_index = torch.arange(h) // (h // n_kv)
            lay = _layout(window)
            ref = _reference(q, k, v, lay, kv_index, g)
            idx = shard_index(T, 2, rank, balanced_for(impl))
            mine = dataclasses.replace(lay, q_index=idx, masks={})
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
            if impl == "allgather":
                y = allgather_attention(ql, kl, vl, kv_index, mine.mask(T // 2, T, sharded=True), group=group, cp=2,
                                        cp_rank=rank)
            else:
                split = ulysses_kv_index(kv_index, n_kv, 2, rank)
                assert (split is None) == (n_kv == 1), (n_kv, split)  # 1 KV head: replicated to the query heads
                y = ulysses_attention(ql, kl, vl, kv_index, split, mine.mask(T, T), group=group, cp=2, cp_rank=rank)
            (y * g[:, :, idx]).sum().backward()
            what = f"{impl} h={h} kv={n_kv} window={window}"
            for name, got, want in (("y", y, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                    ("dv", vl.grad, ref[3])):
                torch.testing.assert_close(got, want[:, :, idx], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")
            # leak probe: change the key/value of one token of document 1 (row 0, index 3): outputs
            # change only at document 1's queries, on both ranks
            k2, v2 = k.clone(), v.clone()
            k2[0, :, 3] += 1.0
            v2[0, :, 3] -= 1.0
            with torch.no_grad():
                if impl == "allgather":
                    y2 = allgather_attention(ql, k2[:, :, idx], v2[:, :, idx], kv_index,
                                             mine.mask(T // 2, T, sharded=True), group=group, cp=2, cp_rank=rank)
                else:
                    y2 = ulysses_attention(ql, k2[:, :, idx], v2[:, :, idx], kv_index, split, mine.mask(T, T),
                                           group=group, cp=2, cp_rank=rank)
            changed = (y2 - y.detach()).abs().amax(dim=(1, 3)) > 0  # (B, T/2)
            doc1 = torch.zeros(3, T, dtype=torch.bool)
            doc1[0, 3:6] = True  # document 1's queries at or after the changed key
            assert torch.equal(changed, doc1[:, idx]), (what, changed)
    _dropout_checks(rank, group)
    dist.destroy_process_group()


def _dropout_checks(rank: int, group) -> None:
    """Attention dropout under CP: every head holds the same q/k/v, so a head's output depends only on
    its dropout mask.  CP peers share the RNG stream; each must still draw its own masks (ulysses:
    rank 0's head chunk and rank 1's differ), the same again from the same stream state
    (recomputation); the draw both impls make under ``_cp_rng`` differs by CP rank while the shared
    stream advances alike."""
    from ds_mp.context_parallel.attention import _cp_rng, ulysses_attention

    one = torch.randn(3, 1, T, HD, generator=torch.Generator().manual_seed(5))
    q = k = v = one.expand(3, 4, T, HD)[:, :, shard_index(T, 2, rank, False)]
    kv_index, lay = torch.arange(4), dataclasses.replace(_layout(None), q_index=shard_index(T, 2, rank, False))
    outs = []
    for _ in range(2):
        torch.manual_seed(11)  # the same stream state on both ranks, and again for the second run
        outs.append(ulysses_attention(q, k, v, kv_index, kv_index[:2], lay.mask(T, T), group=group, cp=2,
                                      cp_rank=rank, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1])  # reproducible from the stream state
    assert not torch.equal(outs[0][:, :2], outs[0][:, 2:])  # heads 0-1 (rank 0's) vs 2-3 (rank 1's): own masks
    torch.manual_seed(11)
    with _cp_rng(2, rank, torch.device("cpu"), True):
        inside = torch.rand(8)
    after = torch.rand(8)  # the shared stream advanced alike on both ranks
    both = torch.empty(2, 2, 8)
    torch.distributed.all_gather_single(both, torch.stack((inside, after))[None].contiguous(), group=group)
    assert not torch.equal(both[0, 0], both[1, 0]) and torch.equal(both[0, 1], both[1, 1])


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


# ------------------------------------------------------------------ model level (vs HF, each document alone)

def _hf_models() -> dict:
    """Tiny HF models of every family the attention serves: Llama (GQA), Qwen2 (biases, tied, one
    key/value head: ulysses replicates it), Mistral (a window of 3 < a shard of 8), Gemma 3 (sliding
    and full layers), GPT-2 (absolute positions)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    from helpers import _perturb_norms, tiny_gemma3, tiny_gpt2

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=101,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return {"llama": _perturb_norms(LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common)).eval()),
            "qwen2": _perturb_norms(Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True,
                                                                 **common)).eval()),
            "mistral": _perturb_norms(MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=3,
                                                                       **common)).eval()),
            "gemma3": tiny_gemma3(n_layer=2, window=3, vocab=101), "gpt2": tiny_gpt2(n_layer=2, vocab=101)}


def _stack(model, ctx) -> tuple[list, list[tuple[str, torch.nn.Parameter]]]:
    """ds_mp's layers of ``model`` in pipeline order (callables) and their parameters by HF name."""
    from deepspeed.pipe import TiedLayerSpec

    from ds_mp.models.weights import WeightSource

    family, src = ctx.family, WeightSource.from_model(model)
    calls, params, tied = [], {}, {}
    for name in family.pipeline_layers(model.config):
        spec = family.layer_spec(name, src, ctx)
        if isinstance(spec, TiedLayerSpec):
            first = spec.key not in tied
            module = tied.setdefault(spec.key, spec.build())
            calls.append(lambda x, m=module, f=spec.forward_fn: f(m, x))
        else:
            first, module = True, spec.build()
            calls.append(module)
        if first:
            params.update({family.hf_name(name, n): p for n, p in module.named_parameters()})
    return calls, sorted(params.items())


def _model_ranks(rank: int) -> None:
    import torch.distributed as dist

    from ds_mp.engine.initialize import init_distributed
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology, build_grid

    init_distributed()
    topology = build_grid(Topology(tp=1, pp=1, dp=1, cp=2, rank=rank))
    base = _layout(None)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 101, (3, T), generator=g)
    errors: list[str] = []
    segments = [(r, int(a), int(b)) for r in range(3) for a, b in _documents(base.docs[r])]
    for family, model in _hf_models().items():
        gout = torch.randn(3, T, 101, generator=g) * (base.docs >= 0)[..., None]  # no gradient from padding queries
        model.zero_grad()
        ref = torch.zeros(3, T, 101)
        for r, a, b in segments:  # every document alone through HF's model
            logits = model(input_ids=ids[r:r + 1, a:b]).logits[0]
            (logits * gout[r, a:b]).sum().backward()
            ref[r, a:b] = logits.detach()
        want = {n: p.grad for n, p in model.named_parameters()}
        for impl in ("allgather", "ulysses"):
            ctx = Ctx(topology, model.config, False, 1, cp_impl=impl)
            calls, params = _stack(model, ctx)
            idx = shard_index(T, 2, rank, balanced_for(impl))
            ctx.layout = dataclasses.replace(_layout(ctx.window), q_index=idx, masks={})
            h = ids[:, idx]
            for call in calls:
                h = call(h)
            real = base.docs[:, idx] >= 0
            _close(errors, h[..., :101][real], ref[:, idx][real], f"{family} {impl} logits")
            (h[..., :101] * gout[:, idx]).sum().backward()
            for name, p in params:
                grad = p.grad.clone()
                dist.all_reduce(grad)  # the grad group's sum over the CP ranks
                _close(errors, grad, want[name], f"{family} {impl} d{name}")
    _recompute_check(_hf_models()["llama"], topology, ids, rank, errors)
    dist.destroy_process_group()
    assert not errors, "\n".join(errors)


def _close(errors: list[str], got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """Record ``what`` in ``errors`` unless ``got`` equals ``want`` to ``tol`` relative to the larger of 1
    and ``want``'s largest entry (Gemma 3's gradients reach 1e2: fp32 sums of them differ by 1e-5 in
    any order)."""
    if not torch.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()))):
        errors.append(f"{what}: max |diff| {(got - want).abs().max():.2e}, max |want| {want.abs().max():.2e}")


def _recompute_check(model, topology, ids: torch.Tensor, rank: int, errors: list[str]) -> None:
    """Attention dropout at CP = 2 under DeepSpeed's activation checkpointing (the pipeline's): the
    recomputation in backward redraws the forward's masks, so outputs and gradients equal a run without
    checkpointing from the same seeds, exactly."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from ds_mp.models.ctx import Ctx
    from ds_mp.tensor_parallel.random import seed_everything

    model.config.attention_dropout = 0.3
    runs = []
    for recompute in (False, True):
        ctx = Ctx(topology, model.config, False, 1, cp_impl="allgather")
        calls, params = _stack(model, ctx)
        ctx.layout = dataclasses.replace(_layout(None), q_index=shard_index(T, 2, rank, True), masks={})
        seed_everything(0, tp_rank=0)
        h = calls[0](ids[:, ctx.layout.q_index])
        for call in calls[1:]:
            h = checkpointing.checkpoint(call, h) if recompute and getattr(call, "is_block", False) else call(h)
        h.square().sum().backward()
        runs.append((h.detach(), [p.grad for _, p in params]))
    model.config.attention_dropout = 0.0
    if not (torch.equal(runs[0][0], runs[1][0]) and all(map(torch.equal, runs[0][1], runs[1][1]))):
        errors.append("attention dropout under activation checkpointing: the recomputation drew other masks")


def _documents(docs_row: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) of each document (docs >= 0) of one row."""
    out, start = [], 0
    for i in range(1, len(docs_row) + 1):
        if i == len(docs_row) or docs_row[i] != docs_row[start]:
            if docs_row[start] >= 0:
                out.append((start, i))
            start = i
    return out


def test_cp_models_match_hf_per_document() -> None:
    """Every family's stack (embedding, 2 blocks, norm, head) at CP = 2 with both impls equals HF's model
    run on each document alone: logits on every real token and every parameter's gradient summed over
    the CP ranks, 1e-5."""
    run_ranks(_model_ranks, 2, timeout=300)


def _tp_cp_ranks(rank: int) -> None:
    """CP=2 × TP=2 (with and without sequence parallelism) against TP=2 at CP=1 on the same 4 ranks
    (the TP=2 path is checked against HF in test_llama/test_gpt2): logits of this rank's tokens on its
    vocab block, and every parameter shard's gradient summed over CP."""
    import torch.distributed as dist

    from ds_mp.engine.initialize import init_distributed
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology, build_grid

    init_distributed()
    cp_topo = build_grid(Topology(tp=2, pp=1, dp=1, cp=2, rank=rank))
    tp_topo = build_grid(Topology(tp=2, pp=1, dp=2, cp=1, rank=rank))
    models, errors = _hf_models(), []
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 101, (3, T), generator=g)
    for family, impl, sp in (("llama", "allgather", False), ("llama", "ulysses", True), ("qwen2", "ulysses", True),
                             ("mistral", "allgather", True), ("gpt2", "ulysses", True), ("gpt2", "allgather", False)):
        model = models[family]
        results = []
        for topo in (tp_topo, cp_topo):
            ctx = Ctx(topo, model.config, sp, 1, cp_impl=impl)
            calls, params = _stack(model, ctx)
            idx = shard_index(T, topo.cp, topo.cp_rank, balanced_for(impl)) if topo.cp > 1 else None
            ctx.layout = dataclasses.replace(_layout(ctx.window), q_index=idx, masks={})
            h = ids if idx is None else ids[:, idx]
            for call in calls:
                h = call(h)
            gout = torch.randn(3, T, h.shape[-1], generator=torch.Generator().manual_seed(rank % 2))
            gout = gout * (_layout(None).docs >= 0)[..., None]
            (h * (gout if idx is None else gout[:, idx])).sum().backward()
            grads = {}
            for name, p in params:
                grads[name] = p.grad.clone()
                if topo.cp > 1:
                    dist.all_reduce(grads[name], group=topo.cp_group)
            results.append((h.detach(), idx, grads))
        (full, _, want), (mine, idx, got) = results
        real = _layout(None).docs[:, idx] >= 0
        _close(errors, mine[real], full[:, idx][real], f"{family} {impl} sp={sp} logits")
        for name in want:
            _close(errors, got[name], want[name], f"{family} {impl} sp={sp} d{name}")
    dist.destroy_process_group()
    assert not errors, "\n".join(errors)


def test_cp_tp_models_match_tp_alone() -> None:
    run_ranks(_tp_cp_ranks, 4, timeout=400)
