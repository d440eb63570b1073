"""``ds_mp.hf.DPOTrainer`` on a mixture of experts against the plain ``trl.DPOTrainer`` on one process.

TRL 1.16 adds the MoE load-balancing loss to the DPO loss whenever the model's config has
``output_router_logits`` (whatever its value) and the effective coefficient (``DPOConfig.router_aux_loss_coef``,
else the config's ``router_aux_loss_coef``) is non-zero: by default for a Qwen3-MoE.  The tiny Qwen3-MoE
here (``tests/test_moe_pp_models.tiny_moe4``: 8 experts top-2, layer 1 dense; the tokenizer's vocabulary;
``output_router_logits=False`` as Hub configs say) is trained by the same script as ``tests/test_hf_dpo.py``
(uneven pairs, padding, one cut at ``max_length``) and compared the same way: logged losses 1e-5
relative, rewards/logps metrics, evaluation metrics, saved weights (state dicts of
``AutoModelForCausalLM.from_pretrained``: TRL saves HF's per-expert keys, ds_mp may save the fused ones).
Cases: TRL's default coefficient at PP2 (1F1B: the carry crosses the stages), TP2 (whole experts) and
DP2 × GA2 (the oracle: TRL on two processes, DDP); ``router_aux_loss_coef=0.0`` on a config saying
``output_router_logits=True`` at TP2.  Each fails without its part of the fix (checked by hand: the
refusal, no carry override, the "sum" reduction, no eval term).  Step 1's ``rewards/accuracies`` is not
compared: policy = reference, each pair's margin is 0 up to roundoff and its sign noise.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from test_hf_dpo import _run, close, ds_json

COEF = 0.1  # the config's router_aux_loss_coef: large enough that the aux term moves the loss


def moe_dir(root: str, flag: bool = False) -> str:
    """The tiny Qwen3-MoE (config coef :data:`COEF`, ``output_router_logits`` ``flag``: False as Hub
    configs say) and its tokenizer."""
    from test_hf_sft import trl_sft_script
    from test_moe_pp_models import tiny_moe4

    path = os.path.join(root, f"qwen3_moe_{flag}")
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = trl_sft_script().tiny_tokenizer()
        model = tiny_moe4(vocab=len(tok), aux=flag)
        model.config.router_aux_loss_coef = COEF
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def weights(out: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(out).state_dict().items()}


def compare(ref: tuple[dict, dict], res: dict, got_w: dict, where: str, aux: bool) -> None:
    from test_hf_dpo import METRICS, REL

    want, want_w = ref
    assert len(res["train"]) == len(want["train"]) == 5, (where, res["train"])
    names = (*METRICS, "aux_loss") if aux else METRICS
    for got, exp in zip(res["train"], want["train"]):
        assert close(got["loss"], exp["loss"], abs_=0), f"{where}: loss {got['loss']} vs {exp['loss']}"
        for k in names:
            if k == "rewards/accuracies" and exp["rewards/margins"] == 0.0:
                continue  # step 1, policy = reference: each pair's margin is 0 up to roundoff, its sign noise
            assert close(got[k], exp[k], rel=REL if k.startswith("logps") or k == "aux_loss" else 0), \
                f"{where}: {k} {got[k]} vs {exp[k]}"
    for k in ("loss", *names):
        g, e = res["eval"][f"eval_{k}"], want["eval"][f"eval_{k}"]
        assert close(g, e, rel=REL if k in ("loss", "aux_loss") or k.startswith("logps") else 0), \
            f"{where}: eval_{k} {g} vs {e}"
    assert set(got_w) == set(want_w), where
    worst = max(float((got_w[k] - v).abs().max()) for k, v in want_w.items())
    assert worst <= 1e-5, f"{where}: saved weights differ by {worst}"


_ORACLE: dict[str, tuple[dict, dict]] = {}


def oracle(root: str, model: str, **kw: Any) -> tuple[dict, dict]:
    """The plain TRL run (one process, no DeepSpeed), once per argument set: its history and weights."""
    key = repr(sorted(kw.items()))
    if key not in _ORACLE:
        out = os.path.join(root, f"plain{len(_ORACLE)}")
        res = run_ranks(_run, 1, model, out, True, {**kw, "use_cpu": True}, timeout=600)[0]
        _ORACLE[key] = (res, weights(out))
    return _ORACLE[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> str:
    return str(tmp_path_factory.mktemp("moe_dpo"))


@pytest.mark.timeout(900)
def test_coef_zero_trains_without_the_aux_loss_as_trl(tmp_path: Any, root: str) -> None:
    """``router_aux_loss_coef=0.0`` at TP2 (whole experts), on a config saying ``output_router_logits=True``:
    TRL adds no aux term (its loss is its own, from the log-probs), nor does ds_mp (it builds no carry)."""
    model = moe_dir(root, flag=True)
    kw = {"router_aux_loss_coef": 0.0}
    ref = oracle(root, model, **kw)
    assert "aux_loss" not in ref[0]["train"][0]
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), 2, 1)
    res = run_ranks(_run, 2, model, out, False, {"deepspeed": cfg, **kw}, timeout=600)[0]
    compare(ref, res, weights(out), "TP2 coef 0", aux=False)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)], ids=["pp2-1f1b", "tp2"])
def test_default_coef_adds_the_aux_loss_as_trl(tmp_path: Any, root: str, tp: int, pp: int) -> None:
    """TRL's default coefficient (the config's, here 0.1) on a config with ``output_router_logits=False``:
    TRL adds ``coef · aux`` (over each micro-batch's [chosen; rejected] forward, masked) to each
    micro-batch's DPO loss and logs ``aux_loss``; ds_mp's carry pools the same over every MoE layer, across
    the two stages at PP2 (1F1B), and its evaluation adds each eval step's term as TRL's does."""
    model = moe_dir(root)
    ref = oracle(root, model)
    first = ref[0]["train"][0]
    assert COEF * first["aux_loss"] > 1e-3 * first["loss"]  # the term is far above the tolerance
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), tp, pp)
    res = run_ranks(_run, tp * pp, model, out, False, {"deepspeed": cfg}, timeout=600)[0]
    compare(ref, res, weights(out), f"TP{tp} PP{pp} default coef", aux=True)


@pytest.mark.timeout(900)
def test_dp2_equals_trl_under_ddp(tmp_path: Any, root: str) -> None:
    """DP2 × GA2 (2 pairs per micro-batch, each replica its own pairs): the oracle is plain TRL on two
    processes (DDP over gloo): each replica's micro-batch aux is its own rows' (not pooled over
    replicas), averaged as DDP averages; every metric TRL gathers, eval included, and the weights."""
    model = moe_dir(root)
    want_out = str(tmp_path / "trl_ddp")
    want = run_ranks(_run, 2, model, want_out, True, {"use_cpu": True}, timeout=600)[0]
    out = str(tmp_path / "ds_mp")
    res = run_ranks(_run, 2, model, out, False, {"deepspeed": ds_json(str(tmp_path / "ds.json"), 1, 1)},
                    timeout=600)[0]
    compare((want, weights(want_out)), res, weights(out), "DP2 default coef", aux=True)


def test_trl_rule_for_the_aux_loss() -> None:
    """:func:`ds_mp.hf.dpo.router_aux` is TRL 1.16's rule (``DPOTrainer.__init__``): the DPOConfig's
    coefficient, else the config's; on when the config has ``output_router_logits`` (even False) and the
    coefficient is non-zero; a dense model never."""
    import transformers
    from trl import DPOConfig

    from ds_mp.hf.dpo import router_aux

    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, vocab_size=32))
    assert moe.config.output_router_logits is False and moe.config.router_aux_loss_coef == 0.001
    dense = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
        vocab_size=32))
    args = DPOConfig(output_dir="unused", report_to="none", bf16=False)
    assert args.router_aux_loss_coef is None
    assert router_aux(moe, args) == (0.001, True)
    assert router_aux(dense, args) == (0.0, False)
    args.router_aux_loss_coef = 0.0
    assert router_aux(moe, args) == (0.0, False)
    args.router_aux_loss_coef = 0.25
    assert router_aux(moe, args) == (0.25, True)
