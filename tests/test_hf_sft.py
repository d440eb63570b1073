"""``ds_mp.hf.SFTTrainer`` against the plain ``trl.SFTTrainer`` (the outside oracle): the same script
(launch/trl_sft.py: a tiny Qwen2-shaped model, a ChatML tokenizer with ``{% generation %}`` markers,
uneven chats, ``packing=True`` best-fit padding-free, ``assistant_only_loss=True``, so the target
counts differ from micro-batch to micro-batch) on one process without ds_mp or DeepSpeed (fp32,
dropout 0) and through ds_mp at TP=2, PP=2 and TP2 × PP2 gives the same logged losses (1e-5
relative), the same eval loss and the same saved weights over 5 optimizer steps.  SGD keeps the
weight comparison well-conditioned (Adam turns last-bit differences of near-zero gradients into ±lr
steps); clipping at TRL's default max_grad_norm 1.0 is on in both.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest
import torch

from dist_utils import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL, TOL = 1e-5, 1e-5
ARGS = ["--bf16", "false", "--max_steps", "5", "--logging_steps", "1", "--report_to", "none", "--packing", "true",
        "--max_length", "48", "--assistant_only_loss", "true", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--per_device_eval_batch_size", "64", "--eval_strategy", "steps",
        "--eval_steps", "5", "--save_strategy", "no", "--optim", "sgd", "--learning_rate", "0.5", "--seed", "0",
        "--disable_tqdm", "true"]


def trl_sft_script() -> Any:
    """launch/trl_sft.py as a module."""
    if "trl_sft" not in sys.modules:
        spec = importlib.util.spec_from_file_location("trl_sft", os.path.join(REPO, "launch", "trl_sft.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["trl_sft"] = module
        spec.loader.exec_module(module)
    return sys.modules["trl_sft"]


def ds_json(path: str, tp: int = 1, pp: int = 1, schedule: str = "1f1b", **ds_mp: Any) -> str:
    """A Trainer DeepSpeed JSON: everything "auto" (filled from the arguments), the layout in "ds_mp"."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
           "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp, "schedule": schedule}, **ds_mp}}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _run(rank: int, argv: list[str], plain: bool) -> dict | None:
    script = trl_sft_script()
    if plain:
        import trl

        trainer = script.main(argv, trainer_class=trl.SFTTrainer)
    else:
        trainer = script.main(argv)
    if rank:
        return None
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "eval": [h["eval_loss"] for h in history if "eval_loss" in h],
            "keys": sorted({k for h in history for k in h})}


def saved(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if os.path.exists(os.path.join(out, "adapter_model.safetensors")) else \
        "model.safetensors"
    return load_file(os.path.join(out, name))


_PLAIN: dict[tuple[str, ...], tuple[dict, dict]] = {}


def plain(tmp_root: str, extra: tuple[str, ...] = (), args: list[str] | None = None) -> tuple[dict, dict]:
    """The oracle run (one process, trl.SFTTrainer, no DeepSpeed), once per argument list (``args``,
    default :data:`ARGS`, plus ``extra``): the cache key is the whole list, so a module that asks for
    other arguments never gets a run made with these."""
    argv = (ARGS if args is None else args) + list(extra)
    key = tuple(argv)
    if key not in _PLAIN:
        out = os.path.join(tmp_root, f"plain{len(_PLAIN)}")
        res = run_ranks(_run, 1, argv + ["--output_dir", out], True, timeout=600)[0]
        _PLAIN[key] = (res, saved(out))
    return _PLAIN[key]


def compare(ref: tuple[dict, dict], res: dict, weights: dict, where: str) -> None:
    (ref_res, ref_w) = ref
    assert len(res["losses"]) == len(ref_res["losses"]) == 5, (where, res["losses"])
    for a, b in zip(res["losses"], ref_res["losses"]):
        assert abs(a - b) <= REL * abs(b), f"{where}: losses {res['losses']} vs {ref_res['losses']}"
    assert abs(res["eval"][0] - ref_res["eval"][0]) <= REL * abs(ref_res["eval"][0]), (where, res["eval"], ref_res["eval"])
    missing = sorted(set(ref_w) - set(weights))
    assert not missing, f"{where}: saved without {missing[:3]}"
    worst = max(float((weights[k] - v).abs().max()) for k, v in ref_w.items())
    assert worst <= TOL, f"{where}: saved weights differ by {worst}"


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory: Any) -> str:
    return str(tmp_path_factory.mktemp("plain_sft"))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world, tp, pp, schedule", [(2, 2, 1, "1f1b"),
                                                     pytest.param(2, 1, 2, "zb-h1", marks=pytest.mark.slow),
                                                     pytest.param(4, 2, 2, "1f1b", marks=pytest.mark.slow)])
def test_sft_trainer_equals_plain_trl(tmp_path: Any, oracle_root: str, world: int, tp: int, pp: int,
                                      schedule: str) -> None:
    ref = plain(oracle_root)
    out = str(tmp_path / "ds_mp")
    # TP2 × PP2 runs the config the repo ships for it (the one the docs launch), as shipped.
    cfg = os.path.join(REPO, "ds_configs", "trainer_tp2_pp2.json") if (tp, pp, schedule) == (2, 2, "1f1b") else \
        ds_json(str(tmp_path / "ds.json"), tp, pp, schedule)
    res = run_ranks(_run, world, ARGS + ["--output_dir", out, "--deepspeed", cfg], False, timeout=900)[0]
    assert "entropy" not in res["keys"]  # TRL's fused-head metrics are not logged (docs/trainer.md)
    compare(ref, res, saved(out), f"TP{tp} PP{pp} {schedule}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sft_trainer_on_gpt2_equals_plain_trl(tmp_path: Any, oracle_root: str) -> None:
    """The same on GPT-2 (tied embedding and head, learned positions) at TP2 × PP2: the tied head sits
    on both end stages."""
    gpt2 = ("--tiny", "gpt2")
    ref = plain(oracle_root, gpt2)
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), 2, 2)
    res = run_ranks(_run, 4, ARGS + ["--output_dir", out, "--deepspeed", cfg, *gpt2], False, timeout=900)[0]
    compare(ref, res, saved(out), "GPT-2 TP2 PP2")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sft_lora_equals_plain_trl_peft(tmp_path: Any, oracle_root: str) -> None:
    """``peft_config`` (LoRA r=4 on every attention and MLP projection of Qwen2) at TP2 × PP2: the same
    losses, eval loss and adapter (PEFT's names and orientation) as plain TRL with PEFT."""
    lora = ("--lora_r", "4")
    ref = plain(oracle_root, lora)
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), 2, 2)
    res = run_ranks(_run, 4, ARGS + ["--output_dir", out, "--deepspeed", cfg, *lora], False, timeout=900)[0]
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    compare(ref, res, saved(out), "LoRA TP2 PP2")
    from peft import PeftModel

    script = trl_sft_script()
    loaded = PeftModel.from_pretrained(script.tiny_model("qwen2", len(script.tiny_tokenizer())), out)
    assert any("lora_A" in name for name, _ in loaded.named_parameters())


def test_peft_options_ds_mp_does_not_compute_are_refused() -> None:
    from peft import LoraConfig

    from ds_mp.config import ConfigError
    from ds_mp.hf.sft import lora_block

    ok = lora_block(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert ok == {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    for kwargs, words in [({"use_dora": True}, "use_dora"), ({"use_rslora": True}, "use_rslora"),
                          ({"bias": "all"}, "bias='all'"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                          ({"target_modules": "all-linear"}, "target_modules='all-linear'")]:
        cfg = LoraConfig(r=4, lora_alpha=8, **{"target_modules": ["q_proj"], **kwargs})
        with pytest.raises(ConfigError, match=words) as err:
            lora_block(cfg)
        assert "\n" not in str(err.value)
