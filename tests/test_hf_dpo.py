"""``ds_mp.hf.DPOTrainer`` against the plain ``trl.DPOTrainer`` on one process (the outside oracle).

The same script (:func:`main`: a tiny GPT-2 or Qwen2 saved to a directory, a byte-level BPE tokenizer,
preference pairs of uneven lengths: one pair of a 1-word chosen against a 40-word rejected completion,
one whose prompt + completion is cut at ``max_length``) on one process without ds_mp or DeepSpeed
(fp32, dropout 0) and through ds_mp at several layouts gives the same logged ``loss`` (1e-5 relative),
the same ``rewards/*`` and ``logps/*`` (1e-5 absolute... relative for the log-prob sums, which are
O(50)), the same ``evaluate()`` metrics and the same saved weights after 5 optimizer steps.  TRL's
reference is a second copy of the model (full fine-tune) or the model with its adapter disabled
(LoRA); ds_mp's is the initial weights precomputed, or its LoRA path switched off per step.  SGD
keeps the weight comparison well-conditioned (Adam turns last-bit differences into ±lr steps).
"""
from __future__ import annotations

import math
import os
import random
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from test_hf_sft import trl_sft_script

REL, ABS = 1e-5, 1e-5
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
BASE = {"bf16": False, "max_steps": 5, "logging_steps": 1, "report_to": "none", "max_length": 48,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "per_device_eval_batch_size": 4,
        "eval_strategy": "steps", "eval_steps": 5, "save_strategy": "no", "optim": "sgd", "learning_rate": 0.5,
        "seed": 0, "disable_tqdm": True}


def pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` preference records (TRL's plain prompt / chosen / rejected) of uneven lengths; record 1
    pairs a 1-word chosen with a 40-word rejected completion, record 3's prompt + chosen pass 48
    tokens (cut at ``max_length``)."""
    script, rng = trl_sft_script(), random.Random(seed)
    out = [{"prompt": script.sentence(rng, rng.randint(2, 10)), "chosen": " " + script.sentence(rng, rng.randint(1, 14)),
            "rejected": " " + script.sentence(rng, rng.randint(1, 14))} for _ in range(n)]
    out[1]["chosen"], out[1]["rejected"] = " " + script.sentence(rng, 1), " " + script.sentence(rng, 40)
    out[3]["prompt"], out[3]["chosen"] = script.sentence(rng, 20), " " + script.sentence(rng, 40)
    return out


def model_dir(root: str, kind: str) -> str:
    """A tiny ``kind`` model and its tokenizer saved under ``root`` (TRL loads its reference from the path)."""
    script = trl_sft_script()
    path = os.path.join(root, kind)
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = script.tiny_tokenizer()
        script.tiny_model(kind, len(tok)).save_pretrained(path)
        tok.save_pretrained(path)
    return path


def reference(model: str) -> Any:
    """A ``ref_model`` unlike the policy: the model with seeded noise (0.02) on every weight."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return ref


def main(model: str, out: str, plain: bool, lora: bool = False, ref: bool = False, resume_from: str | None = None,
         **kw: Any) -> Any:
    """A TRL DPO script: ``from ds_mp.hf import DPOTrainer`` is its only ds_mp line (``plain``: TRL's);
    ``lora``: a LoRA adapter (r=4) on every projection; ``ref``: a ``ref_model`` (:func:`reference`);
    ``resume_from``: ``train(resume_from_checkpoint=...)``."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer
    from trl import DPOConfig

    if plain:
        from trl import DPOTrainer
    else:
        from ds_mp.hf import DPOTrainer
    records = pairs(24)
    args = DPOConfig(output_dir=out, **{**BASE, **kw})
    peft_config = None
    if lora:
        from peft import LoraConfig

        targets = ["c_attn", "c_proj", "c_fc"] if AutoConfig.from_pretrained(model).model_type == "gpt2" else \
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, ref_model=reference(model) if ref else None, args=args,
                         train_dataset=Dataset.from_list(records[:16]), eval_dataset=Dataset.from_list(records[16:]),
                         processing_class=AutoTokenizer.from_pretrained(model), peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model()
    return trainer


def _history(trainer: Any) -> dict:
    history = trainer.state.log_history
    return {"train": [h for h in history if "loss" in h], "eval": [h for h in history if "eval_loss" in h][0],
            "keys": sorted({k for h in history for k in h})}


def _run(rank: int, model: str, out: str, plain: bool, kw: dict) -> dict | None:
    """:func:`main` on this rank; with ``kw["resume"]`` also a second run resumed from its
    checkpoint-3 (``save_steps=3``), saved to ``<out>_resumed``."""
    kw = dict(kw)
    resume = kw.pop("resume", False)
    if resume:
        kw.update(save_strategy="steps", save_steps=3)
    trainer = main(model, out, plain, **kw)
    result = _history(trainer)
    if resume:
        again = main(model, out + "_resumed", plain, resume_from=os.path.join(out, "checkpoint-3"), **kw)
        result["resumed"] = _history(again)
    return None if rank else result


def saved(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if os.path.exists(os.path.join(out, "adapter_model.safetensors")) else \
        "model.safetensors"
    return load_file(os.path.join(out, name))


_PLAIN: dict[tuple, tuple[dict, dict]] = {}


def plain(root: str, model: str, **kw: Any) -> tuple[dict, dict]:
    """The oracle run (one process, trl.DPOTrainer, no DeepSpeed), once per argument set."""
    key = (model, repr(sorted(kw.items())))
    if key not in _PLAIN:
        out = os.path.join(root, f"plain{len(_PLAIN)}")
        res = run_ranks(_run, 1, model, out, True, {**kw, "use_cpu": True}, timeout=600)[0]
        _PLAIN[key] = (res, saved(out))
    return _PLAIN[key]


def close(a: float, b: float, rel: float = REL, abs_: float = ABS) -> bool:
    return abs(a - b) <= max(abs_, rel * abs(b))


def compare(ref: tuple[dict, dict], res: dict, weights: dict, where: str) -> None:
    """Losses (relative), metrics (absolute; log-prob sums relative), eval metrics and saved weights."""
    (want, want_w) = ref
    assert len(res["train"]) == len(want["train"]) == 5, (where, res["train"])
    for got, exp in zip(res["train"], want["train"]):
        assert close(got["loss"], exp["loss"], abs_=0), f"{where}: loss {got['loss']} vs {exp['loss']}"
        for k in METRICS:
            assert close(got[k], exp[k], rel=REL if k.startswith("logps") else 0), f"{where}: {k} {got[k]} vs {exp[k]}"
    for k in ("loss", *METRICS):
        got, exp = res["eval"][f"eval_{k}"], want["eval"][f"eval_{k}"]
        assert close(got, exp, rel=REL if k in ("loss",) or k.startswith("logps") else 0), f"{where}: eval_{k} {got} vs {exp}"
    missing = sorted(set(want_w) - set(weights))
    assert not missing, f"{where}: saved without {missing[:3]}"
    worst = max(float((weights[k] - v).abs().max()) for k, v in want_w.items())
    assert worst <= ABS, f"{where}: saved weights differ by {worst}"


def ds_json(path: str, tp: int = 1, pp: int = 1, schedule: str = "1f1b") -> str:
    import json

    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
           "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp, "schedule": schedule}}}
    if schedule == "interleaved":  # two chunks of the 4-layer model per stage
        cfg["ds_mp"]["pipeline"]["virtual_stages"] = 2
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> str:
    return str(tmp_path_factory.mktemp("dpo"))


def test_the_data_has_uneven_and_truncated_pairs(root: str) -> None:
    """The pairs the layouts are compared on are what the docstring says: TRL's tokenization gives a
    pair of very uneven lengths and one cut at max_length (48)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir(root, "gpt2"))
    lengths = [(len(tok(r["prompt"])["input_ids"]), len(tok(r["chosen"])["input_ids"]),
                len(tok(r["rejected"])["input_ids"])) for r in pairs(24)[:16]]
    assert lengths[1][2] >= 20 * lengths[1][1]
    assert lengths[3][0] < BASE["max_length"] < lengths[3][0] + lengths[3][1]


# Pairwise coverage within the suite budget (three oracle runs, four ds_mp runs of two ranks):
#   TP2, Qwen2, full fine-tune (initial weights precomputed), 3 pairs per micro-batch (16 pairs: a short
#     last batch of 1 pair, eval steps of 4 pairs cut 3 + 1), checkpoint at step 3 + resume;
#   PP2 zb-v, GPT-2, LoRA with precompute_ref_log_probs (= TRL's adapter-off on the fly);
#   DP2 × GA2 (1 pair per micro-batch: the oracle's 4 pairs per step), GPT-2, LoRA off per step;
#   PP2 1f1b, GPT-2, a ref_model (a second engine), loss_type sigmoid + ipo + sft weighted.
# TP2 × PP2 (Qwen2 full and LoRA), zb-h1 and interleaved: run by hand (docs/trainer.md), same checks.
MIX = {"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [1.0, 0.5, 0.2]}
CASES = [
    ("qwen2", 2, 2, 1, "1f1b", {"resume": True, "per_device_train_batch_size": 3}, {"per_device_train_batch_size": 3}),
    ("gpt2", 2, 1, 2, "zb-v", {"lora": True, "precompute_ref_log_probs": True}, {"lora": True}),
    ("gpt2", 2, 1, 1, "1f1b", {"lora": True, "per_device_train_batch_size": 1}, {"lora": True}),
    ("gpt2", 2, 1, 2, "1f1b", {"ref": True, **MIX}, {"ref": True, **MIX}),
    ("gpt2", 2, 1, 2, "zb-h1", {}, {}),
    ("qwen2", 4, 2, 2, "interleaved", {"lora": True}, {"lora": True}),
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind, world, tp, pp, schedule, kw, oracle_kw", CASES,
                         ids=["tp2-qwen2-resume", "pp2-zbv-lora-precompute", "dp2-ga2-lora", "pp2-ref-model",
                              "pp2-zbh1", "tp2pp2-qwen2-interleaved-lora"])
def test_dpo_trainer_equals_plain_trl(tmp_path: Any, root: str, kind: str, world: int, tp: int, pp: int,
                                      schedule: str, kw: dict, oracle_kw: dict) -> None:
    model = model_dir(root, kind)
    ref = plain(root, model, **oracle_kw)
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), tp, pp, schedule)
    res = run_ranks(_run, world, model, out, False, {"deepspeed": cfg, **kw}, timeout=600)[0]
    if "ref" not in kw:  # step 1: the reference is the policy
        assert abs(ref[0]["train"][0]["loss"] - math.log(2)) <= 1e-6
        assert abs(res["train"][0]["loss"] - math.log(2)) <= 1e-6
    assert not {"entropy", "mean_token_accuracy", "logits/chosen"} & set(res["keys"])  # TRL's fused-head metrics
    where = f"{kind} TP{tp} PP{pp} DP{world // (tp * pp)} {schedule} {kw}"
    compare(ref, res, saved(out), where)
    if "resumed" in res:  # from checkpoint-3 (its log history restored): steps 4-5 and the weights as TRL's
        tail = [h for h in res["resumed"]["train"] if h["step"] > 3]
        assert [h["step"] for h in tail] == [4, 5]
        compare(ref, {**res["resumed"], "train": res["train"][:3] + tail}, saved(out + "_resumed"), where + " resumed")


def _refusals(rank: int, model: str, root: str) -> dict[str, str]:
    """Every refusal's message, from DPOTrainer's constructor (a TRL argument ds_mp does not compute, a
    schedule the 'dpo' loss cannot run), with the trainer never built."""
    from datasets import Dataset
    from trl import DPOConfig

    from ds_mp.config import ConfigError
    from ds_mp.hf import DPOTrainer

    data = Dataset.from_list(pairs(4))
    cases = {"aot": ({"loss_type": ["sigmoid", "aot"]}, "1f1b"), "use_weighting": ({"use_weighting": True}, "1f1b"),
             "ld_alpha": ({"ld_alpha": 0.5}, "1f1b"), "f_divergence_type": ({"f_divergence_type": "js_divergence"}, "1f1b"),
             "sync_ref_model": ({"sync_ref_model": True}, "1f1b"), "padding_free": ({"padding_free": True}, "1f1b"),
             "terapipe": ({}, "terapipe"), "ouroboros": ({}, "ouroboros")}
    said = {}
    for name, (kw, schedule) in cases.items():
        cfg = ds_json(os.path.join(root, f"refuse-{rank}-{name}.json"), 1, 2, schedule)
        args = DPOConfig(output_dir=root, report_to="none", bf16=False, deepspeed=cfg, **kw)
        try:
            DPOTrainer(model=model, args=args, train_dataset=data)
        except ConfigError as err:
            said[name] = str(err)
    return said


@pytest.mark.timeout(300)
def test_what_ds_mp_does_not_compute_is_refused_in_one_line(tmp_path: Any, root: str) -> None:
    said = run_ranks(_refusals, 2, model_dir(root, "gpt2"), str(tmp_path), timeout=240)[0]
    words = {"aot": "'aot'", "use_weighting": "use_weighting", "ld_alpha": "ld_alpha", "f_divergence_type":
             "f_divergence_type", "sync_ref_model": "sync_ref_model", "padding_free": "padding_free",
             "terapipe": "terapipe", "ouroboros": "ouroboros"}
    for name, word in words.items():
        assert name in said, f"{name}: not refused"
        assert word in said[name] and "\n" not in said[name], said[name]
