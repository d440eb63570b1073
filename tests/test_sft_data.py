"""SFT data: record formats and their loss masks, prepare-data errors, packing, rows, the SFT sampler."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from ds_mp.config import ConfigError, load_config
from ds_mp.data import (DataError, DatasetInfo, SftDataset, SftRows, SftSampler, TokenDataset, prepare_data_cli,
                        prepare_sft_data, step_tokens)
from ds_mp.data.packing import best_fit_decreasing
from ds_mp.data.sft_format import encode_record
from sft_utils import LLAMA3, LLAMA3_TOKENS, chat_tokenizer, conversations, sentence, write_jsonl


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tok") / "chatml")
    chat_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def chat_ds(tmp_path_factory, tok_dir) -> DatasetInfo:
    root = tmp_path_factory.mktemp("chat")
    src = write_jsonl(str(root / "chats.jsonl"), [{"messages": m} for m in conversations(120)])
    return prepare_sft_data([src], str(root / "ds"), tok_dir, "chat", val_fraction=0.1, show_progress=False)


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory, tok_dir) -> DatasetInfo:
    """Every token a target: only the row builder keeps a document's first token out of the loss."""
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(1)
    src = write_jsonl(str(root / "t.jsonl"), [{"text": sentence(rng, rng.randint(1, 30))} for _ in range(80)])
    return prepare_sft_data([src], str(root / "ds"), tok_dir, "text", val_fraction=0, show_progress=False)


# --- formats and masks ------------------------------------------------------------------
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_chat_mask_equals_hf_generation_markers(tmp_path, template):
    """Outside oracle: HF's assistant mask from the template's {% generation %} markers. ds_mp finds the
    targets without the markers (prefix renderings), so it must agree on templates that have them."""
    tok = chat_tokenizer(str(tmp_path / "t")) if template == "chatml" else \
        chat_tokenizer(str(tmp_path / "t"), LLAMA3, LLAMA3_TOKENS)
    for msgs in conversations(25, seed=3):
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encode_record(tok, "chat", {"messages": msgs}, "x")
        assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
        assert sum(mask) > 0


def test_chat_targets_are_content_and_end_of_turn(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "why is sky blue"}, {"role": "assistant", "content": "print 42"},
            {"role": "user", "content": "add"}, {"role": "assistant", "content": "sorted list"}]
    ids, mask = encode_record(tok, "chat", {"messages": msgs}, "x")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "print 42<|im_end|>sorted list<|im_end|>"


def test_prompt_completion_and_text_masks(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids, mask = encode_record(tok, "prompt-completion", {"prompt": "why is sky", "completion": " blue ."}, "x")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == " blue .<|endoftext|>"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == "why is sky"
    ids, mask = encode_record(tok, "text", {"text": "def add"}, "x")
    assert ids[-1] == tok.eos_token_id and all(mask)


def test_prepare_writes_tokens_mask_and_boundaries(chat_ds, tok_dir):
    info = chat_ds
    assert info.format == "chat" and info.train_documents + info.val_documents == 120
    assert DatasetInfo.load(info.path).sft["train_targets"] == info.sft["train_targets"]
    ds = SftDataset(TokenDataset(info.path))
    tok = AutoTokenizer.from_pretrained(info.tokenizer_dir)
    assert tok.chat_template  # the dataset's tokenizer keeps the template it was built with
    for d in range(len(ds)):  # every document ends "<|im_end|>\n": the end-of-turn a target, the newline not
        s, e = ds.offsets[d], ds.offsets[d + 1]
        assert tok.decode(ds.tokens[s:s + 1]) == "<|im_start|>" and tok.decode(ds.tokens[e - 2:e - 1]) == "<|im_end|>"
        assert (ds.mask[e - 2], ds.mask[e - 1]) == (1, 0)
    assert int(ds.mask.sum()) == info.sft["train_targets"]


def test_python_api_list_of_dicts_and_datasets_dataset(tmp_path, tok_dir):
    recs = [{"prompt": sentence(random.Random(i), 5), "completion": sentence(random.Random(-i), 7)} for i in range(20)]
    a = prepare_sft_data(recs, str(tmp_path / "a"), tok_dir, "prompt-completion", val_fraction=0, show_progress=False)
    b = prepare_sft_data([write_jsonl(str(tmp_path / "r.jsonl"), recs)], str(tmp_path / "b"), tok_dir,
                         "prompt-completion", val_fraction=0, show_progress=False)
    assert a.sha256 == b.sha256
    assert np.array_equal(TokenDataset(a.path).tokens, TokenDataset(b.path).tokens)
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list(recs)
    c = prepare_sft_data(table, str(tmp_path / "c"), tok_dir, "prompt-completion", val_fraction=0, show_progress=False)
    table.to_parquet(str(tmp_path / "r.parquet"))
    d = prepare_sft_data([str(tmp_path / "r.parquet")], str(tmp_path / "d"), tok_dir, "prompt-completion",
                         val_fraction=0, show_progress=False)
    for x in (c, d):
        assert np.array_equal(TokenDataset(a.path).tokens, TokenDataset(x.path).tokens)


def test_overlong_records_truncated_or_dropped_and_counted(tmp_path, tok_dir, capsys):
    recs = [{"text": sentence(random.Random(i), 3 if i % 2 else 60)} for i in range(10)]
    src = write_jsonl(str(tmp_path / "t.jsonl"), recs)
    t = prepare_sft_data([src], str(tmp_path / "t"), tok_dir, "text", max_tokens=16, val_fraction=0,
                         show_progress=False)
    assert (t.sft["truncated"], t.sft["dropped"], t.train_documents) == (5, 0, 10)
    assert np.diff(SftDataset(TokenDataset(t.path)).offsets).max() == 16
    assert prepare_data_cli([src, "--out", str(tmp_path / "d"), "--tokenizer", tok_dir, "--format", "text",
                             "--max-tokens", "16", "--overlong", "drop", "--val-fraction", "0", "--no-progress"]) == 0
    assert "0 truncated and 5 dropped over --max-tokens=16" in capsys.readouterr().out
    assert DatasetInfo.load(str(tmp_path / "d")).train_documents == 5


def test_stream_datasets_keep_loading(tmp_path):
    """A pretraining dataset's meta.json from before the SFT formats (no "format" key) loads as a stream."""
    from ds_mp.data import prepare_data

    os.makedirs(tmp_path / "src")
    (tmp_path / "src" / "a.txt").write_text("alpha beta gamma " * 50)
    info = prepare_data([str(tmp_path / "src")], str(tmp_path / "ds"), vocab_size=300, val_fraction=0,
                        show_progress=False)
    meta = tmp_path / "ds" / "meta.json"
    d = json.loads(meta.read_text())
    del d["format"], d["sft"]
    meta.write_text(json.dumps(d))
    assert DatasetInfo.load(info.path).format == "stream"
    with pytest.raises(DataError, match="pretraining \\(stream\\) dataset"):
        SftDataset(TokenDataset(info.path))


BAD = {  # name -> (file lines, extra CLI args, expected text of the one error line; {f} = the file)
    "malformed JSON": (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
                        '{"messages": [}'], [], "{f}:2: invalid JSON"),
    "unknown role": (['{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}'], [],
                     "{f}:1: message 1 has unknown role 'bot'"),
    "no assistant": (['', '{"messages": [{"role": "user", "content": "a"}]}'], [], "{f}:2: conversation has no assistant"),
    "no template": (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'],
                    ["no-template"], "has no chat template; pass one with --chat-template FILE"),
    "all filtered": (['{"messages": [{"role": "user", "content": "why is sky blue why is sky blue"}, '
                      '{"role": "assistant", "content": "b"}]}'], ["--max-tokens", "4", "--overlong", "drop"],
                     "no record left after filtering (1 read, 1 dropped"),
    "missing field": (['{"text": "a"}'], [], '{f}:1: no \'messages\' field'),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_naming_file_and_line(tmp_path, tok_dir, capsys, case):
    lines, extra, expected = BAD[case]
    src = write_jsonl(str(tmp_path / "in.jsonl"), lines)
    tok = tok_dir
    if extra == ["no-template"]:
        t = AutoTokenizer.from_pretrained(tok_dir)
        t.chat_template = None
        t.save_pretrained(str(tmp_path / "plain"))
        tok, extra = str(tmp_path / "plain"), []
    code = prepare_data_cli([src, "--out", str(tmp_path / "o"), "--tokenizer", tok, "--format", "chat",
                             "--val-fraction", "0", "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected.format(f=src) in err, err
    assert not os.path.exists(tmp_path / "o")


def test_config_keys_checked():
    raw = {"ds_mp": {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 320, "n_positions": 64},
                     "data": {"seq_len": 32, "overlong": "cut"}}, "train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="ds_mp.data.overlong: must be 'truncate' or 'drop'"):
        load_config(raw, 1)


# --- packing ------------------------------------------------------------------------------
def _reference_bfd_fills(lengths: np.ndarray, cap: int) -> list[int]:
    """Textbook best-fit decreasing, O(n²): the sorted fill of each row (independent of tie-breaking)."""
    fills: list[int] = []
    for n in sorted(lengths.tolist(), reverse=True):
        fitting = [i for i, f in enumerate(fills) if f + n <= cap]
        if fitting:
            fills[max(fitting, key=lambda i: fills[i])] += n
        else:
            fills.append(n)
    return sorted(fills)


def test_best_fit_decreasing_properties():
    rng = np.random.default_rng(0)
    for trial in range(20):
        cap = int(rng.integers(8, 200))
        lengths = np.minimum(rng.geometric(1 / max(2, cap // 5), size=int(rng.integers(1, 300))), cap)
        rows = best_fit_decreasing(lengths, cap, seed=trial)
        assert sorted(np.concatenate(rows).tolist()) == list(range(len(lengths)))  # every document once, whole
        assert all(lengths[r].sum() <= cap for r in rows)
        assert sorted(int(lengths[r].sum()) for r in rows) == _reference_bfd_fills(lengths, cap)  # best fit
        again = best_fit_decreasing(lengths, cap, seed=trial)
        assert all(np.array_equal(a, b) for a, b in zip(again, rows)) and len(again) == len(rows)  # deterministic
        assert len(best_fit_decreasing(lengths, cap, seed=trial + 100)) == len(rows)  # the count is seed-free


# --- rows and the sampler ------------------------------------------------------------------
def _documents_of(ids, pos, labels, ds: SftDataset, rows: SftRows, row: int) -> None:
    """Check one row against the stored documents: whole, unmixed, positions restarting, labels masked."""
    t = 0
    for d in rows.rows[row]:
        s, n = rows.starts[d], rows.lengths[d]
        assert np.array_equal(ids[t:t + n], ds.tokens[s:s + n])  # the document whole, in one row
        assert np.array_equal(pos[t:t + n], np.arange(n))  # its positions restart at 0
        want = np.where(ds.mask[s:s + n] > 0, ds.tokens[s:s + n].astype(np.int64), -100)
        want[0] = -100  # nothing of this document predicts its first token
        assert np.array_equal(labels[t:t + n], want)
        t += n
    assert np.all(ids[t:] == ds.pad_id) and np.all(labels[t:] == -100) and np.array_equal(pos[t:], np.arange(len(ids) - t))


@pytest.mark.parametrize("fmt", ["chat", "text"])
@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_whole_documents_apart(request, fmt, packing):
    ds = SftDataset(TokenDataset(request.getfixturevalue(f"{fmt}_ds").path))
    rows = SftRows(ds, 256, packing=packing, seed=5)
    (ids, pos), labels = rows.batch(np.arange(rows.num_chunks(256)), 256)
    assert ids.shape == pos.shape == labels.shape == (len(rows.rows), 256)
    for r in range(len(rows.rows)):
        _documents_of(ids[r].numpy(), pos[r].numpy(), labels[r].numpy(), ds, rows, r)
    kept = np.concatenate(rows.rows)
    assert len(kept) == len(np.unique(kept)) == len(ds) - rows.report["dropped"]
    assert int((labels != -100).sum()) == int(rows.row_targets.sum())
    if packing:
        assert rows.report["padding_fraction"] < 0.15 and len(rows.rows) < len(ds) / 2
    else:
        assert len(rows.rows) == len(ds) - rows.report["dropped"]


def test_overlong_documents_at_training_truncated_or_dropped(chat_ds):
    ds = SftDataset(TokenDataset(chat_ds.path))
    lengths = np.diff(ds.offsets)
    seq = int(np.median(lengths))
    t, d = SftRows(ds, seq, overlong="truncate"), SftRows(ds, seq, overlong="drop")
    over = int((lengths > seq).sum())
    assert t.report["overlong"] == d.report["overlong"] == over > 0
    assert d.report["dropped"] == over and t.report["truncated"] + t.report["dropped"] == over
    assert t.lengths.max() == seq
    (ids, pos), labels = t.batch(np.arange(len(t.rows)), seq)
    for r in range(len(t.rows)):
        _documents_of(ids[r].numpy(), pos[r].numpy(), labels[r].numpy(), ds, t, r)
    with pytest.raises(DataError, match="no document left after filtering"):
        SftRows(ds, 4, overlong="drop")


def _stream(sampler: SftSampler, steps: int) -> list[np.ndarray]:
    """Rows of the next ``steps`` steps as whole input_ids arrays, one per micro-batch in order."""
    return [(ids.numpy()) for _ in range(steps) for (ids, _), _ in sampler.next_step()]


def test_sampler_deterministic_and_dp_split_uneven(chat_ds):
    ds = SftDataset(TokenDataset(chat_ds.path))
    rows = SftRows(ds, 80, seed=1)
    one = SftSampler(rows, micro_batch=3, grad_accum=2, dp_size=1, seed=9)
    again = SftSampler(SftRows(ds, 80, seed=1), micro_batch=3, grad_accum=2, dp_size=1, seed=9)
    assert all(np.array_equal(a, b) for a, b in zip(_stream(one, 4), _stream(again, 4)))
    # DP=2 with micro 1 x GA 3 covers the same 6 rows per step as DP=1 with micro 3 x GA 2; disjoint shards
    r0 = SftSampler(rows, micro_batch=1, grad_accum=3, dp_rank=0, dp_size=2, seed=9)
    r1 = SftSampler(rows, micro_batch=1, grad_accum=3, dp_rank=1, dp_size=2, seed=9)
    single = SftSampler(rows, micro_batch=6, grad_accum=1, seed=9)
    for _ in range(3):
        b0, b1, whole = r0.next_step(), r1.next_step(), single.next_step()
        got = sorted(tuple(x) for b in (b0, b1) for (ids, _), _ in b for x in ids.numpy())
        assert got == sorted(tuple(x) for (ids, _), _ in whole for x in ids.numpy())
        t0, t1 = (sum(int((lab != -100).sum()) for _, lab in b) for b in (b0, b1))
        assert r0.step_counts == r1.step_counts == single.step_counts
        assert r0.step_counts[0] == t0 + t1 and t0 != t1  # replicas hold different target counts
        assert step_tokens(r0, 6, 80).targets == t0 + t1


@pytest.mark.parametrize("mid_step", [False, True])
def test_resume_mid_epoch_at_another_dp_size(chat_ds, mid_step):
    """Stop mid-epoch (and mid-step in iterator form); resume from the state: the same rows follow."""
    ds = SftDataset(TokenDataset(chat_ds.path))
    rows = SftRows(ds, 512, seed=2)
    ref = SftSampler(rows, micro_batch=2, grad_accum=2, dp_size=1, seed=4)
    expected = _stream(ref, 12)  # several epochs' worth
    assert 12 * 4 > rows.num_chunks(512) > 3 * 4  # the stop below is mid-epoch, the run crosses epochs
    run = SftSampler(rows, micro_batch=2, grad_accum=2, dp_size=1, seed=4)
    got = _stream(run, 3)
    if mid_step:
        got.append(next(run)[0][0].numpy())
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint keeps
    if mid_step:  # mid-step: the same global batch continues the step
        resumed = SftSampler(SftRows(ds, 512, seed=2), micro_batch=2, grad_accum=2, seed=4)
        resumed.load_state_dict(state)
        got.append(next(resumed)[0][0].numpy())
        got += _stream(resumed, 12 - 4)
    else:  # at a step boundary: DP=2 (each rank micro 1) takes the same rows per step
        ranks = [SftSampler(SftRows(ds, 512, seed=2), micro_batch=1, grad_accum=2, dp_rank=r, dp_size=2, seed=4)
                 for r in range(2)]
        for s in ranks:
            s.load_state_dict(state)
        for _ in range(12 - 3):
            parts = [s.next_step() for s in ranks]
            for k in range(2):  # micro-batch k of the DP=1 run = rows k of both replicas
                got.append(np.concatenate([parts[r][k][0][0].numpy() for r in range(2)]))
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    other = SftSampler(SftRows(ds, 512, packing=False, seed=2), micro_batch=2, grad_accum=2, seed=4)
    with pytest.raises(DataError, match="packing|num_chunks"):
        other.load_state_dict(state)
