"""Shared fixtures of the SFT tests: a tiny tokenizer with a chat template, chat records like users'."""
from __future__ import annotations

import json
import os
import random

from ds_mp.data import train_tokenizer
from ds_mp.data.sft_format import CHATML, CHATML_TOKENS

# Llama-3's turn markup with generation markers (no whitespace after the end-of-turn token)
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
          "{%- if m['role'] == 'assistant' %}{% generation %}{{- m['content'] + '<|eot_id|>' }}{% endgeneration %}"
          "{%- else %}{{- m['content'] + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

WORDS = ["add", "the", "numbers", "def", "return", "x", "+", "y", "(", ")", ":", "why", "is", "sky", "blue",
         "über", "日本", "\n", "    ", "print", "list", "sorted", "42", "?", "."]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_tokenizer(out_dir: str, template: str = CHATML, specials: list[str] = CHATML_TOKENS, vocab: int = 320):
    """A byte-level BPE trained on WORDS plus ``specials``, with ``template``; saved to ``out_dir``."""
    rng = random.Random(0)
    tok = train_tokenizer([sentence(rng, 30) for _ in range(200)], vocab)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.save_pretrained(out_dir)
    return tok


def conversations(n: int, seed: int = 0, words: int = 40) -> list[list[dict[str, str]]]:
    """``n`` conversations of uneven length: an optional system turn, 1-3 user/assistant exchanges of
    up to ``words`` words (user turns half as long)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 4)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": sentence(rng, rng.randint(2, max(2, words // 2)))},
                     {"role": "assistant", "content": sentence(rng, rng.randint(1, words))}]
        out.append(msgs)
    return out


def write_jsonl(path: str, records: list) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path
