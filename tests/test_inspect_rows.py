"""``ds-mp show-rows`` (issue 43 item 16): a packed training row printed decoded, with its documents'
boundaries and its targets, checked against what the engine is handed (``SftRows.batch``) and against
the chat template's own rendering (the tokenizer's ``apply_chat_template``)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ds_mp.data import SftDataset, SftRows, TokenDataset, load_tokenizer, prepare_sft_data
from ds_mp.tools.cli import main as ds_mp_main
from sft_utils import chat_tokenizer, conversations, write_jsonl

SEQ = 96


@pytest.fixture(scope="module")
def chat_ds(tmp_path_factory) -> tuple[str, list]:
    root = tmp_path_factory.mktemp("rows")
    tok = str(root / "tok")
    chat_tokenizer(tok)
    chats = conversations(30, seed=3, words=12)
    src = write_jsonl(str(root / "chats.jsonl"), [{"messages": m} for m in chats])
    return prepare_sft_data([src], str(root / "ds"), tok, "chat", val_fraction=0.2, show_progress=False).path, chats


def test_show_rows_prints_documents_and_targets_as_trained(chat_ds, capsys) -> None:
    path, chats = chat_ds
    rows = SftRows(SftDataset(TokenDataset(path)), SEQ, seed=1234)  # ds_mp.data's defaults: the same plan
    multi = max(range(len(rows.rows)), key=lambda r: len(rows.rows[r]))  # boundaries between documents
    last = int(np.argmax(rows.row_padding))  # a row with padding
    assert len(rows.rows[multi]) > 1 and rows.row_padding[last] > 0
    assert ds_mp_main(["show-rows", "--data", path, "--seq-len", str(SEQ), "--row", str(multi), "--row", str(last),
                       "--mark", "⟦,⟧", "--tokens"]) == 0
    out = capsys.readouterr().out
    tok = load_tokenizer(f"{path}/tokenizer")
    rendered = {tok.apply_chat_template(m, tokenize=False) for m in chats}
    for r, text in zip((multi, last), out.split("\n\nrow ")):
        (ids_t, pos_t), labels_t = rows.batch(np.array([r]), SEQ)
        ids, pos, labels = ids_t[0].numpy(), pos_t[0].numpy(), labels_t[0].numpy()
        docs = re.findall(r"--- document (\d+) of (\d+): dataset document \d+, tokens \[(\d+), (\d+)\), (\d+) targets"
                          r"( \(cut to seq_len\))?\n(.*?)\n(?=---)", text, re.S)
        assert len(docs) == len(rows.rows[r]) and int(docs[0][1]) == len(docs)
        starts = [int(d[2]) for d in docs]
        assert starts == np.flatnonzero(pos == 0)[:len(docs)].tolist()  # boundaries where positions restart
        for _, _, a, b, n, cut, body in docs:
            a, b = int(a), int(b)
            assert int(n) == int((labels[a:b] != -100).sum())
            plain = body.replace("⟦", "").replace("⟧", "")  # the chat as the template renders it (cut: its start)
            assert any(chat.startswith(plain) for chat in rendered) and (cut or plain in rendered)
            marked = "".join(re.findall(r"⟦(.*?)⟧", body, re.S))
            assert marked == "".join(tok.decode(ids[t:t + 1]) for t in range(a, b) if labels[t] != -100)
            assert marked and "<|im_start|>assistant" not in marked  # the answers are targets, the markup is not
        table = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+) ([T-]) (\".*\")$", text, re.M)
        assert [int(t[0]) for t in table] == list(range(SEQ))
        assert [t[3] == "T" for t in table] == (labels != -100).tolist()
        assert [int(t[1]) for t in table] == pos.tolist() and [int(t[2]) for t in table] == ids.tolist()
        assert [json.loads(t[4]) for t in table] == [tok.decode([i]) for i in ids]
    assert f"--- padding: tokens [{int(rows.lengths[rows.rows[last]].sum())}, {SEQ})" in out


def test_show_rows_val_split_no_packing_and_config(chat_ds, tmp_path, capsys) -> None:
    path, _ = chat_ds
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ds_mp": {"data": {"seq_len": SEQ, "packing": False, "seed": 7}}}))
    assert ds_mp_main(["show-rows", "--data", path, "--split", "val", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"row 0 of {len(SftDataset(TokenDataset(path, 'val')))} (val, seq_len {SEQ}): 1 document,")


@pytest.mark.parametrize("argv, words", [
    (["--row", "9999"], "--row 9999: the train split has"),
    (["--mark", "x"], "--mark 'x': give two strings"),
    (["--tokenizer", "/nonexistent"], "tokenizer directory '/nonexistent' does not exist"),
])
def test_show_rows_refuses_in_one_line(chat_ds, capsys, argv, words) -> None:
    path, _ = chat_ds
    assert ds_mp_main(["show-rows", "--data", path, "--seq-len", str(SEQ), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
