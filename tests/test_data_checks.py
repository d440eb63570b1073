"""Bad data refused at open and at the first stage (issue 36, items 5 and 8).

* a token file with an id >= the model's vocab, or >= its own tokenizer's vocab, is refused by
  the training loop before any collective, in one line naming the file, the id and the vocab;
  the largest id is found in one streamed pass and cached (``token_stats.json``);
* a dataset encoded by another tokenizer than the model directory's is warned about;
* ids outside the vocabulary never reach the embedding, at TP = 1 (an ``IndexError`` before)
  and TP = 2 (masked to a zero row before): one ``TokenIdError`` line;
* a damaged ``meta.json`` is one line naming it; ``ds-mp prepare-data`` on a full disk is one
  line and leaves no dataset behind.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import sys

import numpy as np
import pytest
from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2
from launcher_utils import tiny_dataset, train_config

from ds_mp.data import DataError, TokenDataset, train_tokenizer
from ds_mp.data import checks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("checks")))


def _copy_with_id(data: str, tmp: str, token_id: int, split_file: str = "tokens.bin") -> str:
    """A copy of ``data`` whose token file ``split_file`` holds ``token_id`` in one place."""
    out = os.path.join(tmp, f"data{token_id}")
    shutil.copytree(data, out)
    tokens = np.memmap(os.path.join(out, split_file), dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = token_id
    tokens.flush()
    return out


def _main(tmp: str, cfg: dict, capsys, monkeypatch) -> tuple[int, list[str]]:
    """``ds_mp.training.loop.main`` as rank 0 of 2 (it must fail before any collective)."""
    from ds_mp.training.loop import main

    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc = main(["--deepspeed_config", path])
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.startswith("ds_mp: error:")]


@pytest.mark.parametrize("token_id, split_file, words", [
    (600, "tokens.bin", ["tokens.bin", "600", "vocab_size 512"]),   # beyond the model's vocab (512)
    (450, "val_tokens.bin", ["val_tokens.bin", "450", "vocab_size 400"]),  # beyond the dataset's (400) only
])
def test_token_id_beyond_vocab_refused_at_open(data, tmp_path, capsys, monkeypatch, token_id, split_file, words):
    bad = _copy_with_id(data, str(tmp_path), token_id, split_file)
    cfg = train_config(str(tmp_path), bad)
    rc, err = _main(str(tmp_path), cfg, capsys, monkeypatch)
    assert rc == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err[0]
    assert not os.path.exists(os.path.join(str(tmp_path), "run"))


def test_max_id_is_one_pass_then_cached(data, tmp_path, monkeypatch):
    """The first open scans (in chunks), later opens read the cache; a changed file is scanned
    again; a read-only dataset caches under the cache dir."""
    copy = _copy_with_id(data, str(tmp_path), 399)
    scans: list[int] = []
    real = checks._scan_max
    monkeypatch.setattr(checks, "_scan_max", lambda t: scans.append(len(t)) or real(t))
    monkeypatch.setattr(checks, "CHUNK_TOKENS", 1000)  # several chunks
    ds = TokenDataset(copy)
    assert checks.max_token_id(ds) == 399 and len(scans) == 1
    assert checks.max_token_id(TokenDataset(copy)) == 399 and len(scans) == 1  # cached
    assert "tokens.bin" in json.load(open(os.path.join(copy, checks.STATS_FILE)))
    tokens = np.memmap(os.path.join(copy, "tokens.bin"), dtype=np.uint16, mode="r+")
    tokens[3] = 398  # same size; the mtime moves
    tokens[len(tokens) // 2] = 7
    tokens.flush()
    os.utime(os.path.join(copy, "tokens.bin"), ns=(1, 1))
    assert checks.max_token_id(TokenDataset(copy)) == max(int(np.max(tokens)), 398) and len(scans) == 2
    os.remove(os.path.join(copy, checks.STATS_FILE))
    cache = os.path.join(str(tmp_path), "cache")
    monkeypatch.setattr(checks, "write_text_atomic", _read_only)
    checks.max_token_id(TokenDataset(copy), cache)
    assert len(scans) == 3 and not os.path.exists(os.path.join(copy, checks.STATS_FILE))


def _read_only(path: str, text: str) -> None:
    if "token_stats/" not in path:
        raise PermissionError(errno.EACCES, "Permission denied", path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_tokenizer_of_another_model_is_warned(data, tmp_path):
    info = TokenDataset(data).info
    same = os.path.join(str(tmp_path), "same")
    tiny_gpt2(vocab=512).save_pretrained(same)
    shutil.copytree(info.tokenizer_dir, same, dirs_exist_ok=True)
    assert checks.tokenizer_mismatch(info, same) is None
    other = os.path.join(str(tmp_path), "other")
    tiny_gpt2(vocab=512).save_pretrained(other)
    train_tokenizer(["other text, other merges " * 20, "zzz yyy xxx"], 400, other)
    line = checks.tokenizer_mismatch(info, other)
    assert line is not None and "\n" not in line
    assert info.tokenizer_dir in line and other in line  # both names
    assert checks.tokenizer_mismatch(info, os.path.join(str(tmp_path), "nothing")) is None  # no tokenizer.json


def _loop_with_model(rank: int, cfg_path: str) -> str:
    """Rank program: the training loop on one rank; returns what it wrote to stderr."""
    from ds_mp.training.loop import main

    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        assert main(["--deepspeed_config", cfg_path]) == 0
        return sys.stderr.getvalue()
    finally:
        sys.stderr = err


def test_training_loop_warns_about_the_tokenizer(data, tmp_path):
    model = os.path.join(str(tmp_path), "model")
    tiny_gpt2(n_layer=2, n_embd=32, n_head=4, vocab=512).save_pretrained(model)
    train_tokenizer(["some other corpus entirely " * 20], 300, model)
    cfg = train_config(str(tmp_path), data, pp=1, steps=1, training={"export_hf": False, "eval_interval": 0})
    cfg["ds_mp"]["model"] = model
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    err = run_ranks(_loop_with_model, 1, path, timeout=240)[0]
    warnings = [x for x in err.splitlines() if x.startswith("ds_mp: warning:")]
    assert len(warnings) == 1 and model in warnings[0], err[-2000:]


# --- the first stage's input check ------------------------------------------------------------
def _embed_bad_ids(rank: int, tp: int, bad: int) -> str:
    import ds_mp
    from ds_mp.models.token_ids import TokenIdError

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=ds_config(tp=tp, micro=2, gas=1))
    mbs = batches(1, 2, 16, 203, seed=rank)
    mbs[0][0][1, 5] = bad  # one id of one row
    try:
        engine.train_batch(iter(mbs))
    except TokenIdError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("tp, bad", [(1, 203), (1, 300), (2, 203), (2, 300), (1, -1)])
def test_out_of_range_ids_never_reach_the_embedding(tp, bad):
    """Vocab 203 (padded to 256): 203 would train a padding row at every TP, 300 be masked to a
    zero row at TP = 2 and fail inside F.embedding at TP = 1."""
    for msg in run_ranks(_embed_bad_ids, tp, tp, bad, timeout=180):
        assert f"token id {bad}" in msg and "[0, 203)" in msg and "\n" not in msg, msg


# --- item 8: meta.json and a full disk -------------------------------------------------------
@pytest.mark.parametrize("content, words", [
    ("{not json", ["meta.json", "unreadable"]),
    ('{"format_version": 1, "dtype": "uint16"}', ["meta.json", "missing keys", "vocab_size"]),
    ("[1, 2]", ["meta.json", "list"]),
])
def test_bad_meta_json_is_one_line(data, tmp_path, capsys, monkeypatch, content, words):
    copy = os.path.join(str(tmp_path), "d")
    shutil.copytree(data, copy)
    with open(os.path.join(copy, "meta.json"), "w") as f:
        f.write(content)
    with pytest.raises(DataError) as e:
        TokenDataset(copy)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
    rc, err = _main(str(tmp_path), train_config(str(tmp_path), copy), capsys, monkeypatch)
    assert rc == 2 and len(err) == 1 and os.path.join(copy, "meta.json") in err[0], err


def test_prepare_data_on_a_full_disk(tmp_path, capsys, monkeypatch):
    """ENOSPC while the token files are written: one line, exit 2, and neither the output nor
    its temporary folder is left."""
    from ds_mp.data import prepare as prepare_mod
    from ds_mp.tools.cli import main

    src = os.path.join(str(tmp_path), "corpus.txt")
    with open(src, "w") as f:
        f.write("def f(x):\n    return x + 1\n" * 200)
    real_open = open

    class FullDisk(io.FileIO):
        """A binary file on a disk that fills up after 100 bytes."""

        def write(self, b) -> int:
            if self.tell() + len(b) > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        return FullDisk(path, mode) if mode == "wb" else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(prepare_mod, "open", open_on_full_disk, raising=False)
    out = os.path.join(str(tmp_path), "out")
    rc = main(["prepare-data", src, src, src, "--out", out, "--vocab-size", "300", "--val-fraction", "0",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "No space left" in err[0] and out in err[0], err
    assert os.listdir(str(tmp_path)) == ["corpus.txt"], os.listdir(str(tmp_path))
