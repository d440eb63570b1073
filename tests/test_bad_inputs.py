"""Bad-input catalogue: each case exits non-zero with one line naming the problem and the
fix, before any collective (so no rank can hang), and leaves no half-written output.

Every case runs ``ds_mp.training.loop.main`` (or a ``ds-mp`` subcommand) in-process with the
environment of rank 0 of a 2-rank launch; a handful also run through the real launcher
on 2 ranks, where the whole job must be gone quickly: about 15-25 s here, almost all of
it process start-up and imports.  The ranks' collective timeout is raised to 900 s there, so a
rank waiting on a peer would outlive the 240 s the test allows by far: the bound separates a
fast failure from a hang with room for a loaded 2-core machine (60 s flaked under load).
"""
from __future__ import annotations

import copy
import json
import os
import time

import pytest
from launcher_utils import TINY_MODEL, launch, tiny_dataset, train_config

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(str(tmp_path_factory.mktemp("bad")))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from helpers import tiny_gpt2

    out = str(tmp_path_factory.mktemp("hf") / "model")
    tiny_gpt2(n_layer=2, n_embd=32, n_head=4, vocab=512).save_pretrained(out)
    return out


def _set(cfg: dict, dotted: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    *head, last = dotted.split(".")
    for key in head:
        node = node.setdefault(key, {})
    node[last] = value
    return cfg


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# (case id, how to break a good config / the setup, words the one-line error must contain)
CASES = {
    "unknown_key_near_miss": (lambda c, t, d, h: _set(c, "ds_mp.tensor_paralel", {"size": 1}), ["tensor_paralel", "tensor_parallel"]),
    "unknown_nested_key": (lambda c, t, d, h: _set(c, "ds_mp.pipeline.stage", 2), ["pipeline.stage", "stages"]),
    "wrong_type": (lambda c, t, d, h: _set(c, "ds_mp.tensor_parallel.size", "2"), ["tensor_parallel.size", "integer"]),
    "zero_stages": (lambda c, t, d, h: _set(c, "ds_mp.pipeline.stages", 0), ["pipeline.stages", ">= 1"]),
    "negative_steps": (lambda c, t, d, h: _set(c, "ds_mp.training.steps", -5), ["training.steps", ">= 1"]),
    "tp_not_dividing_heads": (lambda c, t, d, h: _set(_set(c, "ds_mp.pipeline.stages", 1), "ds_mp.tensor_parallel.size", 3), ["tensor_parallel.size", "n_head"]),
    "world_size_mismatch": (lambda c, t, d, h: _set(c, "ds_mp.tensor_parallel.size", 2), ["world size 2", "tensor_parallel.size"]),
    "more_stages_than_blocks": (lambda c, t, d, h: _set(c, "ds_mp.model.n_layer", 1), ["pipeline.stages", "blocks"]),
    "slices_not_summing": (lambda c, t, d, h: _set(_set(c, "ds_mp.pipeline.schedule", "terapipe"), "ds_mp.terapipe.slices", [8, 8]), ["terapipe.slices", "sum"]),
    "unknown_schedule": (lambda c, t, d, h: _set(c, "ds_mp.pipeline.schedule", "gpipee"), ["pipeline.schedule", "gpipe"]),
    "ouroboros_k_below_2": (lambda c, t, d, h: _set(_set(c, "ds_mp.pipeline.schedule", "ouroboros"), "ds_mp.ouroboros.modules", 1), ["ouroboros.modules", "2"]),
    "ouroboros_too_many_ranks": (lambda c, t, d, h: _set(_set(_set(c, "ds_mp.pipeline.schedule", "ouroboros"), "ds_mp.ouroboros.modules", 3), "ds_mp.model.n_layer", 2), ["ouroboros.modules", "n_layer"]),
    "partition_wrong_sum": (lambda c, t, d, h: _set(c, "ds_mp.pipeline.partition", [1, 1]), ["pipeline.partition", "sum"]),
    "seq_len_over_positions": (lambda c, t, d, h: _set(c, "ds_mp.data.seq_len", 128), ["data.seq_len", "n_positions"]),
    "zero_micro_batch": (lambda c, t, d, h: _set(c, "train_micro_batch_size_per_gpu", 0), ["train_micro_batch_size_per_gpu"]),
    "bad_on_nan": (lambda c, t, d, h: _set(c, "ds_mp.training.on_nan", "ignore"), ["training.on_nan", "stop"]),
    "sp_seq_not_divisible": (lambda c, t, d, h: _set(_set(_set(_set(c, "ds_mp.pipeline.stages", 1), "ds_mp.tensor_parallel.size", 2), "ds_mp.tensor_parallel.sequence_parallel", True), "ds_mp.data.seq_len", 31), ["sequence_parallel", "divisible"]),
    "model_dir_without_config": (lambda c, t, d, h: (os.makedirs(os.path.join(t, "nocfg")), _set(c, "ds_mp.model", os.path.join(t, "nocfg")))[1], ["ds_mp.model", "config.json"]),
    "model_config_not_gpt2": (lambda c, t, d, h: _set(c, "ds_mp.model", t), ["ds_mp.model", "n_layer"]),
    "truncated_safetensors": (lambda c, t, d, h: (_truncate(os.path.join(_copy(h, t), "model.safetensors")), _set(c, "ds_mp.model", os.path.join(t, "m")))[1], ["model.safetensors"]),
    "checkpoint_of_another_shape": (lambda c, t, d, h: _set(c, "ds_mp.model", _reshape(_copy(h, t))), ["shape"]),
    "tokenizer_vocab_mismatch": (lambda c, t, d, h: _set(c, "ds_mp.model.vocab_size", 300), ["vocab", "300"]),
    "empty_data_dir": (lambda c, t, d, h: (os.makedirs(os.path.join(t, "empty"), exist_ok=True), _set(c, "ds_mp.data.path", os.path.join(t, "empty")))[1], ["empty"]),
    "missing_data_dir": (lambda c, t, d, h: _set(c, "ds_mp.data.path", os.path.join(t, "nope")), ["nope"]),
    "data_shorter_than_sequence": (lambda c, t, d, h: _set(_set(_set(c, "ds_mp.data.path", _small_data(t)), "ds_mp.data.seq_len", 60), "ds_mp.model.n_positions", 64), ["sequence"]),
    "output_dir_is_a_file": (lambda c, t, d, h: (open(os.path.join(t, "afile"), "w").close(), _set(c, "ds_mp.training.output_dir", os.path.join(t, "afile")))[1], ["output_dir", "file"]),
}


def _copy(src: str, tmp: str) -> str:
    import shutil

    dst = os.path.join(tmp, "m")
    shutil.copytree(src, dst)
    return dst


def _reshape(model_dir: str) -> str:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["n_embd"] = 64  # weights are 32 wide
    with open(path, "w") as f:
        json.dump(cfg, f)
    return model_dir


def _small_data(tmp: str) -> str:
    from ds_mp.data import prepare_data

    src = os.path.join(tmp, "small")
    os.makedirs(src)
    for i in range(4):
        with open(os.path.join(src, f"d{i}.txt"), "w") as f:
            f.write("tiny doc %d" % i)
    out = os.path.join(tmp, "smalldata")
    prepare_data([src], out, tokenizer=os.path.join(_TINY_DATA[0], "tokenizer"), val_fraction=0.5,
                 show_progress=False)
    return out


_TINY_DATA: list[str] = []


def _run_main(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    from ds_mp.training.loop import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ds_mp: error:")]
    return rc, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_training_input(case, tmp_path, data, hf_dir, capsys, monkeypatch):
    _TINY_DATA[:] = [data]
    good = train_config(str(tmp_path), data)  # 2 ranks: PP=2, 4 blocks, seq 32
    good["ds_mp"]["model"] = dict(TINY_MODEL)
    mutate, words = CASES[case]
    cfg = mutate(good, str(tmp_path), data, hf_dir)
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    rc, err = _run_main(["--deepspeed_config", path], capsys, monkeypatch)
    assert rc != 0
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], (w, err[0])
    assert not os.path.exists(os.path.join(str(tmp_path), "run")), "output written by a failed run"


def test_malformed_json(tmp_path, capsys, monkeypatch):
    path = os.path.join(str(tmp_path), "bad.json")
    with open(path, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 2,, }')
    rc, err = _run_main(["--deepspeed_config", path], capsys, monkeypatch)
    assert rc != 0 and len(err) == 1 and "not valid JSON" in err[0] and "line 1" in err[0]


def test_missing_config_file(tmp_path, capsys, monkeypatch):
    rc, err = _run_main(["--deepspeed_config", os.path.join(str(tmp_path), "none.json")], capsys, monkeypatch)
    assert rc != 0 and len(err) == 1 and "not found" in err[0]


def test_resume_without_checkpoint(tmp_path, data, capsys, monkeypatch):
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(train_config(str(tmp_path), data), f)
    rc, err = _run_main(["--deepspeed_config", path, "--resume"], capsys, monkeypatch)
    assert rc != 0 and len(err) == 1 and "--resume" in err[0]


def test_prepare_data_non_utf8_and_file_out(tmp_path, capsys):
    from ds_mp.tools.cli import main

    bad = os.path.join(str(tmp_path), "bad.txt")
    with open(bad, "wb") as f:
        f.write(b"caf\xe9 \xff\xfe text")
    out = os.path.join(str(tmp_path), "out")
    assert main(["prepare-data", bad, "--out", out, "--vocab-size", "300", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.txt" in err[0] and "UTF-8" in err[0]
    assert not os.path.exists(out)
    afile = os.path.join(str(tmp_path), "afile")
    open(afile, "w").close()
    good = os.path.join(str(tmp_path), "good.txt")
    with open(good, "w") as f:
        f.write("hello world\n")
    assert main(["prepare-data", good, "--out", afile, "--vocab-size", "300", "--no-progress"]) != 0
    assert "file" in capsys.readouterr().err


def test_unknown_cli_command(capsys):
    from ds_mp.tools.cli import main

    assert main(["conver"]) == 2
    assert "did you mean 'convert'" in capsys.readouterr().err


def test_convert_missing_input(tmp_path, capsys):
    from ds_mp.tools.cli import main

    rc = main(["convert", "hf-to-ds", os.path.join(str(tmp_path), "none"), os.path.join(str(tmp_path), "o"),
               "--tp", "2", "--pp", "1"])
    assert rc != 0 and "none" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(str(tmp_path), "o"))


@pytest.mark.launcher  # not serial: its 240 s bound is 10x the 15-25 s a case takes, room for a second worker's load
@pytest.mark.parametrize("case", ["world_size_mismatch", "truncated_safetensors", "tokenizer_vocab_mismatch",
                                  "unknown_key_near_miss"])
def test_bad_input_on_two_ranks_exits_fast(case, tmp_path, data, hf_dir):
    _TINY_DATA[:] = [data]
    mutate, words = CASES[case]
    cfg = mutate(train_config(str(tmp_path), data), str(tmp_path), data, hf_dir)
    t0 = time.time()
    proc = launch(str(tmp_path), cfg, timeout=300, collective_timeout=900)
    assert proc.returncode != 0
    assert time.time() - t0 < 240
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ds_mp: error:")]
    assert lines and all(w in lines[0] for w in words), proc.stderr[-2000:]
    assert not os.path.exists(os.path.join(str(tmp_path), "run"))
