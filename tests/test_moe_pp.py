"""The carry (``ds_mp.models.carry``) across pipeline stages, against HF on one process.

A dense GPT-2 whose blocks are given a synthetic router (a forward hook: the block output's first E
channels × 3 as gate logits, softmax, top-k) reports router statistics exactly as a MoE layer does
(``add_router_stats``); the config asks for the aux loss (``output_router_logits``).  The oracle is
the unmodified HF model on one process with the same hook collecting each block's gate logits,
and transformers' own ``load_balancing_loss_func`` pooling them over every layer of the micro-batch
(with its attention mask), each forward's ``coef · aux`` averaged over the step's micro-batches as TRL's
SFTTrainer averages it (the engine's ``aux_reduction = "mean"``) or summed as HF's Trainer sums it
(``"sum"``), the LM part per token over the step.
The synthetic gate logits are a per-position permutation of 0 … E−1 plus a small multiple of the
hidden state, so no two of a token's logits are within rounding of each other (checked: the
oracle's smallest top-k margin) while the probabilities still carry the hidden state's gradient.

Losses, pre-clip gradient norms and every weight after 3 SGD steps within 1e-5 at DP=2 with each replica
its own rows (padded rows, the mask as HF masks; uneven target counts) and the "sum" reduction.  (The
carry was built on this test before the MoE families existed; it ran PP=2 under every schedule too,
which tests/test_moe_pp_models.py now covers with the real Qwen3-MoE and Mixtral.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config, targets, tiny_gpt2
from test_tensor_parallel import gather_weights, max_diff

E, K, COEF = 4, 2, 2.0  # experts, top-k, router_aux_loss_coef
GAP, SCALE = 0.5, 2.0  # a gate logit: GAP × a rank by position and layer + SCALE × the hidden state
SEQ, VOCAB, TOL = 16, 203, 1e-5


def moe_like_gpt2() -> torch.nn.Module:
    model = tiny_gpt2(n_layer=4, vocab=VOCAB)
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, COEF
    model.config.num_experts, model.config.num_experts_per_tok = E, K
    return model


def gate_logits(h: torch.Tensor, layer: int) -> torch.Tensor:
    """Block ``layer``'s gate logits of each token: GAP × a permutation of 0 … E-1 by its position,
    with expert ``layer`` mod E lifted to the top (so each layer routes differently and the pooled
    counts depend on which layers are pooled), plus ``SCALE`` × its hidden state's first E channels
    (the probabilities' gradient)."""
    T = h.shape[1]
    t, e = torch.arange(T)[:, None], torch.arange(E)[None, :]
    ranks = (t * 3 + e * (1 + 2 * (t % 2))) % E + E * (e == layer % E)
    return (h[..., :E] * SCALE + GAP * ranks.to(h.dtype)).reshape(-1, E).float()


def ds_router_hook(ctx, layer: int):
    from ds_mp.models.carry import add_router_stats

    def hook(_module, _inputs, out):
        probs = torch.softmax(gate_logits(out, layer), dim=-1)
        add_router_stats(ctx, probs, torch.topk(probs, K, dim=-1).indices)
    return hook


def steps(n: int = 3, gas: int = 4, seed: int = 5, padded: bool = False) -> list[list[dict]]:
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        mbs = []
        for i in range(gas):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            labels, mask = ids.clone(), torch.ones_like(ids)
            if padded and i % 2 == 0:  # right padding of uneven length, not targets
                mask[0, SEQ - 5:], mask[1, SEQ - 2:] = 0, 0
                labels[mask == 0] = -100
            mbs.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
        out.append(mbs)
    return out


def hf_oracle(model, data: list[list[dict]], lr: float, clip: float,
              reduction: str = "mean") -> tuple[list[float], list[float], dict, float]:
    """HF on one process: per micro-batch ``lm · t_i / N + w · coef · load_balancing_loss_func(...)``
    (transformers' pooling over the layers), w = 1 ("sum": HF's Trainer) or 1 / the step's micro-batches
    ("mean": TRL's SFTTrainer); returns losses, pre-clip norms, weights, the smallest top-k margin."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = copy.deepcopy(model).train()
    logits: list[torch.Tensor] = []
    for i, blk in enumerate(model.transformer.h):
        blk.register_forward_hook(lambda _m, _i, out, i=i: logits.append(gate_logits(out, i)))
    opt, losses, norms, margin = torch.optim.SGD(model.parameters(), lr=lr), [], [], float("inf")
    for mbs in data:
        opt.zero_grad()
        count, total = sum(targets(mb["labels"]) for mb in mbs), 0.0
        for mb in mbs:
            logits.clear()
            lm = model(input_ids=mb["input_ids"], labels=mb["labels"], attention_mask=mb["attention_mask"]).loss
            aux = load_balancing_loss_func(tuple(logits), E, K, mb["attention_mask"])
            loss = lm * (targets(mb["labels"]) / count) + COEF * aux / (1 if reduction == "sum" else len(mbs))
            loss.backward()
            total += float(loss.detach())
            top = torch.topk(torch.cat(logits), K + 1, dim=-1).values
            margin = min(margin, float((top[:, K - 1] - top[:, K]).min().detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, margin


def _engine_rank(rank: int, model, data: list[list[dict]], cfg: dict, reduction: str) -> tuple:
    """Train on this replica's share of each step (replica d: micro-batches d·gas … (d+1)·gas − 1)."""
    import ds_mp

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    engine.use_aux_reduction(reduction)
    assert engine.module.carry is not None
    for blk in engine.module.blocks():
        blk.register_forward_hook(ds_router_hook(engine.module.ds_mp_ctx, blk.index))
    losses, norms, gas, d = [], [], cfg["gradient_accumulation_steps"], engine.topology.dp_rank
    for mbs in data:
        losses.append(float(engine.train_batch(iter(mbs[d * gas:(d + 1) * gas]))))
        norms.append(engine.last_grad_norm)
    weights, _ = gather_weights(engine)
    return losses, norms, weights


CASES = {  # the schedules, checkpointing, TP and packing with a real MoE: tests/test_moe_pp_models.py
    "pp1_dp2_padded_sum": dict(schedule="1f1b", pp=1, dp=2, padded=True, reduction="sum"),  # own rows per replica
}


@pytest.mark.parametrize("name", list(CASES))
def test_aux_loss_pooled_across_stages_equals_hf(name: str) -> None:
    case = dict(CASES[name])
    lr, clip, gas = 0.1, 0.5, 4
    tp, pp, dp, reduction = case.pop("tp", 1), case.pop("pp", 2), case.pop("dp", 1), case.pop("reduction", "mean")
    data = steps(gas=gas * dp, padded=case.pop("padded", False))
    model = moe_like_gpt2()
    ref_losses, ref_norms, ref_w, margin = hf_oracle(model, data, lr, clip, reduction)
    assert margin > 1e-3, f"a near-tie in the synthetic router's top-{K}: {margin}"
    ckpt, virtual = case.pop("checkpoint", 0), case.pop("virtual_stages", 1)
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=gas, lr=lr, clip=clip, seq=SEQ, schedule=case["schedule"],
                    pipeline={"virtual_stages": virtual, "activation_checkpoint_interval": ckpt})
    out = run_ranks(_engine_rank, tp * pp * dp, model, data, cfg, reduction, timeout=300)
    losses, norms, _ = out[0]
    weights = {name: w for _, _, ws in out for name, w in ws.items()}
    assert losses == pytest.approx(ref_losses, rel=TOL)
    assert norms == pytest.approx(ref_norms, rel=TOL)
    assert max_diff(ref_w, weights) < TOL


@pytest.mark.parametrize("schedule, extra, key", [
    ("terapipe", {}, "output_router_logits: the MoE aux loss"),
    ("ouroboros", {"ouroboros": {"modules": 3}}, "output_router_logits: the ouroboros schedule"),
    ("1f1b", {"tensor_parallel": {"size": 2, "sequence_parallel": True}}, "ds_mp.tensor_parallel.sequence_parallel"),
])
def test_aux_loss_refused_where_nothing_carries_it(schedule: str, extra: dict, key: str) -> None:
    from ds_mp.config.checks import load_config
    from ds_mp.config.schema import ConfigError

    hf = moe_like_gpt2().config.to_dict()
    cfg = ds_config(pp=2, seq=SEQ, schedule=schedule, **extra)
    world = 2 * cfg["ds_mp"]["tensor_parallel"]["size"]
    with pytest.raises(ConfigError) as err:
        load_config(cfg, world, hf_config=hf)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)
    hf["output_router_logits"] = False  # the same run without the aux loss is accepted
    load_config(cfg, world, hf_config=hf)


@pytest.mark.parametrize("extra, key", [
    ({"context_parallel": {"size": 2}}, "ds_mp.context_parallel: the MoE aux loss"),
    ({"loss": {"type": "moe_toy"}}, "ds_mp.loss.type: the MoE aux loss"),
])
def test_aux_loss_refused_where_its_pooling_is_not_built(extra: dict, key: str) -> None:
    """Context parallelism splits a row's tokens over its ranks (each would pool only its shard's router
    statistics), and a loss other than the LM and DPO losses (a user's registered spec) has no aux term:
    one line each, accepted without it.  (DPO with the aux term: tests/test_moe_dpo.py.)"""
    import dataclasses

    from ds_mp.config.checks import load_config
    from ds_mp.config.losses import LOSSES, register_loss
    from ds_mp.config.schema import ConfigError
    from ds_mp.losses.lm import LM_LOSS

    register_loss("moe_toy", dataclasses.replace(LM_LOSS, name="moe_toy"))
    try:
        _refused_and_accepted(extra, key)
    finally:
        LOSSES.pop("moe_toy")
    hf = moe_like_gpt2().config.to_dict()
    with pytest.raises(ConfigError, match=r"^ds_mp.loss.normalization: the MoE aux loss"):
        load_config(ds_config(pp=2, seq=SEQ, loss={"type": "dpo"}), 2, hf_config=hf)
    cfg = ds_config(pp=2, seq=SEQ, loss={"type": "dpo", "normalization": "micro_batch"})
    load_config(cfg, 2, hf_config=hf)  # the DPO loss adds the aux term as TRL does


def _refused_and_accepted(extra: dict, key: str) -> None:
    from ds_mp.config.checks import load_config
    from ds_mp.config.schema import ConfigError

    hf = moe_like_gpt2().config.to_dict()
    cfg = ds_config(pp=2, seq=SEQ, **extra)
    world = 2 * cfg["ds_mp"].get("context_parallel", {}).get("size", 1)
    with pytest.raises(ConfigError) as err:
        load_config(cfg, world, hf_config=hf)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)
    hf["output_router_logits"] = False
    load_config(cfg, world, hf_config=hf)
