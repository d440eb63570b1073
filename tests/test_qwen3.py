"""Qwen3 (``Qwen3ForCausalLM``: q/k norms over ``head_dim`` before the rotation, ``head_dim`` 20 ≠
96 / 6) equals the unmodified HF model trained on one process (fp32, SGD with clipping): TP = 2 (KV
heads split), TP = 3 (2 KV heads replicated over 3 ranks), PP = 2 under 1f1b, gpipe (ZeRO-2), zb-h1,
zb-v, interleaved and TeraPipe (token slices 6 + 10), TP2 × PP2 with sequence parallelism, TP2 × DP2
(ZeRO-1) and PP2 × DP2 (zb-h1) with each replica on its own rows and uneven target counts (HF trains on
the global batch), ZeRO-1, activation checkpointing, tied and untied heads, bf16 (losses within
test_llama's BF16_TOL of HF's fp32 ones); DP replicas hold bit-identical weights; every TP and DP copy
of a q/k norm stays bit-identical and equal to HF's trained norm (their gradient is summed over TP:
each rank sees its own heads); ``save_hf`` loads in ``from_pretrained``
with the trained model's logits; LoRA equals PEFT; ``ds_mp.hf.Trainer`` equals the plain
``transformers.Trainer`` and ``ds_mp.hf.SFTTrainer`` plain TRL; HF ⇄ sharded bit-exact; resume at
another layout and ``generate()``; the Ouroboros ring; an inline shape.  Packed documents:
tests/test_packed_attention.py's rows.

The checks are tests/family_checks.py's (one spawn per world size for the layouts); tests/test_gemma3.py
runs the same on Gemma 3.
"""
from __future__ import annotations

from typing import Any

import pytest

from family_checks import (inline_shape_draws_hf_init, lora_equals_peft, resume_then_generate, ring_equals_reference,
                           round_trip, run_family, sft_equals_plain_trl, trainer_equals_plain_trainer)
from helpers import ds_config, tiny_qwen3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layouts_equal_hf(world: int, tmp_path: Any) -> None:
    run_family(tiny_qwen3, world, str(tmp_path))


def test_tables_cover_hf_models() -> None:
    """``param_shapes`` is exactly HF's state dict (q/k norms included, a tied head omitted); every name
    has a TP kind (the norms replicated) and a layer."""
    from ds_mp.models.family import family_of

    for tied in (True, False):
        model = tiny_qwen3(tied=tied, n_layer=3)
        fam, cfg = family_of(model.config), model.config
        sd = {n: tuple(t.shape) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
        assert fam.name == "llama" and fam.param_shapes(cfg) == sd
        layers = fam.pipeline_layers(cfg)
        for name in sd:
            assert 0 <= fam.layer_index(name, layers) < len(layers)
            assert fam.tp_kind(name) == "replicated" or "norm" not in name


def test_unbuilt_options_are_refused_in_one_line() -> None:
    from ds_mp.config import ConfigError, load_config

    raw = tiny_qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=1).config.to_dict()
    with pytest.raises(ConfigError, match=r"^ds_mp.model: qwen3 option use_sliding_window=True .*set it false"):
        load_config(ds_config(), 1, raw)
    inline = {"model_type": "qwen3", "n_layer": 2, "n_embd": 100, "n_head": 6, "vocab_size": 50, "n_positions": 32}
    with pytest.raises(ConfigError, match=r"^ds_mp.model.n_embd: 100 is not divisible by n_head=6"):
        load_config(ds_config(model=inline), 1)  # an inline shape's head_dim is n_embd / n_head
    with pytest.raises(ConfigError, match=r"rope_type 'dynamic' is not supported"):
        load_config(ds_config(), 1, {**tiny_qwen3().config.to_dict(),
                                     "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}})


def test_lora_equals_peft(tmp_path: Any) -> None:
    lora_equals_peft(tiny_qwen3, str(tmp_path))


def test_trainer_equals_plain_trainer(tmp_path: Any) -> None:
    trainer_equals_plain_trainer(tiny_qwen3, str(tmp_path))


def test_hf_sharded_round_trip_bit_exact(tmp_path: Any) -> None:
    round_trip(tiny_qwen3, str(tmp_path))


def test_resume_at_another_layout_then_generate(tmp_path: Any) -> None:
    resume_then_generate(tiny_qwen3, str(tmp_path))


def test_ouroboros_ring_equals_reference() -> None:
    ring_equals_reference(tiny_qwen3)


def test_inline_shape_draws_hf_init() -> None:
    inline_shape_draws_hf_init("qwen3", "Qwen3ForCausalLM")


def test_sft_trainer_equals_plain_trl(tmp_path: Any) -> None:
    sft_equals_plain_trl(tiny_qwen3, str(tmp_path))
