"""Mixture-of-experts families (``qwen3_moe``, ``mixtral``, ``qwen2_moe``) against the unmodified HF model
on one process (fp32, SGD with clipping).

Routing margins: the tiny models' routers are scaled (:func:`tiny_moe`'s ``router_scale``, 10) so their
logits spread over a few units, and every test that compares routing first asserts, on HF's own router
logits, that every token's k-th and (k+1)-th largest logit (equivalently log-probability) differ by more
than :data:`MARGIN` (1e-3, three orders above the ~1e-6 by which two fp32 implementations' logits of this
size differ): a top-k choice then cannot flip between them, so "the same experts token by token" is a
property of the implementation, not of luck.  (A margin in probabilities would not do: with a dominant
expert the 2nd and 3rd probabilities are both small and close although their logits are far apart.)

* :func:`test_layouts_train_as_hf`: TP1, TP2 ``split`` and TP2 ``whole``, aux loss on and off (Mixtral and
  Qwen2-MoE: two of the TP2 rows), ZeRO-1, sequence parallelism, a model with a dense layer
  (``mlp_only_layers``), rows with a masked prompt and right padding: losses, pre-clip grad norms and weights
  after 3 steps within 1e-5 relative of HF's, and the first micro-batch's top-k experts per sparse layer equal
  HF's token by token; :func:`test_experts_without_tokens`: micro-batches that leave experts without a token;
* checkpoints: the Hub's per-expert directory (what ``save_pretrained`` writes) and a fused one (transformers
  5's in-memory names) both train as HF, each shard reading only its elements; ``save_hf`` loads in
  ``from_pretrained`` with the trained logits and generates; a TP2 ``whole`` training checkpoint resumes at
  TP1 and at TP2 ``split``;
* LoRA on attention equals PEFT; the tables equal HF's state dicts; refusals in one line
  (``router_jitter_noise``, E not divisible by TP for ``whole``, an unknown layout, a dense MLP name in
  ``lora.target_modules``; LoRA on the experts: tests/test_moe_lora.py).

The HF oracle (:func:`hf_train`) weighs each micro-batch's aux loss as ds_mp's default ``aux_reduction``
("mean", TRL's): ``coef · aux / M`` per micro-batch.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config, targets
from test_tensor_parallel import gather_weights

VOCAB, SEQ, LR, CLIP = 1003, 16, 0.1, 1.0
MARGIN = 1e-3  # the smallest gap between a token's k-th and (k+1)-th router logit the tests accept
RTOL = 1e-5


def tiny_moe(model_type: str = "qwen3_moe", seed: int = 0, router_scale: float = 10.0, aux: bool = False,
             **config: Any) -> Any:
    """A tiny HF mixture of experts: hidden 64, 4 heads (2 KV) of head_dim 16, 8 experts of width 32, top-2,
    3 layers; Qwen3-MoE's layer 1 dense (``mlp_only_layers``, width 96); routers scaled by ``router_scale``
    (clear routing margins: module docstring); ``aux``: ``output_router_logits`` with coef 0.3."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=0, rms_norm_eps=1e-5, num_experts_per_tok=2, output_router_logits=aux,
                  router_aux_loss_coef=0.3)
    if model_type == "mixtral":
        cfg = transformers.MixtralConfig(**common, head_dim=16, intermediate_size=32, num_local_experts=8, **config)
        cls = transformers.MixtralForCausalLM
    else:
        extra = dict(head_dim=16) if model_type == "qwen3_moe" else dict(shared_expert_intermediate_size=48)
        cfg_cls = transformers.Qwen3MoeConfig if model_type == "qwen3_moe" else transformers.Qwen2MoeConfig
        cfg = cfg_cls(**common, **extra, intermediate_size=96, moe_intermediate_size=32, decoder_sparse_step=1,
                      **{"num_experts": 8, "mlp_only_layers": [1], "norm_topk_prob": True, **config})
        cls = transformers.Qwen3MoeForCausalLM if model_type == "qwen3_moe" else transformers.Qwen2MoeForCausalLM
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_scale)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def steps(n: int = 3, seed: int = 7) -> list[list]:
    """``n`` steps of two micro-batches of 2 rows × :data:`SEQ`, some labels ignored, the second micro-batch's
    second row right-padded (5 pad ids, labels ignored)."""
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        step = []
        for _ in range(2):
            ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
            step.append((ids, ids.clone()))
        step[0][1][0, :3] = -100
        step[1][0][1, -5:], step[1][1][1, -5:] = 0, -100
        out.append(step)
    return out


def hf_train(model: Any, data: list, lr: float = LR, clip: float = CLIP,
             momentum: float = 0.0) -> tuple[list[float], list[float], Any]:
    """HF on one process over each step's micro-batches, trained in place with SGD: per micro-batch its LM
    loss weighted by its share of the step's targets plus ``router_aux_loss_coef`` · its aux loss / M (the
    mean over the step's M micro-batches: TRL's ``SFTTrainer``, and ds_mp's ``aux_reduction = "mean"``);
    per step the loss and the pre-clip gradient norm.  Returns (losses, norms, model)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    coef = model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0
    losses, norms = [], []
    for micro_batches in data:
        opt.zero_grad()
        total, count = 0.0, sum(targets(labels) for _, labels in micro_batches)
        for ids, labels in micro_batches:
            out = model(input_ids=ids, labels=labels)
            lm = out.loss - coef * out.aux_loss if coef else out.loss
            loss = lm * (targets(labels) / count) + (coef * out.aux_loss / len(micro_batches) if coef else 0.0)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip > 0 else 0.0)
        opt.step()
        losses.append(total)
    return losses, norms, model


def hf_topk(model: Any, ids: torch.Tensor, k: int) -> list[torch.Tensor]:
    """HF's top-k experts per sparse layer (N, k), after asserting every token's routing margin > MARGIN."""
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    out = []
    for layer in logits:
        top = layer.float().topk(k + 1, dim=-1).values
        assert float((top[:, k - 1] - top[:, k]).min()) > MARGIN, "routing margin too small: rescale the router"
        out.append(layer.float().topk(k, dim=-1).indices.sort(dim=-1).values)
    return out


# --- training against HF: TP1, TP2 split and whole, aux loss on and off ---------------------------------
OTHER_ROWS = ("tp2_split_aux", "tp2_whole_aux_zero1")  # Mixtral's and Qwen2-MoE's (every row: Qwen3-MoE's)
# (name, TP, expert layout, aux loss, DeepSpeed extras)
LAYOUTS = [("tp1", 1, "whole", False, {}), ("tp1_aux_zero1", 1, "whole", True, {"zero": 1}),
           ("tp2_split_aux", 2, "split", True, {}), ("tp2_whole", 2, "whole", False, {}),
           ("tp2_whole_aux_zero1", 2, "whole", True, {"zero": 1}), ("tp2_split", 2, "split", False, {}),
           ("tp2_whole_sp", 2, "whole", False, {"tensor_parallel": {"sequence_parallel": True}})]


def _routes(engine: Any) -> tuple[list, int]:
    """A forward hook on every router of this stage: the (N, k) experts it picks, appended per call; and
    the number of routers (a micro-batch's first that many entries are its routes)."""
    from ds_mp.models.moe.layers import SparseMLP

    seen: list = []
    routers = [m for m in engine.module.modules() if isinstance(m, SparseMLP)]
    for m in routers:
        m.gate.register_forward_hook(
            lambda mod, inp, out, k=m.k: seen.append(out.detach().float().topk(k, dim=-1).indices.sort(-1).values))
    return seen, len(routers)


def _train_rank(rank: int, model_type: str, layouts: list, data: list, model_kw: dict) -> dict:
    import ds_mp

    out = {}
    for name, tp, layout, aux, extra in layouts:
        rows, seq = data[0][0][0].shape
        cfg = ds_config(tp=tp, micro=rows, gas=len(data[0]), lr=LR, clip=CLIP, seq=seq, moe={"expert_layout": layout},
                        **extra)
        engine, *_ = ds_mp.initialize(model=tiny_moe(model_type, aux=aux, **model_kw), config=cfg)
        seen, n_routers = _routes(engine)
        losses, norms = [], []
        for mbs in data:
            losses.append(float(engine.train_batch(iter(mbs))))
            norms.append(float(engine.get_global_grad_norm()))
        out[name] = (losses, norms, gather_weights(engine)[0], seen[:n_routers])  # the first micro-batch's routes
    return out


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert all(abs(a - b) <= RTOL * abs(b) + 1e-7 for a, b in zip(got, want)), (what, got, want)


@pytest.mark.parametrize("model_type,world", [("qwen3_moe", 1), ("qwen3_moe", 2), ("mixtral", 2), ("qwen2_moe", 2)])
def test_layouts_train_as_hf(model_type: str, world: int) -> None:
    """Every layout of :data:`LAYOUTS` at TP = ``world`` (ZeRO-1 in two of them, sequence parallelism without
    the aux loss in one) trains as HF on one process: 3 SGD steps with
    clipping, losses and pre-clip grad norms within 1e-5 relative, every weight within 1e-5 of its
    tensor's largest entry; the first micro-batch's routing equals HF's token by token (margins
    asserted); with the aux loss on, HF's loss differs from its loss without it (the term is live)."""
    layouts = [row for row in LAYOUTS if row[1] == world and (model_type == "qwen3_moe" or row[0] in OTHER_ROWS)]
    _assert_layouts_train_as_hf(model_type, world, layouts, steps())


def _assert_layouts_train_as_hf(model_type: str, world: int, layouts: list, data: list, **model_kw: Any) -> None:
    results = run_ranks(_train_rank, world, model_type, layouts, data, model_kw, timeout=600)
    for name, tp, layout, aux, _ in layouts:
        model = tiny_moe(model_type, aux=aux, **model_kw)
        want_topk = hf_topk(model, data[0][0][0], model.config.num_experts_per_tok)
        want_losses, want_norms, trained = hf_train(copy.deepcopy(model).train(), data)
        want = dict(trained.named_parameters())
        got: dict = {}
        for losses, norms, weights, seen in (r[name] for r in results):
            _assert_close(losses, want_losses, f"{name} losses")
            _assert_close(norms, want_norms, f"{name} grad norms")
            assert len(seen) == len(want_topk) and all(torch.equal(a, b) for a, b in zip(seen, want_topk)), name
            got.update(weights)
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for n, w in want.items():
            scale = float(w.detach().abs().max())
            assert float((got[n] - w.detach()).abs().max()) <= RTOL * scale, (name, n)
        if aux:
            no_aux, _, _ = hf_train(tiny_moe(model_type, **model_kw).train(), data[:1])
            assert abs(no_aux[0] - want_losses[0]) > 1e-3, name


def test_mixtral_sliding_window() -> None:
    """Mixtral's ``sliding_window`` (5 keys of 16, applied by HF whenever set) at TP2 ``whole``, aux on: as HF."""
    _assert_layouts_train_as_hf("mixtral", 2, [("tp2_whole_window", 2, "whole", True, {})], steps(n=2), sliding_window=5)


def test_experts_without_tokens() -> None:
    """Micro-batches of 1 row × 3 tokens: 6 top-2 assignments over 8 experts, so in every sparse layer some
    expert (under ``whole``, possibly all of one rank's) receives no token (asserted on HF's routing): TP2 in
    both layouts, aux loss on, still trains as HF (the idle experts' gradients are zero, not missing)."""
    g = torch.Generator().manual_seed(11)
    data = [[(ids, ids.clone()) for ids in torch.randint(1, VOCAB, (2, 1, 3), generator=g)] for _ in range(2)]
    model = tiny_moe(aux=True)
    for ids, _ in data[0]:
        for top in hf_topk(model, ids, 2):
            assert top.unique().numel() < 8
    _assert_layouts_train_as_hf("qwen3_moe", 2, [("tp2_whole_idle", 2, "whole", True, {}),
                                                 ("tp2_split_idle", 2, "split", True, {})], data)


# --- checkpoints: the Hub's per-expert keys and transformers 5's fused tensors, in and out --------------
def _fused_dir(model: Any, path: str) -> str:
    """``model`` written with its state dict's own (fused) names, as transformers 5 holds them in memory."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{path}/model.safetensors")
    return path


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_reader_fuses_per_expert_keys_reading_only_the_shard(model_type: str, tmp_path: Any) -> None:
    """``save_pretrained`` writes the Hub's per-expert keys (checked); the reader serves the fused tensors
    HF holds in memory, and each shard of both layouts reads exactly its own elements."""
    from safetensors import safe_open

    from ds_mp.checkpoint.hf import HFReader
    from ds_mp.tensor_parallel.sharding import shard

    model = tiny_moe(model_type)
    model.save_pretrained(tmp_path / "hub")
    with safe_open(str(tmp_path / "hub" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("gate_up_proj") for k in f.keys()) and any(".experts.7." in k for k in f.keys())
    sd = model.state_dict()
    for path in (tmp_path / "hub", _fused_dir(model, str(tmp_path / "fused"))):
        reader = HFReader(str(path))
        for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
            assert torch.equal(reader.get(name), sd[name])
            kinds = ("experts", "experts_down" if name.endswith("down_proj") else "experts_gate_up")
            for kind in kinds:
                for r in range(2):
                    before = reader.elements_read[0]
                    got = reader.get_shard(name, kind, r, 2)
                    assert torch.equal(got, shard(sd[name], kind, r, 2)), (path, name, kind, r)
                    assert reader.elements_read[0] - before == got.numel(), (path, name, kind)


def _checkpoint_rank(rank: int, path: str, layout: str, out: str) -> dict:
    import ds_mp

    cfg = ds_config(tp=2, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, moe={"expert_layout": layout})
    engine, *_ = ds_mp.initialize(model=path, config=cfg)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps(n=2)]
    ds_mp.save_hf(engine, out)
    return {"losses": losses}


@pytest.mark.parametrize("model_type,hub", [("qwen3_moe", True), ("mixtral", False)])
def test_checkpoint_in_and_out(model_type: str, hub: bool, tmp_path: Any) -> None:
    """TP2 ``split`` from a Hub per-expert directory (Qwen3-MoE) and TP2 ``whole`` from a fused one (Mixtral),
    aux loss on, train as HF; ``save_hf`` loads in ``from_pretrained`` with the trained model's logits, and
    ``generate`` runs."""
    from transformers import AutoModelForCausalLM

    model = tiny_moe(model_type, aux=True)
    model.save_pretrained(tmp_path / "hub")
    want, _, trained = hf_train(copy.deepcopy(model).train(), steps(n=2))
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = trained.eval()(input_ids=ids).logits
    for src, layout in ([(str(tmp_path / "hub"), "split")] if hub else
                        [(_fused_dir(model, str(tmp_path / "fused")), "whole")]):
        out = str(tmp_path / f"out_{layout}")
        got = run_ranks(_checkpoint_rank, 2, src, layout, out, timeout=600)
        _assert_close(got[0]["losses"], want, layout)
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(loaded) is type(model)
        with torch.no_grad():
            assert float((loaded(input_ids=ids).logits - ref).abs().max()) < 1e-4, layout
        assert loaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


# --- tables and refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_tables_cover_hf_models(model_type: str) -> None:
    """``param_shapes`` is exactly HF's state dict (experts fused, Qwen3-MoE's dense layer 1, Qwen2-MoE's
    shared expert); every name has a TP kind and a pipeline layer."""
    from ds_mp.models.family import family_of

    model = tiny_moe(model_type)
    fam, cfg = family_of(model.config), model.config
    assert fam.name == "moe"
    assert fam.param_shapes(cfg) == {n: tuple(t.shape) for n, t in model.state_dict().items()}
    layers = fam.pipeline_layers(cfg)
    for name in fam.param_shapes(cfg):
        fam.tp_kind(name)
        assert 0 <= fam.layer_index(name, layers) < len(layers)
    assert ("model.layers.1.mlp.gate_proj.weight" in model.state_dict()) == (model_type != "mixtral")


def test_unbuilt_options_are_refused_in_one_line() -> None:
    from ds_mp.config import ConfigError, load_config

    def refused(raw: dict, match: str, tp: int = 1, **extra: Any) -> None:
        with pytest.raises(ConfigError, match=match) as e:
            load_config(ds_config(tp=tp, **extra), tp, raw)
        assert "\n" not in str(e.value)

    inline = {"model_type": "qwen3_moe", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "n_positions": 32}
    with pytest.raises(ConfigError, match=r"^ds_mp.model: an inline qwen3_moe shape has no experts"):
        load_config(ds_config(model=inline), 1)
    mixtral = tiny_moe("mixtral").config.to_dict()
    refused({**mixtral, "router_jitter_noise": 0.1}, r"^ds_mp.model: mixtral option router_jitter_noise=0.1 .*set it 0")
    qwen = tiny_moe(num_experts=6).config.to_dict()
    refused(qwen, r"^ds_mp.moe.expert_layout: \"whole\" needs tensor_parallel.size=4 to divide the 6 experts; use "
            r"\"split\"", tp=4)
    refused(qwen, r"^ds_mp.moe.expert_layout: 'rows' is not a layout", moe={"expert_layout": "rows"})
    refused(qwen, r"^ds_mp.lora.target_modules", lora={"r": 4, "target_modules": ["gate_proj"]})
    load_config(ds_config(tp=2, moe={"expert_layout": "split"}), 2, tiny_moe(num_experts=6).config.to_dict())


# --- LoRA on attention against PEFT -----------------------------------------------------------------------
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft_moe() -> Any:
    from peft import LoraConfig, get_peft_model

    from helpers import randomise_lora_b

    cfg = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=ATTENTION, task_type="CAUSAL_LM")
    return randomise_lora_b(get_peft_model(tiny_moe(aux=True), cfg), 7)


def _lora_rank(rank: int, out: str) -> dict:
    from test_lora import train_and_export_lora

    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ATTENTION}
    return train_and_export_lora(_peft_moe(), ds_config(tp=2, lr=0.05, seq=SEQ, lora=lora), steps(n=2), out)


def test_lora_on_attention_equals_peft(tmp_path: Any) -> None:
    """PEFT's LoRA on q/k/v/o of a Qwen3-MoE (aux loss on, the router and experts frozen) at TP2 whole: PEFT's
    losses, a frozen base, and the exported adapter loading in ``PeftModel`` with PEFT's trained logits."""
    from peft import PeftModel

    want, _, trained = hf_train(_peft_moe().train(), steps(n=2), lr=0.05, clip=0.0)
    got = run_ranks(_lora_rank, 2, str(tmp_path), timeout=600)
    assert all(r["frozen_grads"] == [] and r["frozen_in_opt"] == [] for r in got)
    _assert_close(got[0]["losses"], want, "lora")
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = trained.eval()(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(tiny_moe(aux=True), str(tmp_path / "adapter")).eval()
        assert float((loaded(input_ids=ids).logits - ref).abs().max()) < 1e-4


# --- resume at another layout -----------------------------------------------------------------------------
def _resume_rank(rank: int, path: str, tp: int, layout: str, data: list, root: str, resume: bool) -> list[float]:
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    cfg = ds_config(tp=tp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, moe={"expert_layout": layout})
    cfg["optimizer"]["params"]["momentum"] = 0.9
    engine, *_ = ds_mp.initialize(model=path, config=cfg)
    if resume:
        load_checkpoint(engine, root)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in data]
    if not resume:
        save_checkpoint(engine, root, "step2")
    return losses


def test_resume_at_another_expert_layout(tmp_path: Any) -> None:
    """2 SGD-momentum steps at TP2 ``whole`` (aux loss on), checkpoint; resumed at TP1 and at TP2 ``split``
    (the experts' weights and momenta re-cut along another dim), 1 more step each: HF's uninterrupted losses."""
    model = tiny_moe(aux=True)
    model.save_pretrained(tmp_path / "base")
    data, base, root = steps(n=3), str(tmp_path / "base"), str(tmp_path / "ckpt")
    want, _, _ = hf_train(copy.deepcopy(model).train(), data, momentum=0.9)
    first = run_ranks(_resume_rank, 2, base, 2, "whole", data[:2], root, False, timeout=600)[0]
    _assert_close(first, want[:2], "before the checkpoint")
    for tp, layout in ((1, "whole"), (2, "split")):
        again = run_ranks(_resume_rank, tp, base, tp, layout, data[2:], root, True, timeout=600)[0]
        _assert_close(again, want[2:], f"resumed at TP{tp} {layout}")


def test_convert_round_trip(tmp_path: Any) -> None:
    """``ds-mp convert``: the Hub's per-expert Mixtral directory -> sharded TP2 × PP2 -> HF, each step checked
    tensor by tensor and by logits against ``from_pretrained``; the result loads with the original's weights."""
    from transformers import AutoModelForCausalLM

    from ds_mp.checkpoint.convert import ds_to_hf, hf_to_ds

    model = tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "hub")
    hf_to_ds(str(tmp_path / "hub"), str(tmp_path / "ds"), tp=2, pp=2, verify_logits=True)
    ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "back"), verify_logits=True)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())
