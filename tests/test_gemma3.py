"""Gemma 3 (``Gemma3ForCausalLM``; and a multimodal ``gemma3`` checkpoint's text model) equals the
unmodified HF model trained on one process (fp32, SGD with clipping), through tests/family_checks.py's
checks (the layouts of ``run_family``: TP = 2, TP = 3 with 2 KV heads replicated, PP = 2 under every
schedule — 1f1b and, at DP = 2, zb-h1 with a stage boundary between a sliding and a full-attention
layer — TP2 × PP2 with SP, TP2 × DP2 (ZeRO-1), each DP replica on its own rows with uneven target
counts against HF on the global batch, bf16; LoRA, the Trainer and TRL paths, checkpoints, Ouroboros, an
inline shape).  The tiny model (tests/helpers.py ``tiny_gemma3``) has a 5-key window under 16-token rows,
sliding and full layers with their own RoPE bases, ``head_dim`` 20 with ``query_pre_attn_scalar`` 24,
(1 + w) norms moved from 0, logits soft-capped, a tied vocabulary padded for TP and pad id 0 (a frozen row).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
import torch

from helpers import ds_config, tiny_gemma3
from test_llama import SEQ, VOCAB
from family_checks import (inline_shape_draws_hf_init, lora_equals_peft, resume_then_generate, ring_equals_reference,
                           round_trip, run_family, sft_equals_plain_trl, trainer_equals_plain_trainer)


def _untied(**kw: Any) -> Any:
    return tiny_gemma3(tied=False, **kw)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layouts_equal_hf(world: int, tmp_path: Any) -> None:
    run_family(_untied if world == 4 else tiny_gemma3, world, str(tmp_path))


def test_tables_cover_hf_models() -> None:
    from ds_mp.models.family import family_of

    for tied in (True, False):
        model = tiny_gemma3(tied=tied, n_layer=3)
        fam, cfg = family_of(model.config), model.config
        sd = {n: tuple(t.shape) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
        assert fam.name == "gemma3" and fam.param_shapes(cfg) == sd
        layers = fam.pipeline_layers(cfg)
        assert all(0 <= fam.layer_index(n, layers) < len(layers) for n in sd)


def test_multimodal_checkpoint_trains_its_text_model(tmp_path: Any) -> None:
    """A ``gemma3`` directory (``Gemma3ForConditionalGeneration``: ``text_config``, ``model.language_model.*``,
    a vision tower) reads as its text model: the shape from ``text_config``, the same loss as the
    ``Gemma3ForCausalLM`` holding those weights."""
    import ds_mp
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_gemma3()
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    mm = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.config.to_dict(), vision_config=vision,
                                                     mm_tokens_per_image=4))
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.save_pretrained(str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["model_type"] == "gemma3"
    cfg, _ = ds_mp.load_config(ds_config(micro=2, gas=1, seq=SEQ, model=str(tmp_path)), 1)
    assert (cfg.shape.n_layer, cfg.shape.n_embd, cfg.shape.vocab_size) == (2, 96, VOCAB)
    engine, *_ = ds_mp.initialize(config=ds_config(micro=2, gas=1, seq=SEQ, lr=0.0, model=str(tmp_path)))
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = float(text.eval()(input_ids=ids, labels=ids).loss)
    assert abs(float(engine.eval_batch(iter([(ids, ids)]))) - want) < 1e-5
    with pytest.raises(ds_mp.ConfigError, match=r"^model: a Gemma3ForConditionalGeneration is not a causal LM"):
        ds_mp.initialize(model=mm, config=ds_config(micro=2, gas=1, seq=SEQ))  # the object: refused, one line


def test_unbuilt_options_are_refused_in_one_line() -> None:
    from ds_mp.config import ConfigError, load_config

    for key, words in (("attn_logit_softcapping", "attn_logit_softcapping=50.0 is not supported"),
                       ("use_bidirectional_attention", "use_bidirectional_attention=True is not supported")):
        raw = {**tiny_gemma3().config.to_dict(), key: 50.0 if key.startswith("attn") else True}
        with pytest.raises(ConfigError, match=rf"^ds_mp.model: gemma3 option {words}"):
            load_config(ds_config(), 1, raw)


def test_lora_equals_peft(tmp_path: Any) -> None:
    lora_equals_peft(tiny_gemma3, str(tmp_path))


def test_trainer_equals_plain_trainer(tmp_path: Any) -> None:
    trainer_equals_plain_trainer(tiny_gemma3, str(tmp_path))


def test_hf_sharded_round_trip_bit_exact(tmp_path: Any) -> None:
    round_trip(tiny_gemma3, str(tmp_path))


def test_resume_at_another_layout_then_generate(tmp_path: Any) -> None:
    resume_then_generate(tiny_gemma3, str(tmp_path))


def test_ouroboros_ring_equals_reference() -> None:
    ring_equals_reference(tiny_gemma3)


def test_inline_shape_draws_hf_init() -> None:
    inline_shape_draws_hf_init("gemma3_text", "Gemma3ForCausalLM")


def test_bf16_embedding_scale_is_rounded_as_hf_rounds_it() -> None:
    """Under bf16 the embedding is scaled by sqrt(96) rounded to bf16 (9.8125, not 9.798), as HF's
    ``Gemma3TextScaledWordEmbedding`` does: ds_mp's embedding layer output equals HF's bit for bit."""
    import ds_mp
    from ds_mp.models.gemma3.layers import Embedding

    model = tiny_gemma3()
    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=ds_config(micro=2, gas=1, seq=SEQ, bf16=True))
    layer = next(m for m in engine.module.modules() if isinstance(m, Embedding))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(ids)
        want = model.to(torch.bfloat16).model.embed_tokens(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_sft_trainer_equals_plain_trl(tmp_path: Any) -> None:
    sft_equals_plain_trl(tiny_gemma3, str(tmp_path))
