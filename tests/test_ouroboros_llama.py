"""Ouroboros for the Llama family (Llama, Qwen2, Mistral): the ring built from the family's layer
table, against the single-process reference cut from HF's unmodified ``…ForCausalLM``.

The oracle: ``OuroborosReference`` over HF's own decoder layers, embedding, norm and head
(``tests/ouroboros_hf_modules.py``), itself checked here against HF's model — with
delay=False it is HF's backprop, and with delay=True two iterations of K=2 equal the algebra of
Algorithm 1 written out with HF's autograd (stale delta, replay with the current weights).  The
engine runs ds_mp's TP layers in the ring order of the family's table: grouped-query attention
(KV heads split and replicated), tied and untied heads, Qwen2's biases, TP inside the modules,
bf16 within a measured tolerance, and a resume with work in flight.  One 2-rank spawn runs every
distributed case."""
from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_ranks
from helpers import batches
from test_llama import tiny_llama
from test_ouroboros import ADAM_ATOL, EPS, assert_same, ds_cfg, full_weights
from test_tensor_parallel import hf_train

SEQ, VOCAB, STEPS = 16, 1003, 4
BF16_RTOL = 1e-3  # relative, bf16 losses against the fp32 reference's (measured max 7.3e-5, K=3 Qwen2)


def model_for(kind: str, kv: int, tied: bool, n_layer: int = 3):
    return tiny_llama(kind, kv, tied, n_layer=n_layer)


def data(micro: int = 2, n: int = STEPS) -> list:
    out = batches(n, micro, SEQ, VOCAB, seed=3)
    out[0][1][0, :3] = -100  # some ignored labels
    return out


def llama_cfg(K: int, opt: str = "SGD", lr: float = 0.1, tp: int = 1, split: list | None = None, **kw) -> dict:
    cfg = ds_cfg(K, opt, lr=lr, **kw)
    cfg["ds_mp"]["tensor_parallel"] = {"size": tp}
    if split is not None:
        cfg["ds_mp"]["ouroboros"]["split"] = split
    return cfg


# (family, kv heads, tied, ds_mp config, what it shows)
JOBS = {
    "qwen2_k3": (("qwen2", 2, False), llama_cfg(3)),  # GQA, untied head, q/k/v biases, the family's balanced split
    "llama_k3_adam": (("llama", 3, True), llama_cfg(3, "Adam", lr=0.01, split=[1, 1, 1])),  # tied head, Adam
    "qwen2_k2_tp2": (("qwen2", 3, False), llama_cfg(2, tp=2)),  # TP=2 inside the modules, KV replicated (3 over 2)
    "mistral_k3_no_delay": (("mistral", 2, True), llama_cfg(3, delay=False, split=[1, 1, 1])),  # = HF backprop
    "qwen2_k3_bf16": (("qwen2", 2, False), {**llama_cfg(3), "bf16": {"enabled": True}}),
}


def train(rank: int, model, cfg: dict, steps: list) -> dict:
    import ds_mp

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    losses = [float(engine.train_batch(iter([b]))) for b in steps]
    return {"losses": losses, "weights": full_weights(engine), "layers": engine.module.layer_names}


def resume(rank: int, model, cfg: dict, steps: list, ckpt: str, split: int) -> dict:
    """Uninterrupted run saving after ``split`` iterations (deltas and stashed inputs in flight),
    then a fresh engine resumed there."""
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    losses = []
    for t, b in enumerate(steps):
        if t == split:
            save_checkpoint(engine, ckpt, f"step{t}")
        losses.append(float(engine.train_batch(iter([b]))))
    resumed, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    load_checkpoint(resumed, ckpt)
    tail = [float(resumed.train_batch(iter([b]))) for b in steps[split:]]
    return {"losses": losses, "tail": tail, "weights": full_weights(engine), "resumed": full_weights(resumed)}


def program(rank: int, ckpt: str) -> dict:
    out = {name: train(rank, model_for(*m), cfg, data()) for name, (m, cfg) in JOBS.items()}
    out["llama_k3_resume"] = resume(rank, model_for("llama", 2, False), llama_cfg(3, "Adam", lr=0.01), data(), ckpt, 2)
    return out


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> list[dict]:
    return run_ranks(program, 2, str(tmp_path_factory.mktemp("ouroboros_llama")), timeout=400)


def reference(model, K: int, make_opt, steps: list, split: list | None = None, recompute: str = "current"):
    """The single-process reference over HF's modules, split as the engine splits (the family's
    block cost weighs the head), one thread as on the ranks."""
    from ds_mp.models.family import family_of
    from ouroboros_oracle import OuroborosReference
    from ds_mp.schedules.ouroboros.timetable import head_cost_in_blocks, split_modules

    cfg = model.config
    head = head_cost_in_blocks(VOCAB, cfg.hidden_size, family_of(cfg).block_parameters(cfg))
    mods = split_modules(cfg.num_hidden_layers, K, split or "balanced", head_blocks=head)
    ref = OuroborosReference(model.train(), K, make_opt, split=mods, recompute=recompute)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = [ref.step(ids, labels) for ids, labels in steps]
    finally:
        torch.set_num_threads(threads)
    return losses, dict(ref.model.named_parameters())


def sgd(p):
    return torch.optim.SGD(p, lr=0.1)


# ----------------------------------------------------------------------------- the reference vs HF
@pytest.mark.parametrize("kind, kv, tied", [("qwen2", 2, False), ("llama", 3, True)])
def test_reference_without_delay_is_hf_backprop(kind, kv, tied):
    """delay=False: the reference over HF's modules (rotary per block, GQA, the head tied or not) is
    HF's own forward and backward: losses and weights after 3 SGD steps equal HF's."""
    from ouroboros_oracle import OuroborosReference

    model, steps = model_for(kind, kv, tied), data(n=3)
    want_losses, _, want = hf_train(model, [[b] for b in steps], lr=0.1)
    ref = OuroborosReference(copy.deepcopy(model).train(), 3, sgd, delay=False)
    assert (ref.model.lm_head.weight is ref.model.model.embed_tokens.weight) == tied
    got = [ref.step(ids, labels) for ids, labels in steps]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want_losses), atol=1e-6, rtol=1e-5)
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_reference_k2_two_iterations_by_hand():
    """K=2, SGD, untied Qwen2 with GQA: iteration 0 updates G_1 (block 1, norm, lm_head) only;
    iteration 1 updates G_1 with f_1's gradient and G_0 (embedding, block 0) by replaying x_0 with
    the weights w^1 against the stale delta_0^0 = df_0/dh_1 taken at w^0 — all with HF's autograd."""
    from ouroboros_oracle import OuroborosReference

    lr, model = 0.1, model_for("qwen2", 2, False, n_layer=2)
    (x0, y0), (x1, y1) = data(n=2)
    names = [n for n, _ in model.named_parameters()]
    g0 = [n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    g1 = [n for n in names if n not in g0]

    def grads(m, ids, labels, wrt, delta=None):
        """HF forward; (loss, {name: df/dp}, df/dh_1), or with ``delta`` the replay (dh_1/dp)^T delta."""
        params = dict(m.named_parameters())
        out = m(input_ids=ids, labels=labels, output_hidden_states=True)
        h1 = out.hidden_states[1]  # the input of block 1 = G_0's output
        if delta is not None:
            return dict(zip(wrt, torch.autograd.grad(h1, [params[n] for n in wrt], grad_outputs=delta)))
        g = torch.autograd.grad(out.loss, [params[n] for n in wrt] + [h1])
        return out.loss.item(), dict(zip(wrt, g[:-1])), g[-1]

    hand = copy.deepcopy(model)
    f0, g, delta00 = grads(hand, x0, y0, g1)
    with torch.no_grad():
        for n, p in hand.named_parameters():
            if n in g1:
                p -= lr * g[n]
    f1, g, _ = grads(hand, x1, y1, g1)
    replay = grads(hand, x0, None, g0, delta=delta00)
    with torch.no_grad():
        for n, p in hand.named_parameters():
            p -= lr * (g[n] if n in g1 else replay[n])

    ref = OuroborosReference(model, 2, lambda p: torch.optim.SGD(p, lr=lr), split=[range(0, 1), range(1, 2)])
    assert abs(ref.step(x0, y0) - f0) < 1e-6 and ref.backward_samples == [None, 0]
    assert abs(ref.step(x1, y1) - f1) < 1e-6 and ref.backward_samples == [0, 1]
    for n, p in ref.model.named_parameters():
        torch.testing.assert_close(p.detach(), dict(hand.named_parameters())[n].detach(), atol=1e-6, rtol=1e-5, msg=n)


# ----------------------------------------------------------------------------- the engine vs the reference
def test_ring_layout_follows_the_family_table(ring):
    """Ring rank 0 holds the embedding, G_0's and G_{K-1}'s blocks, the norm and the head; rank 1
    G_1's blocks (the family's balanced split: the head outweighs a block, so G_0 is the embedding)."""
    assert ring[0]["qwen2_k3"]["layers"] == ["embed_tokens", "layers.2", "norm", "lm_head", "layers.0", "layers.1"]
    assert ring[0]["llama_k3_adam"]["layers"][:5] == ["embed_tokens", "layers.0", "layers.2", "norm", "lm_head"]


@pytest.mark.parametrize("name", ["qwen2_k3", "llama_k3_adam", "qwen2_k2_tp2"])
def test_ring_equals_reference(ring, name):
    """K-1 ranks (K=2 with TP=2: both ranks hold G_0 and G_1, each its TP half) reproduce the
    reference over HF's modules: every iteration's loss and every final weight, fp32."""
    (kind, kv, tied), cfg = JOBS[name]
    adam = cfg["optimizer"]["type"] == "Adam"
    make = (lambda p: torch.optim.Adam(p, lr=0.01, eps=EPS)) if adam else sgd  # ADAM_ATOL: well-conditioned
    K = cfg["ds_mp"]["pipeline"]["stages"] + 1
    split = cfg["ds_mp"]["ouroboros"].get("split")
    losses, weights = reference(model_for(kind, kv, tied), K, make, data(), split=split)
    for r in ring:
        assert_same(r[name], losses, weights, weight_atol=ADAM_ATOL if adam else 1e-6)


def test_no_delay_is_hf_backprop(ring):
    """delay=False on the ring (deltas used within the iteration) is HF's Mistral with SGD."""
    want_losses, _, want = hf_train(model_for("mistral", 2, True), [[b] for b in data()], lr=0.1)
    assert_same(ring[0]["mistral_k3_no_delay"], want_losses, want)


def test_bf16_within_tolerance(ring):
    """bf16 (DeepSpeed's BF16_Optimizer, fp32 masters) against the fp32 reference: every loss within
    BF16_RTOL (measured max relative difference in the assertion message)."""
    losses, _ = reference(model_for("qwen2", 2, False), 3, sgd, data())
    got = ring[0]["qwen2_k3_bf16"]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, losses))
    assert rel < BF16_RTOL, (rel, got, losses)


def test_resume_equals_uninterrupted(ring):
    """Saved after 2 iterations with stashed inputs and deltas in flight (layout-free weights from
    the ring order of the Llama table), resumed in a fresh engine: the same losses and weights."""
    for r in ring:
        res = r["llama_k3_resume"]
        assert res["tail"] == res["losses"][2:]
        for name, p in res["weights"].items():
            assert torch.equal(res["resumed"][name], p), name

