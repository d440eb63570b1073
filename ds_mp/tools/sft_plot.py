"""docs/img/sft_packed_row.png: one packed SFT row, drawn from a real prepared dataset.

``python -m ds_mp.tools.docs_plots --only sft`` builds a small chat dataset (arithmetic chats, a
byte-level BPE with ChatML), plans rows of 64 tokens with best-fit decreasing, and draws the
fullest row holding three or more documents: the documents (colours), targets (solid) vs
context (pale) vs padding (grey), the position ids, and the attention each token may use.
"""
from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import numpy as np

SEQ_LEN = 64


def _chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"messages": [{"role": "user", "content": f"{a}+{b}?"},
                                 {"role": "assistant", "content": f"{a + b}."}]})
        if rng.random() < 0.5:
            out[-1]["messages"] += [{"role": "user", "content": "Double?"},
                                    {"role": "assistant", "content": f"{2 * (a + b)}."}]
    return out


def packed_row_png(out_png: str, plt: Any) -> str:
    """Draw the picture (see the module docstring) to ``out_png`` with ``plt`` (matplotlib.pyplot on a
    headless backend); returns its path."""
    from ds_mp.data import SftDataset, SftRows, TokenDataset, prepare_sft_data, train_tokenizer
    from ds_mp.data.sft_format import CHATML, CHATML_TOKENS

    chats = _chats(60)
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer([f"{m['role']}\n{m['content']}" for c in chats for m in c["messages"]] * 5, 300)
        tok.add_special_tokens({"additional_special_tokens": CHATML_TOKENS})
        tok.chat_template = CHATML
        tok.save_pretrained(os.path.join(tmp, "tok"))
        info = prepare_sft_data(chats, os.path.join(tmp, "ds"), os.path.join(tmp, "tok"), "chat",
                                val_fraction=0, show_progress=False)
        ds = SftDataset(TokenDataset(info.path))
        rows = SftRows(ds, SEQ_LEN, seed=0)
        candidates = [r for r in range(len(rows.rows)) if len(rows.rows[r]) >= 3]
        row = min(candidates, key=lambda r: (-len(set(rows.lengths[rows.rows[r]].tolist())),  # mixed lengths
                                             -min(rows.row_padding[r], 1), rows.row_padding[r], r))  # a little padding
        (ids, pos), labels = rows.batch(np.array([row]), SEQ_LEN)
        ids, pos, labels = ids[0].numpy(), pos[0].numpy(), labels[0].numpy()
        short = {"<|im_start|>": "<s>", "<|im_end|>": "</s>", "\n": "\\n", "<|endoftext|>": "pad"}
        pieces = [short.get(p, p) for p in (tok.decode([int(i)]) for i in ids)]
    doc = np.cumsum(pos == 0) - 1  # document index per token; the padding is the last "document"
    padded = len(rows.rows[row])  # index of the padding document
    colours = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.2), gridspec_kw={"height_ratios": [1.1, 3]})
    for t in range(SEQ_LEN):
        c = "#BBBBBB" if doc[t] == padded else colours[doc[t] % len(colours)]
        top.add_patch(plt.Rectangle((t, 0), 0.95, 1, color=c, alpha=1.0 if labels[t] != -100 else 0.3))
        top.text(t + 0.47, -0.25, str(pos[t]), ha="center", va="top", fontsize=6)
        top.text(t + 0.47, 1.1, pieces[t][:9], ha="center", va="bottom", fontsize=6.5, rotation=90)
    top.set_xlim(0, SEQ_LEN)
    top.set_ylim(-0.8, 3.2)
    top.axis("off")
    top.text(-0.5, -0.25, "position_ids", ha="right", va="top", fontsize=7)
    top.set_title(f"one packed row of {SEQ_LEN} tokens: {padded} chats (colours), targets solid, context pale, "
                  "padding grey; <s> = <|im_start|>, </s> = <|im_end|>", fontsize=9)
    allowed = (doc[:, None] == doc[None, :]) & (np.arange(SEQ_LEN)[:, None] >= np.arange(SEQ_LEN)[None, :])
    image = np.ones((SEQ_LEN, SEQ_LEN, 3))
    for t in range(SEQ_LEN):
        hexc = "#BBBBBB" if doc[t] == padded else colours[doc[t] % len(colours)]
        rgb = [int(hexc[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        image[t, allowed[t]] = rgb
    bottom.imshow(image, interpolation="nearest")
    bottom.set_xlabel("key position in the row (what a token may attend to)")
    bottom.set_ylabel("query position in the row")
    bottom.set_title("attention: causal inside each document, never across (position_ids restart at 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png
