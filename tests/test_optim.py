"""ds_mp.optim: LAMB against hand maths, GPT-2 init
statistics, and the lr range test on a quadratic."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from ds_mp.optim import Lamb, init_gpt2_weights, lr_find, param_groups_no_decay


def tiny_gpt2(n_layer: int = 2, n_embd: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=101, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


# ----------------------------------------------------------------------------- LAMB
def test_lamb_two_steps_match_hand_maths():
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.01
    dt = torch.float64
    w_big0 = torch.tensor([100.0, -100.0, 100.0, 100.0], dtype=dt)   # ||w|| = 200 -> r clipped
    w_small0 = torch.tensor([0.1, -0.2, 0.3], dtype=dt)               # r well below 10
    w_zero0 = torch.zeros(3, dtype=dt)                                 # ||w|| = 0 -> r = 1
    grads = {  # g at step 1, g at step 2
        "big": (torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=dt), torch.tensor([-1.0, 0.5, 2.0, 1.0], dtype=dt)),
        "small": (torch.tensor([0.3, -0.1, 0.2], dtype=dt), torch.tensor([0.1, 0.4, -0.2], dtype=dt)),
        "zero": (torch.tensor([1.0, -2.0, 0.5], dtype=dt), torch.tensor([0.5, 0.5, -1.0], dtype=dt)),
    }
    params = {k: torch.nn.Parameter(w.clone()) for k, w in
              {"big": w_big0, "small": w_small0, "zero": w_zero0}.items()}
    opt = Lamb([{"params": [params["big"], params["small"]], "weight_decay": wd},
                {"params": [params["zero"]], "weight_decay": 0.0}],
               lr=lr, betas=(b1, b2), eps=eps)
    ratios = {}
    for step in range(2):
        for k, p in params.items():
            p.grad = grads[k][step].clone()
        opt.step()
        ratios[step] = {k: float(opt.state[p]["last_trust_ratio"]) for k, p in params.items()}

    def hand(w0, g1, g2, wd_):
        # step 1: m1 = (1-b1) g1, v1 = (1-b2) g1^2; bias-corrected m_hat = g1, v_hat = g1^2
        m1, v1 = (1 - b1) * g1, (1 - b2) * g1 * g1
        u1 = (m1 / (1 - b1)) / ((v1 / (1 - b2)).sqrt() + eps) + wd_ * w0
        r1_raw = w0.norm() / u1.norm() if w0.norm() > 0 else torch.tensor(1.0, dtype=dt)
        r1 = r1_raw.clamp(0, 10)
        w1 = w0 - lr * r1 * u1
        # step 2: m2 = b1 m1 + (1-b1) g2, v2 = b2 v1 + (1-b2) g2^2, corrections 1 - beta^2
        m2, v2 = b1 * m1 + (1 - b1) * g2, b2 * v1 + (1 - b2) * g2 * g2
        u2 = (m2 / (1 - b1 ** 2)) / ((v2 / (1 - b2 ** 2)).sqrt() + eps) + wd_ * w1
        r2_raw = w1.norm() / u2.norm()
        r2 = r2_raw.clamp(0, 10)
        w2 = w1 - lr * r2 * u2
        return w2, float(r1_raw), float(r1), float(r2)

    big, big_r1_raw, big_r1, big_r2 = hand(w_big0, *grads["big"], wd)
    small, small_r1_raw, small_r1, small_r2 = hand(w_small0, *grads["small"], wd)
    zero, _, zero_r1, zero_r2 = hand(w_zero0, *grads["zero"], 0.0)
    assert big_r1_raw > 10 and big_r1 == 10.0                  # clipping triggered
    assert small_r1_raw < 10 and small_r1 == pytest.approx(small_r1_raw)
    assert zero_r1 == 1.0                                      # ||w|| = 0 -> r = 1
    torch.testing.assert_close(params["big"].data, big, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params["small"].data, small, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params["zero"].data, zero, rtol=1e-12, atol=1e-12)
    assert ratios[0]["big"] == 10.0 and ratios[1]["big"] == pytest.approx(big_r2)
    assert ratios[0]["small"] == pytest.approx(small_r1) and ratios[1]["small"] == pytest.approx(small_r2)
    assert ratios[0]["zero"] == 1.0 and ratios[1]["zero"] == pytest.approx(zero_r2)


def test_lamb_max_trust_configurable_and_zero_update():
    p = torch.nn.Parameter(torch.full((4,), 50.0))
    opt = Lamb([p], lr=0.1, max_trust=2.0)
    p.grad = torch.ones(4)
    opt.step()                                    # u = 1 per element, r = min(100/2, 2) = 2
    torch.testing.assert_close(p.data, torch.full((4,), 50.0 - 0.1 * 2.0 * 1.0), rtol=0, atol=1e-5)
    q = torch.nn.Parameter(torch.ones(3))
    opt = Lamb([q], lr=0.1)
    q.grad = torch.zeros(3)
    opt.step()                                    # ||u|| = 0 -> r = 1, no movement
    assert float(opt.state[q]["last_trust_ratio"]) == 1.0
    torch.testing.assert_close(q.data, torch.ones(3))


def test_param_groups_no_decay_on_gpt2():
    model = tiny_gpt2()
    groups = param_groups_no_decay(model, 0.01)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "transformer.ln_f.weight" in no_decay_names
    assert "transformer.h.0.attn.c_attn.bias" in no_decay_names
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    Lamb(groups, lr=1e-3)  # accepted as param groups


# ----------------------------------------------------------------------------- init
def test_init_gpt2_weights_statistics():
    torch.manual_seed(0)
    n_layer = 3
    model = tiny_gpt2(n_layer=n_layer, n_embd=256)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)                             # make sure everything is overwritten
    plan = init_gpt2_weights(model, n_layer=n_layer, std=0.02)
    params = dict(model.named_parameters())
    res_std = 0.02 / math.sqrt(2 * n_layer)
    checks = {
        "transformer.h.1.mlp.c_fc.weight": 0.02,      # 256 x 1024
        "transformer.h.1.attn.c_attn.weight": 0.02,   # 256 x 768
        "transformer.wte.weight": 0.02,               # 101 x 256, tied to lm_head
        "transformer.h.1.mlp.c_proj.weight": res_std,  # 1024 x 256
        "transformer.h.2.attn.c_proj.weight": res_std,  # 256 x 256
    }
    for name, std in checks.items():
        w = params[name]
        assert abs(w.std().item() - std) < 0.05 * std, name
        assert abs(w.mean().item()) < 0.05 * std, name
    assert plan["transformer.h.0.attn.c_proj.weight"] == "normal(std/sqrt(2L))"
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, p in params.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln_" in name:
            assert torch.all(p == 1.0), name
        else:
            assert p.abs().max() < 0.2, name          # nothing left at 3.0


# ----------------------------------------------------------------------------- lr_find
def test_lr_find_quadratic(tmp_path):
    w = torch.ones(10, dtype=torch.float64)

    def step_fn(lr: float) -> float:       # SGD on 0.5 ||w||^2: w <- (1 - lr) w, diverges for lr > 2
        nonlocal w
        loss = 0.5 * float(w @ w)
        w = w - lr * w
        return loss

    res = lr_find(step_fn, lr_min=1e-3, lr_max=1e2, num_steps=100)
    assert res.diverged and len(res.lrs) < 100
    assert res.lrs[-1] > 2.0                               # stopped only after lr passed 2
    assert res.smoothed[-1] > 4 * min(res.smoothed[:-1])
    assert 1e-3 <= res.suggested_lr < 2.0                  # in the stable region
    assert 1e-4 <= res.min_div10_lr <= 1e1
    assert res.lrs[0] == pytest.approx(1e-3) and res.lrs[1] == pytest.approx(1e-3 * 1e5 ** (1 / 99))
    # bias-corrected smoothing: the first smoothed value is the first loss
    assert res.smoothed[0] == pytest.approx(res.losses[0])
    res.save_csv(tmp_path / "lr.csv")
    res.plot(tmp_path / "lr.png")
    rows = list(csv.reader(open(tmp_path / "lr.csv")))
    assert rows[0] == ["step", "lr", "loss", "smoothed_loss"] and len(rows) == len(res.lrs) + 1
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_find_no_divergence_runs_all_steps():
    res = lr_find(lambda lr: 1.0 / (1.0 + lr), 1e-2, 1.0, num_steps=20)
    assert not res.diverged and len(res.lrs) == 20
    assert res.lrs[-1] == pytest.approx(1.0)
    assert 1e-2 <= res.suggested_lr <= 1.0
