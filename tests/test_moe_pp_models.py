"""Qwen3-MoE and Mixtral across pipeline stages against the unmodified HF model on one process (fp32).

A 4-layer tiny MoE (Qwen3-MoE: layer 1 dense by ``mlp_only_layers``; routers scaled so every token's
k-th and (k+1)-th router logits differ by more than ``test_moe.MARGIN``, asserted on HF's logits of every
micro-batch) with ``output_router_logits`` on: HF's loss is its LM loss + coef · aux, its aux pooled
over every sparse layer of the micro-batch, masked by the attention mask.  The step's oracle is
``Σ_i lm_i · c_i / N + coef · aux_i / (M · dp)`` (the engine's ``aux_reduction = "mean"``, TRL's
SFTTrainer) over the step's micro-batches of every replica.  Losses, pre-clip gradient norms and every
weight after 3 SGD steps (clipping on) within 1e-5 relative, at PP=2 under 1F1B, ZB-H1, interleaved
(v = 2) and ZB-V (a stage boundary between sparse layers in every layout), with activation
checkpointing, GPipe with ZeRO-2 (bf16 under ZB-H1: losses within 1e-2 of HF's fp32), PEFT's LoRA on attention under ZB-H1, TP=2 × PP=2 in both expert layouts, PP=2 × DP=2 (each replica its own rows), padded
rows (attention_mask) and packed documents (position_ids, no mask: HF counts every token); the first
micro-batch's routing equals HF's token by token on every stage.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config, targets
from test_moe import MARGIN, SEQ, VOCAB
from test_tensor_parallel import gather_weights

LR, CLIP, COEF, RTOL = 0.1, 1.0, 0.3, 1e-5
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
BF16_RTOL = 1e-2  # bf16 losses against HF's fp32 (relative)
ROUTER_SCALE = 30.0  # the routers × this: logits a few units apart (margins asserted)


def ranks_agree(out: list, want_losses: list, want_norms: list, name: str) -> tuple[dict, dict]:
    """Every rank's (losses, grad norms) of :func:`_rank` are HF's (RTOL); returns the ranks' weights and routes
    merged by name and layer."""
    got, routes = {}, {}
    for losses, norms, weights, seen in out:
        assert losses == pytest.approx(want_losses, rel=RTOL), name
        assert norms == pytest.approx(want_norms, rel=RTOL), name
        got.update(weights)
        routes.update(seen)
    return got, routes


def tiny_moe4(model_type: str = "qwen3_moe", seed: int = 0, vocab: int = VOCAB, aux: bool = True, layers: int = 4,
              experts: int = 8) -> Any:
    """``layers`` layers (Qwen3-MoE's and Qwen2-MoE's layer 1 dense), ``experts`` experts of width 32, top-2, hidden
    64; routers × ROUTER_SCALE.  Mixtral: every layer sparse, top-k always renormalised; Qwen2-MoE: not
    renormalised, with a shared expert and its sigmoid gate beside the routed experts."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=0, rms_norm_eps=1e-5, num_experts_per_tok=2, output_router_logits=aux,
                  router_aux_loss_coef=COEF)
    if model_type == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=32,
                                                                           num_local_experts=experts))
    elif model_type == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=experts, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=experts, decoder_sparse_step=1,
            mlp_only_layers=[1], norm_topk_prob=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return model.eval()


def steps(micro: int, n: int = 3, seed: int = 11, packed: bool = False) -> list[list[dict]]:
    """``n`` steps of ``micro`` micro-batches of 2 rows × SEQ: some labels ignored; every other micro-batch
    right-padded (a padding mask of uneven lengths) or, ``packed``, two documents per row (position_ids)."""
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        step = []
        for i in range(micro):
            ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
            mb = {"input_ids": ids, "labels": ids.clone()}
            mb["labels"][0, :3] = -100
            if packed:  # as DataCollatorWithFlattening: each document's first label ignored
                cut = [5, 9]
                mb["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(SEQ - c)]) for c in cut])
                mb["labels"][:, 0] = -100
                mb["labels"][0, cut[0]], mb["labels"][1, cut[1]] = -100, -100
            elif i % 2:
                mask = torch.ones_like(ids)
                mask[1, -5:], mask[0, -2:] = 0, 0
                mb["attention_mask"], mb["labels"][mask == 0] = mask, -100
            step.append(mb)
        out.append(step)
    return out


def hf_micro_batch(model: Any, mb: dict, gates: list) -> tuple[torch.Tensor, torch.Tensor, list]:
    """HF's LM loss, aux loss and router logits (per sparse layer) of one micro-batch.  Packed documents
    (``position_ids``, no mask): attention inside each document (a block-diagonal 4-D mask, equal to each
    document alone within 3e-7) and the aux loss over every token (``load_balancing_loss_func`` without a
    mask, as HF computes it for a padding-free batch), the router logits read by hooks on the gates."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = model.config
    E = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    if "position_ids" not in mb:  # (the router logits asked for also with the aux loss off; HF then adds it)
        out = model(**mb, output_router_logits=True)
        return out.loss - COEF * out.aux_loss, out.aux_loss, list(out.router_logits)
    pos = mb["position_ids"]
    docs, T = torch.cumsum((pos == 0).long(), 1), pos.shape[1]
    mask = (torch.ones(T, T, dtype=torch.bool).tril()[None] & (docs[:, :, None] == docs[:, None, :]))[:, None]
    gates.clear()
    out = model(input_ids=mb["input_ids"], labels=mb["labels"], position_ids=pos, attention_mask=mask,
                output_router_logits=False)
    return out.loss, load_balancing_loss_func(tuple(gates), E, cfg.num_experts_per_tok, None), list(gates)


def hf_oracle(model: Any, data: list[list[dict]]) -> tuple[list[float], list[float], dict, list]:
    """HF on one process, ``aux_reduction = "mean"`` (module docstring); the routing margins asserted."""
    model = copy.deepcopy(model).train()
    gates: list = []
    for name, gate in model.named_modules():  # (a PEFT model's too)
        if name.endswith("mlp.gate"):
            gate.register_forward_hook(lambda _m, _i, out: gates.append(out[0] if isinstance(out, tuple) else out))
    opt, losses, norms, k = torch.optim.SGD(model.parameters(), lr=LR), [], [], model.config.num_experts_per_tok
    first_routes = None
    for mbs in data:
        opt.zero_grad()
        count, total = sum(targets(mb["labels"]) for mb in mbs), 0.0
        for mb in mbs:
            lm, aux, router_logits = hf_micro_batch(model, mb, gates)
            for layer in router_logits:
                top = layer.detach().float().topk(k + 1, dim=-1).values
                assert float((top[:, k - 1] - top[:, k]).min()) > MARGIN, "routing margin too small"
            if first_routes is None:
                first_routes = [l.detach().float().topk(k, dim=-1).indices.sort(-1).values for l in router_logits]
            loss = lm * (targets(mb["labels"]) / count) + COEF * aux / len(mbs) * model.config.output_router_logits
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, first_routes


def _rank(rank: int, model: Any, data: list[list[dict]], cfg: dict) -> tuple:
    import ds_mp
    from ds_mp.models.moe.layers import SparseMLP

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    assert (engine.module.carry is not None) == model.config.output_router_logits
    routes: dict[int, torch.Tensor] = {}  # sparse layer -> its first call's top-k experts (the first micro-batch)

    def record(i: int, k: int, out: torch.Tensor) -> None:
        routes.setdefault(i, out.detach().float().topk(k, dim=-1).indices.sort(-1).values)

    for blk in engine.module.blocks():
        if isinstance(blk.mlp, SparseMLP):
            blk.mlp.gate.register_forward_hook(lambda _m, _i, out, i=blk.index, k=blk.mlp.k: record(i, k, out))
    losses, norms, gas, d = [], [], cfg["gradient_accumulation_steps"], engine.topology.dp_rank
    for mbs in data:
        losses.append(float(engine.train_batch(iter(mbs[d * gas:(d + 1) * gas]))))
        norms.append(float(engine.get_global_grad_norm()))  # ds_mp's own (fp32) or ZeRO's
    return losses, norms, gather_weights(engine)[0], (routes if d == 0 else {})


CASES = {
    "qwen3_1f1b": dict(),
    "qwen3_1f1b_aux_off": dict(aux=False),  # nothing carried: the hidden state alone crosses the stages
    "qwen3_zb-h1_ckpt": dict(schedule="zb-h1", checkpoint=1),
    "qwen3_interleaved": dict(schedule="interleaved", virtual_stages=2),
    "qwen3_zb-v": dict(schedule="zb-v"),
    "qwen3_1f1b_ckpt_packed": dict(checkpoint=2, packed=True),
    "qwen3_tp2_pp2_whole": dict(tp=2, expert_layout="whole"),
    "qwen3_tp2_pp2_split_zb-h1": dict(tp=2, expert_layout="split", schedule="zb-h1"),
    "qwen3_pp2_dp2": dict(dp=2),
    "qwen3_gpipe_zero2": dict(schedule="gpipe", zero=2),  # ZeRO-2 reduces the gradients per backward
    "qwen3_zb-h1_bf16": dict(schedule="zb-h1", bf16=True),  # losses within BF16_RTOL of HF's fp32
    "qwen3_zb-h1_lora": dict(schedule="zb-h1", lora=True, seed=13),  # PEFT's LoRA on attention: losses, norms, routing
    "mixtral_1f1b": dict(model_type="mixtral"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_aux_loss_across_stages_equals_hf(name: str) -> None:
    case = dict(CASES[name])
    tp, dp, gas = case.pop("tp", 1), case.pop("dp", 1), 2
    model = tiny_moe4(case.pop("model_type", "qwen3_moe"), aux=case.pop("aux", True))
    lora = case.pop("lora", False)
    if lora:  # PEFT's LoRA on q/k/v/o (router and experts frozen), B drawn so A trains from the first step
        from peft import LoraConfig, get_peft_model

        from helpers import randomise_lora_b

        model = randomise_lora_b(get_peft_model(model, LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0,
                                                                  target_modules=LORA_TARGETS)), 7)
    packed = case.pop("packed", False)
    data = steps(gas * dp, packed=packed, seed=case.pop("seed", 12 if packed else 11))  # margins pass
    want_losses, want_norms, want, want_routes = hf_oracle(model, data)
    virtual = case.pop("virtual_stages", 1)
    cfg = ds_config(tp=tp, pp=2, micro=2, gas=gas, lr=LR, clip=CLIP, seq=SEQ, schedule=case.pop("schedule", "1f1b"),
                    zero=case.pop("zero", 0), bf16=case.get("bf16", False),
                    **({"lora": {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": LORA_TARGETS}} if lora else {}),
                    moe={"expert_layout": case.pop("expert_layout", "whole")},
                    pipeline={"virtual_stages": virtual, "activation_checkpoint_interval": case.pop("checkpoint", 0)})
    out = run_ranks(_rank, tp * 2 * dp, model, data, cfg, timeout=600)
    if case.pop("bf16", False):  # bf16 weights and activations (the carry stays fp32): the losses only
        assert out[0][0] == pytest.approx(want_losses, rel=BF16_RTOL), name
        return
    got, routes = ranks_agree(out, want_losses, want_norms, name)
    if not lora:  # (LoRA: the factors' names are PEFT's; losses and norms above hold their training)
        assert set(got) == set(want)
    for n, w in want.items() if not lora else ():
        assert float((got[n] - w).abs().max()) <= RTOL * float(w.abs().max()), (name, n)
    sparse = [i for i in range(4) if not (model.config.model_type == "qwen3_moe" and i == 1)]
    assert sorted(routes) == sparse  # every sparse layer on some stage, routed as HF routes the first micro-batch
    for j, i in enumerate(sparse):
        assert torch.equal(routes[i], want_routes[j]), (name, i)
