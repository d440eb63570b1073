"""Checks every model family gets, against the unmodified HF model on one process (fp32 unless
named), each taking ``make(**kw)``, a tiny HF ``…ForCausalLM`` of the family (tests/helpers.py
``tiny_qwen3``, ``tiny_gemma3``): :func:`run_family` (every layout and schedule of :data:`LAYOUTS`,
one spawn per world size, DP replicas on their own rows; q/k norm copies over TP and DP; the ``save_hf``
export), :func:`lora_equals_peft`,
:func:`trainer_equals_plain_trainer`, :func:`sft_equals_plain_trl`, :func:`round_trip`,
:func:`resume_then_generate`, :func:`ring_equals_reference` (Ouroboros) and
:func:`inline_shape_draws_hf_init`.  tests/test_qwen3.py and tests/test_gemma3.py run them.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config
from test_llama import BF16_TOL, CLIP, LR, SEQ, TOL, VOCAB, steps_for
from test_tensor_parallel import gather_weights, hf_train, max_diff

# (name, tp, pp, schedule, model kwargs, ds_mp extras) per world size; DP = world / (TP · PP)
LAYOUTS: dict[int, list[tuple]] = {
    2: [("tp2_zero1", 2, 1, "1f1b", {}, {"zero": 1}),
        ("pp2_1f1b_ckpt", 1, 2, "1f1b", {"n_layer": 4},
         {"pipeline": {"partition": [1, 3], "activation_checkpoint_interval": 1}}),
        ("pp2_zbh1", 1, 2, "zb-h1", {"n_layer": 4}, {}),
        ("pp2_interleaved", 1, 2, "interleaved", {"n_layer": 4}, {"pipeline": {"virtual_stages": 2}}),
        ("pp2_terapipe", 1, 2, "terapipe", {}, {"terapipe": {"slices": [6, 10]}}),
        ("pp2_gpipe_zero2", 1, 2, "gpipe", {}, {"zero": 2}),
        ("pp2_zbv", 1, 2, "zb-v", {"n_layer": 4}, {}),
        ("tp2_bf16", 2, 1, "1f1b", {}, {"bf16": True})],  # losses within BF16_TOL of HF's fp32 ones
    3: [("tp3_kv_replicated", 3, 1, "1f1b", {"tied": True}, {})],
    4: [("tp2xpp2_sp", 2, 2, "1f1b", {"n_layer": 4}, {"tensor_parallel": {"sequence_parallel": True}}),
        ("tp2xpp2_zbh1", 2, 2, "zb-h1", {"n_layer": 4}, {}),  # the q/k norms' TP sum in the deferred W pass
        ("tp2_dp2_zero1", 2, 1, "1f1b", {}, {"zero": 1}),
        # Gemma: stage 0 ends on a sliding layer, stage 1 starts on a full one
        ("pp2_dp2_zbh1", 1, 2, "zb-h1", {"n_layer": 4}, {"pipeline": {"partition": [1, 3]}})],
}


EXPORTED = "tp2_zero1"  # the layout whose save_hf export is loaded back


def _gas(schedule: str) -> int:
    return 4 if schedule not in ("1f1b", "gpipe") else 2


def _steps(schedule: str, dp: int) -> list[list]:
    """Two steps of DP × GAS micro-batches, replica d taking the d-th GAS of them (its own rows): test_llama's
    (3 prompt labels of the first row ignored) and, under DP, the last replica's last micro-batch right-padded
    (6 pad ids, their labels ignored), so the replicas count different targets.  HF trains on all of them."""
    steps = steps_for(micro_batches=_gas(schedule) * dp)
    for mbs in steps if dp > 1 else []:
        ids, labels = mbs[-1]
        ids[1, -6:], labels[1, -6:] = 0, -100
    return steps


def _norm_copies(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's own copy of every q/k norm weight, by HF name."""
    from ds_mp.models.pipeline import hf_param_name

    pipe = engine.module
    return {hf_param_name(n, pipe): p.detach().clone() for n, p in pipe.named_parameters()
            if n.endswith(("q_norm.weight", "k_norm.weight"))}


def _family_rank(rank: int, make: Callable, world: int, out: str) -> dict:
    import ds_mp

    res = {}
    for name, tp, pp, schedule, kw, extra in LAYOUTS[world]:
        gas, dp = _gas(schedule), world // (tp * pp)
        cfg = ds_config(tp=tp, pp=pp, micro=2, gas=gas, lr=LR, clip=CLIP, seq=SEQ, schedule=schedule, **extra)
        engine, *_ = ds_mp.initialize(model=make(**kw), config=cfg)
        topo = engine.topology
        assert topo.dp == dp, (name, topo.dp)
        mine = slice(topo.dp_rank * gas, (topo.dp_rank + 1) * gas)
        losses = [float(engine.train_batch(iter(mbs[mine]))) for mbs in _steps(schedule, dp)]
        res[name] = (losses, gather_weights(engine)[0], _norm_copies(engine), topo.pp_rank)
        if name == EXPORTED:
            ds_mp.save_hf(engine, f"{out}/{name}")
    return res


def run_family(make: Callable, world: int, out: str) -> None:
    """Every layout of ``LAYOUTS[world]`` trains ``make(**kw)`` as HF does on one process over the global
    batch (every DP replica's rows; per-token loss over all of its targets); the DP replicas of a stage
    hold bit-identical weights; q/k norm copies identical over TP and DP and equal to HF's; the TP2
    export loads with the trained logits."""
    from transformers import AutoModelForCausalLM

    results = run_ranks(_family_rank, world, make, world, out, timeout=600)
    for name, tp, pp, schedule, kw, _ in LAYOUTS[world]:
        dp = world // (tp * pp)
        model = make(**kw)
        want_losses, _, want = hf_train(model, _steps(schedule, dp), lr=LR, clip=CLIP)
        bf16, got, stage = "bf16" in name, {}, {}
        for losses, weights, _, pp_rank in (r[name] for r in results):
            got.update(weights)
            first = stage.setdefault(pp_rank, weights)  # every TP and DP rank of a stage: the same weights
            assert all(torch.equal(first[n], t) for n, t in weights.items()), f"{name}: stage {pp_rank}'s copies differ"
            if bf16:
                assert losses == pytest.approx(want_losses, rel=BF16_TOL), (name, losses, want_losses)
            else:
                assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (name, losses, want_losses)
        assert set(got) == set(want) and (bf16 or max_diff(got, want) < TOL), name
        copies: dict[str, list[torch.Tensor]] = {}
        for _, _, norms, _ in (r[name] for r in results):
            for n, t in norms.items():
                copies.setdefault(n, []).append(t)
        assert copies and all(len(c) == tp * dp for c in copies.values()), name  # every TP and DP rank: a copy
        for n, c in copies.items():
            assert all(torch.equal(c[0], t) for t in c[1:]), f"{name}: TP/DP copies of {n} differ"
            assert bf16 or float((c[0] - want[n]).abs().max()) < TOL and not torch.equal(want[n], model.state_dict()[n])
        if name == EXPORTED:
            trained = copy.deepcopy(model)
            trained.load_state_dict(want, strict=False)
            ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
            loaded = AutoModelForCausalLM.from_pretrained(f"{out}/{name}").eval()
            assert type(loaded) is type(model)
            with torch.no_grad():
                assert float((loaded(input_ids=ids).logits - trained.eval()(input_ids=ids).logits).abs().max()) < 1e-4


# --- LoRA against PEFT, and the Trainer path against the plain transformers.Trainer --------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "down_proj"]  # column, key/value (split at TP2) and row bases


def peft_of(make: Callable) -> Any:
    """PEFT's LoRA (r 4, alpha 8) on ``make()``, its B factors randomised (PEFT's B = 0 would leave A's
    first gradient zero)."""
    from peft import LoraConfig, get_peft_model

    from helpers import randomise_lora_b

    cfg = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return randomise_lora_b(get_peft_model(make(), cfg), 7)


def _lora_rank(rank: int, make: Callable, out: str) -> dict:
    from test_lora import train_and_export_lora

    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": LORA_TARGETS}
    return train_and_export_lora(peft_of(make), ds_config(tp=2, lr=0.05, seq=SEQ, lora=lora), steps_for(), out)


def lora_equals_peft(make: Callable, out: str) -> None:
    """At TP = 2: PEFT's losses, a frozen base, and the exported adapter (``PeftModel.from_pretrained``)
    and merged model (``from_pretrained``) giving the PEFT reference's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import hf_reference

    want, trained = hf_reference(peft_of(make), steps_for(), lr=0.05)
    results = run_ranks(_lora_rank, 2, make, out, timeout=600)
    assert all(r["frozen_grads"] == [] and r["frozen_in_opt"] == [] for r in results)
    assert results[0]["losses"] == pytest.approx(want, abs=2e-5)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = trained.eval()(input_ids=ids).logits
        assert (make()(input_ids=ids).logits - ref).abs().max() > 1e-3  # the adapter matters
        loaded = PeftModel.from_pretrained(make(), f"{out}/adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged").eval()
        assert (loaded(input_ids=ids).logits - ref).abs().max() < 1e-4
        assert (merged(input_ids=ids).logits - ref).abs().max() < 1e-4


def trainer_equals_plain_trainer(make: Callable, out: str) -> None:
    """``ds_mp.hf.Trainer`` at TP = 2 on a checkpoint directory: tests/test_hf_trainer.py's run (5 AdamW
    steps, warm-up, clipping, padded rows with masked prompts, eval, save) equals the plain Trainer's:
    losses, grad norms, LRs and eval loss as there; the saved weights to 1e-5 except where Adam
    (eps 1e-6) divides rounding noise: an embedding row read only where no loss depends on it (a
    row's last token, padding) has an exactly zero true gradient, and each implementation's ~1e-12 of
    noise moves it by up to ~lr · 1e-3 per step (measured 2.2e-5 on one Qwen3 element; every other
    weight within 2e-6), so the weights get 1e-4."""
    from transformers import AutoModelForCausalLM

    from test_hf_trainer import _ds_mp_rank, assert_same_run, ds_json, plain_run

    model_dir = f"{out}/model"
    make(vocab=203).save_pretrained(model_dir)  # test_hf_trainer's rows draw ids below 203
    got = run_ranks(_ds_mp_rank, 2, model_dir, f"{out}/ds_mp", ds_json(tp=2), 5, timeout=600)[0]
    ref = plain_run(model_dir, f"{out}/plain", 2)
    model = got.pop("model")  # trainer.model after train(): compared below, at the weights' tolerance
    assert_same_run({**got, "dir": ref["dir"]}, ref)  # logs and eval loss (the weights: below)
    a = AutoModelForCausalLM.from_pretrained(got["dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(ref["dir"]).state_dict()
    assert a.keys() == b.keys() and type(AutoModelForCausalLM.from_pretrained(got["dir"])) is type(make())
    assert model.keys() >= b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4, msg=k)
        torch.testing.assert_close(model[k], b[k], rtol=0, atol=1e-4, msg=f"trainer.model: {k}")


# --- checkpoints: HF ⇄ sharded, resume at another layout, generate() after save_hf ---------------
def round_trip(make: Callable, out: str) -> None:
    """HF -> sharded at TP=3 × PP=2 (2 KV heads replicated) -> sharded at TP=2 × PP=1 (split) -> HF:
    every tensor bit-exact and ``from_pretrained`` gives the source's logits (``--verify-logits`` both ways)."""
    from ds_mp.checkpoint import ds_to_hf, hf_to_ds

    model = make(n_layer=3)
    model.save_pretrained(f"{out}/hf")
    hf_to_ds(f"{out}/hf", f"{out}/ds3x2", tp=3, pp=2, verify_logits=True)
    hf_to_ds(f"{out}/ds3x2", f"{out}/ds2x1", tp=2, pp=1)
    ds_to_hf(f"{out}/ds2x1", f"{out}/back", verify_logits=True)
    back = type(model).from_pretrained(f"{out}/back").eval()
    want = model.state_dict()
    assert back.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[n]) for n, t in back.state_dict().items())
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def resume_then_generate(make: Callable, out: str) -> None:
    """From a save_pretrained directory: 1 SGD-momentum step at TP=2 × PP=2, checkpoint; resume at TP=2 ×
    PP=1, 1 more step, save_hf: HF's uninterrupted losses, its trained weights, and its greedy generate()."""
    from test_llama_checkpoint import _train_rank, hf_sgd

    from helpers import batches

    model = make(n_layer=4)
    model.save_pretrained(f"{out}/base")
    steps = [batches(2, 2, SEQ, VOCAB, seed=40 + i) for i in range(2)]
    want, trained = hf_sgd(model, steps)
    root, exported_dir = f"{out}/ckpt", f"{out}/hf"
    first = run_ranks(_train_rank, 4, f"{out}/base", 2, 2, steps[:1], root, True, False, None, timeout=600)
    second = run_ranks(_train_rank, 2, f"{out}/base", 2, 1, steps[1:], root, False, True, exported_dir, timeout=600)
    assert first[0] + second[0] == pytest.approx(want, abs=2e-5)
    exported = type(model).from_pretrained(exported_dir).eval()
    for name, t in trained.state_dict().items():
        assert (exported.state_dict()[name] - t).abs().max() < 2e-5, name
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(exported.generate(prompt, **kw), trained.generate(prompt, **kw))


# --- Ouroboros: the ring against the single-process reference cut from HF's model -----------------
def _ring_rank(rank: int, make: Callable) -> dict:
    from test_ouroboros_llama import data, llama_cfg, train

    return {"delayed": train(rank, make(n_layer=3), llama_cfg(3), data()),
            "no_delay": train(rank, make(n_layer=3), llama_cfg(3, delay=False, split=[1, 1, 1]), data())}


def ring_equals_reference(make: Callable) -> None:
    """K = 3 modules on 2 ranks (SGD): with delay, every loss and weight of the reference over HF's own
    modules (tests/ouroboros_hf_modules.py's cut of the family); without, HF's backprop."""
    from test_ouroboros import assert_same
    from test_ouroboros_llama import data, reference, sgd

    ring = run_ranks(_ring_rank, 2, make, timeout=600)
    losses, weights = reference(make(n_layer=3), 3, sgd, data())
    want_losses, _, want = hf_train(make(n_layer=3), [[b] for b in data()], lr=0.1)
    for r in ring:
        assert_same(r["delayed"], losses, weights)
        assert_same(r["no_delay"], want_losses, want)


# --- an inline shape: fresh weights by the family's init, layout-free ----------------------------
def inline_shape_draws_hf_init(model_type: str, cls_name: str) -> None:
    """``"model": {"model_type": ..., ...}`` without a checkpoint: the drawn weights have exactly HF's
    names and shapes, HF's init for norms (Qwen3: 1; Gemma's (1 + w): 0) and the first eval loss of
    HF's model loaded with them."""
    import transformers

    import ds_mp
    from ds_mp.checkpoint.hf import full_state_dict

    shape = {"model_type": model_type, "n_layer": 2, "n_embd": 96, "n_head": 6, "n_kv_head": 2,
             "intermediate_size": 192, "vocab_size": VOCAB, "n_positions": 64}
    engine, *_ = ds_mp.initialize(config=ds_config(micro=2, gas=1, seq=SEQ, model=shape))
    got = full_state_dict(engine)
    hf = getattr(transformers, cls_name)(engine.hf_config).eval()
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in hf.state_dict().items()
                                                            if n in got}
    norm = 0.0 if model_type.startswith("gemma") else 1.0
    assert all(float(t.min()) == float(t.max()) == norm for n, t in got.items() if n.endswith("norm.weight"))
    hf.load_state_dict(got, strict=False)
    mbs = steps_for(n_steps=1, micro_batches=1)[0]
    with torch.no_grad():
        want = float(hf(input_ids=mbs[0][0], labels=mbs[0][1]).loss)
    assert abs(float(engine.eval_batch(iter(mbs))) - want) < 1e-5


# --- TRL: packed chats with a chat template through ds_mp.hf.SFTTrainer vs plain trl.SFTTrainer ---
def sft_equals_plain_trl(make: Callable, out: str) -> None:
    """launch/trl_sft.py on a ``save_pretrained`` directory of ``make`` (with the script's ChatML tokenizer):
    packing (padding-free, position_ids), assistant-only loss, SGD, clipping; ds_mp at TP = 2 logs the
    losses and eval loss of plain TRL on one process and saves its weights (tests/test_hf_sft.py's check)."""
    from test_hf_sft import ARGS, _run, compare, ds_json, saved, trl_sft_script

    tokenizer = trl_sft_script().tiny_tokenizer()
    model_dir = f"{out}/model"
    make(vocab=len(tokenizer), n_layer=2).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    argv = ARGS + ["--model_name_or_path", model_dir]
    ref = run_ranks(_run, 1, argv + ["--output_dir", f"{out}/plain"], True, timeout=600)[0]
    cfg = ds_json(f"{out}/ds.json", 2, 1)
    res = run_ranks(_run, 2, argv + ["--output_dir", f"{out}/ds_mp", "--deepspeed", cfg], False, timeout=900)[0]
    compare((ref, saved(f"{out}/plain")), res, saved(f"{out}/ds_mp"), "TP2")
