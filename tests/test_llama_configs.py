"""Llama-family configs and model objects from the wild, each read as HF reads it (or refused).

* ``tie_word_embeddings: true`` over a stored, different ``lm_head.weight``: HF's ``from_pretrained``
  warns and loads the head untied, so ds_mp does (directory and model object), ``ds-mp convert``
  verifies against ``from_pretrained`` of the source, and the round trip loads in HF as the source;
  GPT-2, whose table always ties, refuses such checkpoints and untied configs.
* Bias flags as each HF class reads them: Llama honours ``attention_bias`` and ``mlp_bias``, Qwen2
  (q/k/v biases always) and Mistral (none) ignore both.
* Objects that are not the family's causal LM (``LlamaForSequenceClassification``, ``LlamaModel``)
  are refused with one line; ``pad_token_id`` outside the vocabulary too (HF cannot build it).

The oracle is the unmodified HF model (``from_pretrained`` of the same directory) trained
single-process with torch SGD.
"""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config
from test_llama import LR, SEQ, TOL, VOCAB, _train, steps_for, tiny_llama
from test_tensor_parallel import hf_train, max_diff


def _tied_over_a_stored_head(path: str, kind: str = "llama") -> None:
    """An untied checkpoint whose config.json then says ``tie_word_embeddings: true`` (the head stays stored)."""
    tiny_llama(kind, 2, False).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**raw, "tie_word_embeddings": True}, f)


def _hf_loads(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model: Any) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.filterwarnings("ignore:ds_mp.*differs from")
def test_tied_config_over_a_different_stored_head_trains_untied_as_hf(tmp_path) -> None:
    """HF 5.x loads the head untied (and warns); ds_mp follows at TP = 2 from the directory and at TP = 1
    from the object HF loaded: losses and every weight, ``lm_head`` included, equal HF's."""
    _tied_over_a_stored_head(str(tmp_path / "hf"))
    hf = _hf_loads(str(tmp_path / "hf"))
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight and hf.config.tie_word_embeddings
    steps = steps_for()
    want_losses, _, want = hf_train(hf, steps, lr=LR)
    assert "lm_head.weight" in want
    for tp, model in ((2, str(tmp_path / "hf")), (1, hf)):
        results = run_ranks(_train, tp, model, steps, ds_config(tp=tp, micro=2, gas=2, lr=LR, seq=SEQ), timeout=600)
        got = {k: v for _, weights in results for k, v in weights.items()}
        assert set(got) == set(want) and max_diff(got, want) < TOL, tp
        assert max(abs(a - b) for a, b in zip(results[0][0], want_losses)) < TOL, (results[0][0], want_losses)


def test_an_equal_stored_head_stays_tied(tmp_path) -> None:
    """A tied checkpoint that also stores the head (as ``.bin`` files do) loads tied in HF and in ds_mp."""
    from safetensors.torch import save_file

    from ds_mp.checkpoint.hf import HFReader

    model = tiny_llama("llama", 2, True)
    model.save_pretrained(tmp_path)
    sd = {n: t.clone().contiguous() for n, t in model.state_dict().items()}
    assert "lm_head.weight" in sd
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = _hf_loads(str(tmp_path))
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert HFReader(str(tmp_path)).config.tie_word_embeddings


@pytest.mark.filterwarnings("ignore:ds_mp.*differs from")
def test_convert_verifies_against_from_pretrained_of_the_source(tmp_path, monkeypatch) -> None:
    """``hf-to-ds --verify-logits`` compares with HF's own loader of IN, so a misread source fails the
    check (here: ds_mp made to tie the head again, as it did); read as HF reads it, the round trip
    HF -> sharded (TP = 2) -> HF loads in ``from_pretrained`` with the source's logits."""
    import ds_mp.checkpoint.hf as hf_mod
    from ds_mp.checkpoint import CheckpointError, ds_to_hf, hf_to_ds

    src = str(tmp_path / "hf")
    _tied_over_a_stored_head(src)
    with monkeypatch.context() as m:
        m.setattr(hf_mod, "untied_as_hf_loads", lambda cfg, where: cfg)  # the old reading: head dropped
        with pytest.raises(CheckpointError, match=r"from_pretrained\(IN\) vs shards"):
            hf_to_ds(src, str(tmp_path / "bad"), tp=2, pp=1, verify_logits=True)
    assert not os.path.exists(tmp_path / "bad")
    msg = hf_to_ds(src, str(tmp_path / "ds"), tp=2, pp=1, verify_logits=True)
    assert "from_pretrained(IN) vs shards" in msg
    ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "back"), verify_logits=True)
    back = _hf_loads(str(tmp_path / "back"))
    assert not back.config.tie_word_embeddings
    assert torch.equal(_logits(back), _logits(_hf_loads(src)))


@pytest.mark.filterwarnings("ignore:ds_mp.*differs from")
def test_gpt2_refuses_a_head_hf_would_train_untied(tmp_path) -> None:
    """GPT-2's table ties the head: a checkpoint HF loads untied (tied config, different stored head)
    is refused on reading, and an untied config (``tie_word_embeddings: false``) by the family check."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_mp.checkpoint import CheckpointError
    from ds_mp.checkpoint.hf import HFReader
    from ds_mp.models.family import family_of

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is not model.transformer.wte.weight  # HF trains them apart
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        family_of(cfg).check(cfg)
    model.save_pretrained(tmp_path / "gpt2")
    raw = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    assert _hf_loads(str(tmp_path / "gpt2")).lm_head.weight is not None
    with pytest.raises(CheckpointError, match="untied"):
        HFReader(str(tmp_path / "gpt2"))


# (family, config keys): what HF builds from each flag (tests/test_llama.py's tables test covers the defaults)
BIAS_FLAGS = [("llama", {"attention_bias": True, "mlp_bias": True}),  # honoured: q/k/v/o and MLP biases
              ("qwen2", {"attention_bias": True, "mlp_bias": True}),  # ignored: q/k/v biases only
              ("mistral", {"attention_bias": True, "mlp_bias": True})]  # ignored: no biases


@pytest.mark.parametrize("kind, flags", BIAS_FLAGS, ids=[k for k, _ in BIAS_FLAGS])
def test_bias_flags_are_read_as_hf_reads_them(kind: str, flags: dict) -> None:
    """``param_shapes`` is HF's state dict for each family with both flags set."""
    from ds_mp.models.family import family_of

    model = tiny_llama(kind, 2, False, **flags)
    sd = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert family_of(model.config).param_shapes(model.config) == sd


def test_qwen2_with_ignored_bias_flags_equals_hf() -> None:
    """A Qwen2 config carrying ``attention_bias``/``mlp_bias`` (ignored by HF) trains as HF at TP = 2."""
    model, steps = tiny_llama("qwen2", 2, False, attention_bias=True, mlp_bias=True), steps_for()
    want_losses, _, want = hf_train(model, steps, lr=LR)
    results = run_ranks(_train, 2, model, steps, ds_config(tp=2, micro=2, gas=2, lr=LR, seq=SEQ), timeout=600)
    got = {k: v for _, weights in results for k, v in weights.items()}
    assert set(got) == set(want) and max_diff(got, want) < TOL
    assert max(abs(a - b) for a, b in zip(results[0][0], want_losses)) < TOL


def test_objects_that_are_not_causal_lms_are_refused(monkeypatch: Any) -> None:
    """``LlamaForSequenceClassification`` (its ``score`` head) and a bare ``LlamaModel`` (no head): one line
    each, from ``ds_mp.initialize`` before any process group is started (a spy on torch's
    ``init_process_group``: another test of this pytest process, e.g. one building TrainingArguments with
    a DeepSpeed JSON, may have started a group already)."""
    from transformers import LlamaForSequenceClassification, LlamaModel

    import ds_mp
    from ds_mp.config import ConfigError

    started: list = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: started.append(1))
    cfg = tiny_llama("llama", 2, True).config
    for model in (LlamaForSequenceClassification(cfg), LlamaModel(cfg)):
        name = type(model).__name__
        with pytest.raises(ConfigError, match=rf"^model: a {name} is not a causal LM; ds_mp trains LlamaForCausalLM"):
            ds_mp.initialize(model=model, config=ds_config(seq=SEQ))
        assert not started


def test_gpt2_pad_token_row_trains_as_in_hf() -> None:
    """HF's GPT-2 embedding has no ``padding_idx`` whatever ``pad_token_id`` says: the pad row trains like
    any other there and in ds_mp (TP = 2; a guard, not a mend: tests/test_llama.py covers the Llama family)."""
    from helpers import batches, tiny_gpt2

    model = tiny_gpt2(n_layer=2, vocab=VOCAB)
    steps = [batches(2, 2, SEQ, VOCAB, seed=7 + i) for i in range(2)]
    pad = int(steps[0][0][0][0, 0])
    model.config.pad_token_id = pad
    assert model.transformer.wte.padding_idx is None
    want_losses, _, want = hf_train(model, steps, lr=LR)
    row = "transformer.wte.weight"
    assert not torch.equal(want[row][pad], model.state_dict()[row][pad])
    results = run_ranks(_train, 2, model, steps, ds_config(tp=2, micro=2, gas=2, lr=LR, seq=SEQ), timeout=600)
    got = {k: v for _, weights in results for k, v in weights.items()}
    assert max_diff(got, want) < TOL


@pytest.mark.parametrize("pad", [VOCAB, -VOCAB - 1])
def test_pad_token_outside_the_vocabulary_is_refused(pad: int) -> None:
    """HF's ``nn.Embedding`` refuses a ``padding_idx`` outside [-V, V); so does the family check."""
    from transformers import LlamaConfig

    from ds_mp.models.family import family_of

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      vocab_size=VOCAB, pad_token_id=pad)
    with pytest.raises(ValueError, match=f"pad_token_id={pad} is not a row"):
        family_of(cfg).check(cfg)


def test_terapipe_auto_slices_with_explicit_head_dim_and_gqa(tmp_path) -> None:
    """``"slices": "auto"`` profiles the stage with the cache entries its blocks really hold (head_dim 24 ≠
    96 / 6, 2 key/value heads for 6 query heads), trains as HF at PP = 2, and keys the saved profile by
    head_dim and the key/value head count (a profile of another head shape is measured again)."""
    from ds_mp.schedules.terapipe.cost_model import cost_model_meta

    model, steps = tiny_llama("llama", 2, False, head_dim=24), steps_for(micro_batches=1)
    want_losses, _, want = hf_train(model, steps, lr=LR)
    cfg = ds_config(pp=2, micro=2, gas=1, lr=LR, seq=SEQ, schedule="terapipe",
                    terapipe={"slices": "auto", "granularity": 4}, training={"output_dir": str(tmp_path)})
    results = run_ranks(_train, 2, model, steps, cfg, timeout=600)
    got = {k: v for _, weights in results for k, v in weights.items()}
    assert set(got) == set(want) and max_diff(got, want) < TOL
    assert max(abs(a - b) for a, b in zip(results[0][0], want_losses)) < TOL
    meta = cost_model_meta(os.path.join(tmp_path, "terapipe_profile.json"))
    assert (meta["head_dim"], meta["n_kv_head"]) == (24, 2), meta
