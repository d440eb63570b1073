"""Hugging Face Hub model ids wherever a model is named (``ds_mp.hub.resolve_model``), without
the network: a Hub-layout cache (``models--org--name/snapshots/<hash>/``, ``refs/<rev>``) is
built in a temp ``HF_HOME`` and ``HF_HUB_OFFLINE=1`` is set, so huggingface_hub itself must find
the snapshot.  The oracle is the HF model the snapshot was written from.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2
from launcher_utils import tiny_dataset, train_config

REPO_ID = "testorg/tiny-gpt2"
HASHES = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """A Hub cache holding REPO_ID at revisions main (seed 0) and v1 (seed 1), with the tiny
    dataset's tokenizer, plus a .bin file that must never be needed."""
    from transformers import AutoTokenizer

    from ds_mp.data import DatasetInfo

    root = tmp_path_factory.mktemp("hub")
    data = tiny_dataset(str(root))
    tok = AutoTokenizer.from_pretrained(DatasetInfo.load(data).tokenizer_dir)
    home = root / "hf_home"
    repo = home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    models = {}
    for seed, (rev, sha) in enumerate(HASHES.items()):
        snap = repo / "snapshots" / sha
        models[rev] = tiny_gpt2(seed=seed, vocab=len(tok))
        models[rev].save_pretrained(str(snap))
        tok.save_pretrained(str(snap))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / rev).write_text(sha)
    return {"home": str(home), "models": models, "snap": str(repo / "snapshots" / HASHES["main"]),
            "snap_v1": str(repo / "snapshots" / HASHES["v1"]), "data": data, "vocab": len(tok)}


@pytest.fixture
def offline(hub, monkeypatch) -> dict:
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", hub["home"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_ids_and_revisions_resolve_to_the_cached_snapshot(offline, tmp_path):
    from ds_mp.hub import parse_model_id, resolve_model

    assert os.path.samefile(resolve_model(REPO_ID), offline["snap"])
    assert os.path.samefile(resolve_model(REPO_ID + "@v1"), offline["snap_v1"])
    assert resolve_model(str(tmp_path)) == str(tmp_path)          # a local path wins, unchanged
    assert parse_model_id("gpt2") == ("gpt2", None) and parse_model_id("org/x@v2") == ("org/x", "v2")
    assert parse_model_id("./out/hf") is None and parse_model_id("/abs/dir") is None
    assert parse_model_id("runs/x/hf") is None                      # two slashes: a path


def test_offline_without_cache_is_one_helpful_line(offline, tmp_path, monkeypatch, capsys):
    from ds_mp.checkpoint import convert_cli
    from ds_mp.config import ConfigError, load_config
    from ds_mp.hub import HubError, resolve_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    with pytest.raises(HubError) as err:
        resolve_model("openai-community/gpt2-medium")
    msg = str(err.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and "hf download openai-community/gpt2-medium" in msg
    assert "HF_HOME" in msg and "local HF directory" in msg
    raw = ds_config()
    raw["ds_mp"]["model"] = "gpt2-medium"
    with pytest.raises(ConfigError, match=r"^ds_mp\.model: 'gpt2-medium' is not a local path"):
        load_config(raw, 1)
    assert convert_cli(["hf-to-ds", "gpt2", str(tmp_path / "out"), "--tp", "2"]) == 1
    assert "ds-mp convert hf-to-ds IN: 'gpt2' is not a local path" in capsys.readouterr().err


def test_config_and_convert_accept_an_id(offline, tmp_path):
    from ds_mp.checkpoint import ShardedReader, convert_cli
    from ds_mp.checkpoint.convert import model_from
    from ds_mp.config import load_config

    raw = ds_config(seq=16)
    raw["ds_mp"]["model"] = REPO_ID + "@v1"
    cfg, _ = load_config(raw, 1)
    assert os.path.samefile(cfg.model, offline["snap_v1"]) and cfg.shape.vocab_size == offline["vocab"]
    out = str(tmp_path / "ds")
    assert convert_cli(["hf-to-ds", REPO_ID, out, "--tp", "2", "--pp", "2"]) == 0  # verifies logits itself
    ids = torch.randint(0, offline["vocab"], (2, 16))
    with torch.no_grad():
        got = model_from(ShardedReader(out))(input_ids=ids).logits
        assert torch.allclose(got, offline["models"]["main"](input_ids=ids).logits, atol=1e-5)


def test_eval_and_generate_accept_an_id(offline, tmp_path, capsys):
    from ds_mp.tools.evaluate import eval_cli
    from ds_mp.tools.generate import generate_cli

    tokens = str(tmp_path / "tokens.npy")
    ids = np.random.default_rng(0).integers(0, offline["vocab"], 64).astype(np.uint16)
    np.save(tokens, ids)
    assert eval_cli(["--model", REPO_ID, "--data", tokens, "--window", "64", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    t = torch.tensor(ids.astype(np.int64))[None]
    with torch.no_grad():
        want = float(offline["models"]["main"](input_ids=t, labels=t).loss)   # the main revision's weights
    assert got["scored_tokens"] == 63 and got["nll"] == pytest.approx(want, rel=1e-5)
    assert generate_cli(["--model", REPO_ID, "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert "def" in capsys.readouterr().out


def _initialize_rank(rank: int, env: dict, model_id: str) -> float:
    os.environ.update(env)
    import ds_mp

    engine, *_ = ds_mp.initialize(model=model_id, config=ds_config(micro=2, gas=1, seq=16))
    return float(engine.eval_batch(iter(batches(1, 2, 16, int(engine.hf_config.vocab_size)))))


def test_initialize_accepts_an_id(offline):
    env = {"HF_HOME": offline["home"], "HF_HUB_OFFLINE": "1"}
    got = run_ranks(_initialize_rank, 1, env, REPO_ID + "@v1", timeout=120)[0]
    ids, labels = batches(1, 2, 16, offline["vocab"])[0]
    with torch.no_grad():
        want = float(offline["models"]["v1"](input_ids=ids, labels=labels).loss)
    assert got == pytest.approx(want, rel=1e-5)


def _train_rank(rank: int, env: dict, config_path: str) -> None:
    os.environ.update(env)
    from ds_mp.training import loop

    assert loop.main(["--deepspeed_config", config_path, "--model", REPO_ID]) == 0


def test_training_loop_model_flag_accepts_an_id(offline, tmp_path):
    from transformers import GPT2LMHeadModel

    cfg = train_config(str(tmp_path), offline["data"], pp=1, steps=1,
                       training={"checkpoint_interval": 0, "eval_interval": 0})
    cfg["ds_mp"].pop("model")
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    run_ranks(_train_rank, 1, {"HF_HOME": offline["home"], "HF_HUB_OFFLINE": "1"}, path, timeout=180)
    exported = GPT2LMHeadModel.from_pretrained(str(tmp_path / "run" / "hf"))
    assert exported.config.n_embd == offline["models"]["main"].config.n_embd   # fine-tuned the Hub model
    assert os.path.isfile(tmp_path / "run" / "hf" / "tokenizer.json")
