"""Ouroboros: split/layout rules, timetable unroll (rendezvous p2p), and the single-process
reference against HF GPT-2 (delay=False: exact backprop; delay=True: Algorithm 1 by hand)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from ouroboros_oracle import (ModuleBackward, ModuleForward, UpdateModules, OuroborosReference, RecvHidden, RecvDelta,
                              SendHidden, SendDelta, format_timetable, ouroboros_timetable, ring_layout, split_modules)
from ds_mp.schedules.ouroboros.timetable import head_cost_in_blocks

VOCAB, SEQ, BATCH = 101, 8, 2


def tiny_gpt2(n_layer: int = 4, attn: str = "sdpa", seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    return GPT2LMHeadModel(cfg)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :2] = -100  # exercise ignore_index
        out.append((ids, labels))
    return out


def sgd(lr: float = 0.1, **kw):
    return lambda params: torch.optim.SGD(params, lr=lr, **kw)


def adam(lr: float = 1e-2, eps: float = 1e-3):
    """Adam with an eps comparable to these models' gradients (median |g| ~2e-3): the weights it gives
    two orders of summation differ by rounding only, not by ±lr steps on near-zero gradients, so
    they compare at fp32 tolerance (tests/test_ouroboros.py ADAM_ATOL has the measurements)."""
    return lambda params: torch.optim.Adam(params, lr=lr, eps=eps)


# ----------------------------------------------------------------------------- split / layout
def test_split_and_layout():
    assert split_modules(4, 2) == [range(0, 2), range(2, 4)]
    assert split_modules(4, 3) == [range(0, 1), range(1, 3), range(3, 4)]
    assert split_modules(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert split_modules(5, 4) == [range(0, 0), range(0, 2), range(2, 4), range(4, 5)]  # G_0 = embedding only
    for L in range(1, 9):
        for K in range(2, L + 2):
            mods = split_modules(L, K)
            assert [i for r in mods for i in r] == list(range(L))
            per_rank = [len(mods[0]) + len(mods[-1])] + [len(r) for r in mods[1:-1]]
            assert max(per_rank) - min(per_rank) <= 1 and min(per_rank) >= 1
    for L, K in [(4, 1), (3, 5)]:
        with pytest.raises(ValueError, match="K >= 2"):
            split_modules(L, K)
    assert ring_layout(2) == [[0, 1]]
    assert ring_layout(5) == [[0, 4], [1], [2], [3]]


def test_split_by_cost_equal_and_explicit():
    """A head worth 3 blocks (V = 36·C) moves blocks off rank 0: 12 blocks, K=4 (3 ranks):
    rank costs head+2 | 5 | 5 instead of head+4 | 4 | 4; "equal" is the paper's K equal modules;
    a list is taken as given."""
    assert head_cost_in_blocks(36 * 64, 64) == pytest.approx(3.0)
    assert [len(r) for r in split_modules(12, 4, head_blocks=3.0)] == [1, 5, 5, 1]
    assert [len(r) for r in split_modules(12, 4)] == [2, 4, 4, 2]
    assert [len(r) for r in split_modules(12, 4, "equal")] == [3, 3, 3, 3]
    assert [len(r) for r in split_modules(10, 4, "equal")] == [2, 3, 3, 2]
    assert [len(r) for r in split_modules(6, 3, [0, 4, 2])] == [0, 4, 2]
    with pytest.raises(ValueError, match="at least 1 for every middle module"):
        split_modules(6, 3, [3, 0, 3])


# ----------------------------------------------------------------------------- timetable unroll
def unroll(K: int, T: int) -> tuple[dict, list[list[dict]]]:
    """Run every rank's program with blocking rendezvous p2p, checking data dependencies.
    Returns ({"F": {(m, s): t}, "B": {(m, s): t}}, recv counts [t][rank])."""
    table = ouroboros_timetable(K, T)
    owner = {m: r for r, ms in enumerate(ring_layout(K)) for m in ms}
    R = K - 1
    prog = [[(t, st) for t in range(T) for st in table[t][r]] for r in range(R)]
    head = [0] * R
    acts = [set() for _ in range(R)]      # (m, s): output of G_m for s present on rank
    grads = [dict() for _ in range(R)]    # (m, s) -> iteration the delta from G_m arrived/was made
    done = {"F": {}, "B": {}}
    recvs = [[{"act": 0, "grad": 0} for _ in range(R)] for _ in range(T)]

    def local(r: int, t: int, st) -> None:
        if isinstance(st, ModuleForward):
            m, s = st.module, st.sample
            assert owner[m] == r and s == t and (m == 0 or (m - 1, s) in acts[r])
            assert (m, s) not in done["F"]
            done["F"][(m, s)] = t
            acts[r].add((m, s))
        elif isinstance(st, ModuleBackward):
            m, s = st.module, st.sample
            assert owner[m] == r and (m, s) in done["F"] and (m, s) not in done["B"]
            assert t == s + (K - 1 - m), "delay of G_m must be K-1-m"
            if m < K - 1:
                assert grads[r][(m + 1, s)] < t, "a delta is used the iteration after it arrives"
            done["B"][(m, s)] = t
            grads[r][(m, s)] = t
        else:
            assert isinstance(st, UpdateModules)

    while any(head[r] < len(prog[r]) for r in range(R)):
        progressed = False
        for r in range(R):
            if head[r] == len(prog[r]):
                continue
            t, st = prog[r][head[r]]
            if isinstance(st, (ModuleForward, ModuleBackward, UpdateModules)):
                local(r, t, st)
                head[r] += 1
                progressed = True
            elif isinstance(st, (SendHidden, SendDelta)):
                p = st.peer
                if head[p] == len(prog[p]):
                    continue
                tp, other = prog[p][head[p]]
                want = RecvHidden if isinstance(st, SendHidden) else RecvDelta
                if other == want(st.module, st.sample, r):
                    assert tp == t, "send and receive happen at the same iteration"
                    if isinstance(st, SendHidden):
                        assert (st.module, st.sample) in acts[r]
                        acts[p].add((st.module, st.sample))
                        recvs[t][p]["act"] += 1
                    else:
                        assert done["B"][(st.module, st.sample)] == t
                        grads[p][(st.module, st.sample)] = t
                        recvs[t][p]["grad"] += 1
                    head[r] += 1
                    head[p] += 1
                    progressed = True
        assert progressed, f"deadlock: {[prog[r][head[r]] for r in range(R) if head[r] < len(prog[r])]}"
    return done, recvs


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_timetable_unroll(K):
    T = 2 * K + 2
    done, recvs = unroll(K, T)
    assert set(done["F"]) == {(m, s) for m in range(K) for s in range(T)}  # each once (asserted inside)
    assert done["B"] == {(m, s): s + K - 1 - m for m in range(K) for s in range(T) if s + K - 1 - m < T}
    for t in range(T):
        for r, c in enumerate(recvs[t]):
            assert c["act"] <= 1 and c["grad"] <= 1
            if K > 2 and t >= K - 2:  # steady state: exactly one of each
                assert c == {"act": 1, "grad": 1}, (t, r, c)
    if K == 2:
        assert all(c == {"act": 0, "grad": 0} for row in recvs for c in row)  # all local on one rank


def test_timetable_reads_like_the_figure():
    text = format_timetable(ouroboros_timetable(3, 3))
    assert "t=2 r0 | F0:2 a0:2>r1 B0:0 a1:2<r1 F2:2 B2:2 g1:1<r1 g2:2>r1 step" in text
    assert "t=2 r1 | a0:2<r0 F1:2 a1:2>r0 B1:1 g1:1>r0 g2:2<r0 step" in text


# ----------------------------------------------------------------------------- reference vs HF
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_first_loss_equals_hf(attn):
    model = tiny_gpt2(attn=attn)
    (ids, labels), = batches(1)
    ref = OuroborosReference(model, 3, sgd(), delay=False)
    assert ref.model.lm_head.weight is ref.model.transformer.wte.weight
    assert abs(ref.step(ids, labels) - model(ids, labels=labels).loss.item()) < 1e-6


@pytest.mark.parametrize("make_opt", [sgd(0.1, momentum=0.9), adam()], ids=["sgd", "adam"])
@pytest.mark.parametrize("K", [2, 4])
def test_no_delay_is_plain_backprop(K, make_opt):
    model = tiny_gpt2()
    hf = copy.deepcopy(model)
    opt = make_opt(hf.parameters())
    ref = OuroborosReference(model, K, make_opt, delay=False)
    for ids, labels in batches(3):
        opt.zero_grad()
        loss = hf(ids, labels=labels).loss
        loss.backward()
        opt.step()
        assert abs(ref.step(ids, labels) - loss.item()) < 1e-6
    for (name, p), q in zip(hf.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


def hf_split_grads(model, ids, labels, names, boundary=None, delta=None):
    """HF forward with the input embedding V_i as its own leaf, so wte's grad is the V_o part.
    Without delta: (loss, {name: df/dp}, df/dV_i, df/dh_boundary). With delta: the replay
    ({name: (dh_boundary/dp)^T delta}, (dh_boundary/dV_i)^T delta)."""
    params = dict(model.named_parameters())
    vi = model.transformer.wte.weight.detach().clone().requires_grad_()
    out = model(inputs_embeds=F.embedding(ids, vi), labels=labels, output_hidden_states=True)
    h = out.hidden_states[boundary] if boundary is not None else None
    if delta is not None:
        g = torch.autograd.grad(h, [params[n] for n in names] + [vi], grad_outputs=delta)
        return dict(zip(names, g[:-1])), g[-1]
    g = torch.autograd.grad(out.loss, [params[n] for n in names] + [vi] + ([h] if h is not None else []))
    return out.loss.item(), dict(zip(names, g[:len(names)])), g[len(names)], (g[-1] if h is not None else None)


def test_k2_two_iterations_by_hand():
    """K=2, SGD: iteration 0 updates G_1 and V by 1/2 df0/dV_o only; iteration 1 replays G_0 on x0
    with w^1 and backprops the stale delta_0^0 = df0/dh_2 (computed with w^0)."""
    lr, model = 0.1, tiny_gpt2(n_layer=4)
    (x0, y0), (x1, y1) = batches(2)
    names = [n for n, _ in model.named_parameters()]
    g0_names = [n for n in names if n == "transformer.wpe.weight" or n.startswith(("transformer.h.0.", "transformer.h.1."))]
    g1_names = [n for n in names if n.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f."))]
    assert set(g0_names) | set(g1_names) | {"transformer.wte.weight"} == set(names)
    V = "transformer.wte.weight"
    hand = copy.deepcopy(model)
    w0 = {n: p.detach().clone() for n, p in hand.named_parameters()}

    f0, g, _, delta00 = hf_split_grads(hand, x0, y0, g1_names + [V], boundary=2)
    w1 = dict(w0)
    w1[V] = w0[V] - lr * 0.5 * g[V]
    for n in g1_names:
        w1[n] = w0[n] - lr * g[n]
    with torch.no_grad():
        for n, p in hand.named_parameters():
            p.copy_(w1[n])
    f1, g, _, _ = hf_split_grads(hand, x1, y1, g1_names + [V])
    replay, replay_vi = hf_split_grads(hand, x0, None, g0_names, boundary=2, delta=delta00)
    w2 = {n: w1[n] - lr * (g[n] if n in g1_names else replay[n]) for n in g0_names + g1_names}
    w2[V] = w1[V] - lr * 0.5 * (g[V] + replay_vi)

    ref = OuroborosReference(model, 2, sgd(lr))
    assert abs(ref.step(x0, y0) - f0) < 1e-6 and ref.backward_samples == [None, 0]
    assert abs(ref.step(x1, y1) - f1) < 1e-6 and ref.backward_samples == [0, 1]
    for n, p in ref.model.named_parameters():
        torch.testing.assert_close(p.detach(), w2[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("make_opt", [sgd(0.1), adam()], ids=["sgd", "adam"])
def test_warmup_zero_grads_and_half_tied(make_opt):
    """K=4: G_m's own weights stay put for the first d_m = 3-m iterations (zero gradient, also
    under Adam), G_3 moves at once, and V's first update is 1/2 df0/dV_o (checked with SGD)."""
    K, model = 4, tiny_gpt2(n_layer=6)
    ref = OuroborosReference(model, K, make_opt)
    blocks = split_modules(6, K)
    own = {m: [f"transformer.h.{i}." for i in blocks[m]] for m in range(K)}
    own[0].append("transformer.wpe.")
    own[K - 1].append("transformer.ln_f.")
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    data = batches(K)
    table = ouroboros_timetable(K, K)
    for t, (ids, labels) in enumerate(data):
        ref.step(ids, labels)
        expected = {st.module: st.sample for row in table[t] for st in row if isinstance(st, ModuleBackward)}
        assert ref.backward_samples == [expected.get(m) for m in range(K)]
        for m in range(K):
            moved = [n for n, p in ref.model.named_parameters()
                     if n.startswith(tuple(own[m])) and not torch.equal(p, before[n])]
            assert bool(moved) == (t >= K - 1 - m), (t, m, moved)
        if t == 0 and isinstance(ref.optimizer, torch.optim.SGD):
            _, g, _, _ = hf_split_grads(copy.deepcopy(model), ids, labels, ["transformer.wte.weight"])
            expect = before["transformer.wte.weight"] - 0.1 * 0.5 * g["transformer.wte.weight"]
            torch.testing.assert_close(ref.model.transformer.wte.weight.detach(), expect, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_delayed_training_decreases_loss(K):
    (ids, labels), = batches(1)
    ref = OuroborosReference(tiny_gpt2(), K, sgd(0.2))
    losses = [ref.step(ids, labels) for _ in range(20)]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_dropout_is_refused():
    model = tiny_gpt2()
    model.config.resid_pdrop = 0.1
    with pytest.raises(ValueError, match="pdrop"):
        OuroborosReference(model, 2, sgd())


# ----------------------------------------------------------------------------- warm-up and recompute
def test_modules_in_warm_up_take_no_step():
    """K=3, AdamW with weight decay: at iteration 0 only G_2 (and the tied V) have a gradient, so
    G_0's and G_1's other parameters must not move (no decay, no Adam step) and hold no optimizer
    state; a zero-gradient step would have decayed them."""
    model = tiny_gpt2()
    ref = OuroborosReference(model, 3, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.5))
    (ids, labels), = batches(1)
    ref.step(ids, labels)
    before, after = dict(model.named_parameters()), dict(ref.model.named_parameters())
    g0_g1 = [n for n in before if n.startswith(("transformer.h.0.", "transformer.h.1.", "transformer.h.2.",
                                                 "transformer.wpe"))]
    assert g0_g1  # G_0 = block 0 + wpe, G_1 = blocks 1-2 (split_modules(4, 3))
    for n in g0_g1:
        assert torch.equal(before[n], after[n]), n
        assert ref.optimizer.state.get(after[n]) in (None, {}), n
    assert not torch.equal(before["transformer.h.3.mlp.c_fc.weight"], after["transformer.h.3.mlp.c_fc.weight"])


@pytest.mark.parametrize("recompute, exact", [("stashed", True), ("current", False)])
def test_stashed_weights_replay_the_forwards_weights(recompute, exact):
    """K=2, SGD: G_0 backpropagates sample 0 at iteration 1.  With recompute="stashed" its
    gradient is exactly HF's gradient of f_0 at the initial weights w^0 (the weights sample 0 was
    forwarded with, eq. (8)); with "current" the replay uses w^1, whose tied V has moved."""
    model = tiny_gpt2()
    data = batches(2)
    ref = OuroborosReference(model, 2, sgd(), recompute=recompute)
    for ids, labels in data:
        ref.step(ids, labels)
    hf = copy.deepcopy(model).train()
    hf(input_ids=data[0][0], labels=data[0][1]).loss.backward()
    want, got = dict(hf.named_parameters()), dict(ref.model.named_parameters())
    for n in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.wpe.weight"):
        close = torch.allclose(got[n].grad, want[n].grad, atol=1e-6, rtol=1e-5)
        assert close == exact, n
