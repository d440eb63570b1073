"""Supervised fine-tuning records -> token ids and a loss mask (which tokens are targets).

Three formats, each a dict per record (a JSONL line, a Parquet/Arrow row, a ``datasets`` row):

* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
  tokenizer's own chat template. Targets: every assistant turn's content **and its
  end-of-turn token** (e.g. ``<|im_end|>`` or ``<|eot_id|>``); never the role markup
  (``<|im_start|>assistant\\n``), the system/user/tool turns, nor whitespace the template
  writes after the end-of-turn token.
* ``prompt-completion``: ``{"prompt": ..., "completion": ...}``; ids = prompt (with the
  tokenizer's usual special tokens, e.g. a bos) + completion + eos. Targets: completion + eos.
* ``text``: ``{"text": ...}``; ids = text + eos. Targets: every token.

How the chat mask is found (any template, no ``{% generation %}`` markers needed): for the
i-th message, if it is an assistant turn, the template renders ``messages[:i]`` with the
generation prompt (everything up to where the answer starts) and ``messages[:i+1]`` (through
its end-of-turn); both must be prefixes of the whole conversation's rendering, and the
characters between them, less trailing whitespace, are the turn's target span. A token is a
target when its characters meet a span (the rule of HF's ``return_assistant_tokens_mask``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMATS = ("chat", "prompt-completion", "text")
ROLES = ("system", "user", "assistant", "tool")
#: ChatML (Qwen2's turn markup) with HF ``{% generation %}`` markers around each assistant turn's
#: target tokens; needs ``<|im_start|>``/``<|im_end|>`` special tokens. For tokenizers that have no
#: template (the tests, docs/sft.md's example and benchmarks/sft.py give it to a tiny tokenizer).
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]


def check_chat_template(tok: PreTrainedTokenizerBase, source: str) -> None:
    """Raise :class:`DataError` when ``tok`` (loaded from ``source``) has no chat template."""
    if not getattr(tok, "chat_template", None):
        raise DataError(f"tokenizer in {source!r} has no chat template; pass one with --chat-template FILE "
                        "(a Jinja file; chat_template= in Python) or use a checkpoint whose tokenizer has one")


def _field(record: Any, key: str, where: str, example: str) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: no {key!r} field; each record must be {example}")
    return record[key]


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _messages(record: Any, where: str) -> list[dict[str, str]]:
    msgs = _field(record, "messages", where, '{"messages": [{"role": "user", "content": "..."}, ...]}')
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {j} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": _text(m["content"], f"messages[{j}].content", where)})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing to learn; add one or drop the line")
    return out


def _render(tok: PreTrainedTokenizerBase, msgs: list[dict[str, str]], gen: bool) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def assistant_spans(tok: PreTrainedTokenizerBase, msgs: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[a, b)`` of its assistant targets."""
    full = _render(tok, msgs, False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, through = _render(tok, msgs[:i], True), _render(tok, msgs[:i + 1], False)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(f"{where}: the chat template renders assistant turn {i} differently inside the whole "
                            "conversation than on its own, so its tokens cannot be found; use a template whose "
                            "renderings of a conversation's prefixes are prefixes (--chat-template FILE)")
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def encode_record(tok: PreTrainedTokenizerBase, fmt: str, record: Any, where: str) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one record (``mask[t]`` = 1: token t is a target); ``where`` names it in errors."""
    if fmt == "chat":
        text, spans = assistant_spans(tok, _messages(record, where), where)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s < b and a < max(e, s + 1) for a, b in spans)) for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask
    if fmt == "prompt-completion":
        example = '{"prompt": "...", "completion": "..."}'
        prompt = _text(_field(record, "prompt", where, example), "prompt", where)
        completion = _text(_field(record, "completion", where, example), "completion", where)
        p = tok(prompt, add_special_tokens=True)["input_ids"]
        c = [*tok(completion, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        return [*p, *c], [0] * len(p) + [1] * len(c)
    if fmt == "text":
        text = _text(_field(record, "text", where, '{"text": "..."}'), "text", where)
        ids = [*tok(text, add_special_tokens=True)["input_ids"], tok.eos_token_id]
        return ids, [1] * len(ids)
    raise DataError(f"format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
