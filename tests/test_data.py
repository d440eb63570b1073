"""Tests for ds_mp.data: tokenizer, prepare_data, samplers, errors, atomic output."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from ds_mp.data import (EOS_TOKEN, ChunkSampler, DataError, DatasetInfo, TokenDataset, ValidationBatches,
                        ensure_default_dataset, prepare_data, prepare_data_cli, stdlib_files)
from ds_mp.data import prepare as prepare_mod

WORDS = ["alpha", "beta", "gamma", "delta", "über", "naïve", "日本", "x=1;", "\n", "  ", "(", ")", "def", "😀"]


def make_docs(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def write_txt(folder, docs: list[str]) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, d in enumerate(docs):
        p = os.path.join(folder, f"d{i:03d}.txt")
        with open(p, "w", encoding="utf-8") as f:
            f.write(d)
        paths.append(p)
    return paths


def build(tmp_path, docs, name="ds", **kw) -> DatasetInfo:
    kw = {"vocab_size": 300, "val_fraction": 0.0, "show_progress": False, **kw}
    return prepare_data([str(tmp_path / "src")] if docs is None else write_txt(tmp_path / "src", docs),
                        str(tmp_path / name), **kw)


def decode(info: DatasetInfo, ids) -> str:
    tok = AutoTokenizer.from_pretrained(info.tokenizer_dir)
    return tok.decode(list(map(int, ids)), clean_up_tokenization_spaces=False)


# --- prepare_data -------------------------------------------------------------------
def test_round_trip_and_eos_between_documents(tmp_path):
    docs = make_docs(6) + [f"has a literal {EOS_TOKEN} inside"]
    info = build(tmp_path, docs)
    assert info.dtype == "uint16" and info.eos_id == 0 and info.vocab_size <= 300
    tok = AutoTokenizer.from_pretrained(info.tokenizer_dir)
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == info.eos_id
    tokens = np.asarray(TokenDataset(info.path).tokens)
    assert len(tokens) == info.train_tokens
    assert decode(info, tokens) == EOS_TOKEN.join(docs)
    # exactly n-1 separators, none at the ends, and each piece is one document
    cuts = np.flatnonzero(tokens == info.eos_id)
    assert len(cuts) == len(docs) - 1 and cuts[0] > 0 and cuts[-1] < len(tokens) - 1
    pieces = np.split(tokens, cuts)
    assert [decode(info, p[1:] if i else p) for i, p in enumerate(pieces)] == docs


def test_val_split_holds_out_whole_documents(tmp_path):
    docs = make_docs(8)
    info = build(tmp_path, docs, val_fraction=0.25, seed=3)
    assert (info.train_documents, info.val_documents) == (6, 2)
    train = decode(info, TokenDataset(info.path).tokens).split(EOS_TOKEN)
    val = decode(info, TokenDataset(info.path, "val").tokens).split(EOS_TOKEN)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert train == [d for d in docs if d in train]  # corpus order kept
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["val_tokens"] == info.val_tokens and len(meta["source_files"]) == 8 and len(meta["sha256"]) == 64


def test_jsonl_and_folders(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a.jsonl").write_text('{"text": "first doc"}\n\n{"text": "second\\ndoc"}\n{"text": ""}\n', encoding="utf-8")
    (src / "b" / "c.txt").write_text("third doc", encoding="utf-8")
    (src / "ignored.csv").write_text("x,y", encoding="utf-8")
    info = build(tmp_path, None)
    assert decode(info, TokenDataset(info.path).tokens) == EOS_TOKEN.join(["first doc", "second\ndoc", "third doc"])
    assert [os.path.basename(f) for f in info.source_files] == ["a.jsonl", "c.txt"]


def test_existing_tokenizer_and_max_bytes(tmp_path):
    docs = make_docs(5)
    first = build(tmp_path, docs)
    again = prepare_data([str(tmp_path / "src")], str(tmp_path / "ds2"), tokenizer=first.tokenizer_dir,
                         val_fraction=0.0, show_progress=False)
    assert again.tokenizer_source == first.tokenizer_dir
    assert np.array_equal(TokenDataset(first.path).tokens, TokenDataset(again.path).tokens)
    cut = prepare_data([str(tmp_path / "src")], str(tmp_path / "ds3"), tokenizer=first.tokenizer_dir,
                       max_bytes=100, val_fraction=0.0, show_progress=False)
    text = decode(cut, TokenDataset(cut.path).tokens)
    assert text.replace(EOS_TOKEN, "").encode() == "".join(docs).encode()[:100]


# --- errors and atomicity -------------------------------------------------------------
def test_errors(tmp_path):
    with pytest.raises(DataError, match="no inputs"):
        prepare_data([], str(tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl files found"):
        prepare_data([str(tmp_path / "empty")], str(tmp_path / "o"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok text \xff\xfe broken")
    with pytest.raises(DataError, match=r"bad\.txt.*not valid UTF-8.*replace"):
        prepare_data([str(bad)], str(tmp_path / "o"), vocab_size=300, val_fraction=0)
    info = prepare_data([str(bad)], str(tmp_path / "o"), vocab_size=300, val_fraction=0,
                        encoding_errors="replace", show_progress=False)
    assert "\ufffd" in decode(info, TokenDataset(info.path).tokens)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="exists and is a file"):
        prepare_data([str(bad)], str(tmp_path / "afile"))
    with pytest.raises(DataError, match="already exists"):
        prepare_data([str(bad)], str(tmp_path / "o"), encoding_errors="replace")
    with pytest.raises(DataError, match="leaves no training documents"):
        prepare_data([str(bad)], str(tmp_path / "o2"), encoding_errors="replace", val_fraction=0.5)
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"j\.jsonl:2: invalid JSON"):
        prepare_data([str(tmp_path / "j.jsonl")], str(tmp_path / "o3"))


def test_failure_midway_leaves_no_output(tmp_path, monkeypatch):
    class Boom:
        def encode_batch(self, *a, **k):
            raise RuntimeError("disk full")

    monkeypatch.setattr(prepare_mod, "data_encoder", lambda tok: Boom())
    with pytest.raises(RuntimeError, match="disk full"):
        build(tmp_path, make_docs(3))
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no out_dir, no temp dir left behind


def test_cli(tmp_path, capsys):
    write_txt(tmp_path / "src", make_docs(4))
    out = str(tmp_path / "cli")
    assert prepare_data_cli([str(tmp_path / "src"), "--out", out, "--vocab-size", "300", "--val-fraction", "0.25",
                             "--no-progress"]) == 0
    assert DatasetInfo.load(out).val_documents == 1
    assert prepare_data_cli([str(tmp_path / "nope"), "--out", out + "2"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_default_corpus_small(tmp_path):
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files, key=lambda p: p.split(os.sep))
    assert not any(f"{os.sep}test{os.sep}" in f or os.path.basename(f).startswith("test_") for f in files)
    path = ensure_default_dataset(str(tmp_path), vocab_size=300, max_bytes=50_000)
    info = DatasetInfo.load(path)
    assert ensure_default_dataset(str(tmp_path), vocab_size=300, max_bytes=50_000) == path  # cached
    text = decode(info, TokenDataset(path).tokens) + decode(info, TokenDataset(path, "val").tokens)
    eos_count = info.train_documents - 1 + info.val_documents - 1
    assert len(text.replace(EOS_TOKEN, "").encode()) <= 50_000 and text.count(EOS_TOKEN) == eos_count


# --- samplers on a synthetic dataset: token t sits at position t ---------------------
def fake_dataset(path, num_tokens: int) -> str:
    os.makedirs(path)
    np.arange(num_tokens, dtype=np.uint32).tofile(os.path.join(path, "tokens.bin"))
    np.arange(10, dtype=np.uint32).tofile(os.path.join(path, "val_tokens.bin"))
    info = DatasetInfo(path=str(path), dtype="uint32", vocab_size=1 << 20, eos_id=0, train_tokens=num_tokens,
                       val_tokens=10, train_documents=1, val_documents=1, sha256="0" * 64)
    (path / "meta.json").write_text(info.to_json())
    return str(path)


SEQ = 4


def chunk_ids(batches) -> list[int]:
    out = []
    for ids, labels in batches:
        assert torch.equal(ids, labels) and ids.dtype == torch.long and ids.shape[1] == SEQ
        out += (ids[:, 0] // SEQ).tolist()
    return out


@pytest.fixture
def ds(tmp_path) -> TokenDataset:
    return TokenDataset(fake_dataset(tmp_path / "fake", 96 * SEQ + 3))  # 96 chunks, 3 tokens dropped


def test_sampler_determinism(ds):
    a = ChunkSampler(ds, SEQ, micro_batch=2, grad_accum=3, seed=1)
    b = ChunkSampler(ds, SEQ, micro_batch=2, grad_accum=3, seed=1)
    c = ChunkSampler(ds, SEQ, micro_batch=2, grad_accum=3, seed=2)
    sa, sb, sc = ([chunk_ids(s.next_step()) for _ in range(4)] for s in (a, b, c))
    assert sa == sb and sa != sc
    first = a.micro_batches(0)
    assert len(first) == 3 and first[0][0].shape == (2, SEQ)
    assert chunk_ids(first) == sa[0]  # random access agrees with the stream


def test_dp_shards_disjoint_and_complete_and_tp_identical(ds):
    mb, ga, dp = 2, 3, 2  # global batch 12 -> 8 steps per epoch of 96 chunks
    seen = []
    for step in range(8):
        per_rank = [chunk_ids(ChunkSampler(ds, SEQ, mb, ga, r, dp, seed=5).micro_batches(step)) for r in range(dp)]
        assert not set(per_rank[0]) & set(per_rank[1])
        seen += per_rank[0] + per_rank[1]
    assert sorted(seen) == list(range(96))
    # other TP ranks / pipeline stages with the same DP rank get the same batches
    tp0, tp1 = (ChunkSampler(ds, SEQ, mb, ga, 1, dp, seed=5) for _ in range(2))
    for _ in range(10):
        assert chunk_ids(tp0.next_step()) == chunk_ids([next(tp1) for _ in range(ga)])


def test_epochs_straddle_without_dropping(ds):
    s = ChunkSampler(ds, SEQ, micro_batch=5, grad_accum=2, seed=0)  # 10 per step, 96 chunks
    ids = [i for _ in range(48) for i in chunk_ids(s.next_step())]  # 480 samples = 5 epochs
    assert np.bincount(ids).tolist() == [5] * 96 and s.epoch == 5
    assert sorted(ids[:96]) == list(range(96)) and ids[:96] != ids[96:192]


def test_resume_mid_epoch_and_mid_step(ds):
    ref = ChunkSampler(ds, SEQ, 2, 3, 0, 2, seed=7)
    stream = [chunk_ids([next(ref)]) for _ in range(60)]  # 20 steps: crosses epoch boundaries
    run = ChunkSampler(ds, SEQ, 2, 3, 0, 2, seed=7)
    for _ in range(3):
        run.next_step()
    for _ in range(2):
        next(run)  # stop two micro-batches into step 4
    state = json.loads(json.dumps(run.state_dict()))
    assert state["micro_step"] == 2
    resumed = ChunkSampler(ds, SEQ, 2, 3, 0, 2, seed=7)
    resumed.load_state_dict(state)
    assert [chunk_ids([next(resumed)]) for _ in range(49)] == stream[11:]
    at_step = ChunkSampler(ds, SEQ, 2, 3, 0, 2, seed=7)
    at_step.set_step(15)
    assert chunk_ids(at_step.next_step()) == sum(stream[45:48], [])
    with pytest.raises(DataError, match="seed"):
        ChunkSampler(ds, SEQ, 2, 3, 0, 2, seed=8).load_state_dict(state)


def test_validation_batches(ds):
    val = TokenDataset(ds.info.path, "val")
    with pytest.raises(DataError, match="fewer than one sequence"):
        ValidationBatches(val, seq_len=11, micro_batch=1)
    v = ValidationBatches(ds, SEQ, micro_batch=4, num_batches=3, dp_rank=1, dp_size=2)
    assert len(v) == 3 and chunk_ids(v) == chunk_ids(v) == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert len(ValidationBatches(ds, SEQ, micro_batch=10)) == 9
    assert chunk_ids(ValidationBatches(ds, SEQ, 10, num_batches=10))[-10:] == [90, 91, 92, 93, 94, 95, 0, 1, 2, 3]


def test_dataset_shorter_than_one_sequence(tmp_path):
    small = TokenDataset(fake_dataset(tmp_path / "small", 5))
    with pytest.raises(DataError, match="5 tokens, fewer than one sequence"):
        ChunkSampler(small, seq_len=8, micro_batch=1)
    with pytest.raises(DataError, match="dp_rank"):
        ChunkSampler(small, seq_len=2, micro_batch=1, dp_rank=2, dp_size=2)


def test_resume_at_another_dp_repeats_and_skips_nothing(ds):
    """Issue 16: 5 steps at DP 2 (global batch 8), resume from the checkpointed client state
    at DP 3 (global batch 12): every sample consumed before and after is distinct and together
    they are exactly the stream's prefix (``set_step`` alone would restart at 5 × 12 = 60)."""
    from ds_mp.training.loop import restore_sampler

    mb, ga = 2, 2
    before = [ChunkSampler(ds, SEQ, mb, ga, r, 2, seed=3) for r in range(2)]
    taken = []
    for _ in range(5):
        for s in before:
            taken += chunk_ids(s.next_step())
    client = json.loads(json.dumps({"step": 5, "sampler": before[0].state_dict()}))
    assert client["sampler"]["consumed_samples"] == 40
    after = [ChunkSampler(ds, SEQ, mb, ga, r, 3, seed=3) for r in range(3)]
    for s in after:
        restore_sampler(s, client, client["step"])
    for _ in range(4):  # 48 more samples: 88 of 96, one epoch
        for s in after:
            taken += chunk_ids(s.next_step())
    assert len(taken) == len(set(taken)) == 88
    stream = ChunkSampler(ds, SEQ, 88, 1, seed=3)
    assert sorted(taken) == sorted(chunk_ids(stream.next_step()))
    legacy = ChunkSampler(ds, SEQ, mb, ga, 0, 3, seed=3)
    restore_sampler(legacy, {"step": 5}, 5)  # an old checkpoint: step × the new global batch
    assert legacy.consumed_samples == 60
    mid = ChunkSampler(ds, SEQ, mb, ga, 0, 2, seed=3)
    next(mid)  # one micro-batch into a step
    with pytest.raises(DataError, match="mid-step"):
        ChunkSampler(ds, SEQ, mb, ga, 0, 3, seed=3).load_state_dict(mid.state_dict())
