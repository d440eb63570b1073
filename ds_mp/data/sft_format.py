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

Tools: a record's ``tools`` list goes to the template (``apply_chat_template(tools=...)``; a
template that renders it nowhere is refused); an assistant message may carry ``tool_calls``
with ``content`` null (OpenAI style): the rendered calls are then the turn's targets (a template
that does not render them is refused).  Other message keys (``name``, ``tool_call_id``) reach
the template as they are.
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
    """Raise :class:`DataError` when ``tok`` (loaded from ``source``) has no chat template, or one that
    ignores ``add_generation_prompt`` (probe: a user turn rendered with and without it comes out the
    same).  Such a template writes no assistant header before the answer starts, so the header would
    become a target; the mask rule needs the prompt to end where the answer begins."""
    if not getattr(tok, "chat_template", None):
        raise DataError(f"tokenizer in {source!r} has no chat template; pass one with --chat-template FILE "
                        "(a Jinja file; chat_template= in Python) or use a checkpoint whose tokenizer has one")
    probe = [{"role": "user", "content": "ping"}]
    if _render(tok, probe, True) == _render(tok, probe, False):
        raise DataError(f"the chat template of {source!r} ignores add_generation_prompt (renders the same with and "
                        "without it), so the assistant header would be trained on; use a template that writes the "
                        "assistant header when add_generation_prompt is true (--chat-template FILE)")


def end_of_turn_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens ``tok``'s chat template writes at the end of an assistant turn (e.g.
    ``<|im_end|>``, ``<|eot_id|>``): those of the probe answer's target span after its content.
    Empty when the tokenizer has no chat template or the template ends turns with plain text."""
    if not getattr(tok, "chat_template", None):
        return []
    answer = "pong"
    msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": answer}]
    try:
        full, spans = assistant_spans(tok, msgs, "end-of-turn probe")
    except (DataError, ValueError, TypeError):  # a template the probe cannot render: no end-of-turn known
        return []
    if not spans:
        return []
    a, b = spans[-1]
    tail = full[a:b]
    tail = tail[tail.find(answer) + len(answer):] if answer in tail else tail
    special = set(tok.all_special_ids)
    return [i for i in tok(tail, add_special_tokens=False)["input_ids"] if i in special]


def _field(record: Any, key: str, where: str, example: str) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: no {key!r} field; each record must be {example}")
    return record[key]


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _message(m: Any, j: int, where: str) -> dict[str, Any]:
    """One message, its keys kept (``tool_calls``, ``name``, ``tool_call_id`` reach the template): a
    string ``content``, or an assistant turn with ``content`` null/absent and a non-empty ``tool_calls``."""
    if not isinstance(m, dict) or "role" not in m:
        raise DataError(f"{where}: message {j} must be an object with 'role' and 'content'")
    if m["role"] not in ROLES:
        raise DataError(f"{where}: message {j} has unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not calls):
        raise DataError(f"{where}: message {j}: 'tool_calls' must be a non-empty list on an assistant message")
    if m.get("content") is None and calls:
        return dict(m, content=None)
    if "content" not in m:
        raise DataError(f"{where}: message {j} must be an object with 'role' and 'content'")
    return dict(m, content=_text(m["content"], f"messages[{j}].content", where))


def _messages(record: Any, where: str) -> list[dict[str, Any]]:
    msgs = _field(record, "messages", where, '{"messages": [{"role": "user", "content": "..."}, ...]}')
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = [_message(m, j, where) for j, m in enumerate(msgs)]
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing to learn; add one or drop the line "
                        "(--bad-records skip skips such records)")
    return out


def _tools(record: Any, where: str) -> list | None:
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of tool (function schema) objects")
    return tools or None


def _render(tok: PreTrainedTokenizerBase, msgs: list[dict[str, Any]], gen: bool, tools: list | None = None,
            where: str = "") -> str:
    try:
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # jinja2's TemplateError, or a TypeError on content None: name the record
        if not where:
            raise
        raise DataError(f"{where}: the chat template cannot render this conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); fix the record or use a template that "
                        "renders it (--chat-template FILE)") from None


def _function_names(m: dict[str, Any]) -> list[str]:
    return [str((c.get("function") or c).get("name", "")) for c in m.get("tool_calls") or [] if isinstance(c, dict)]


def assistant_spans(tok: PreTrainedTokenizerBase, msgs: list[dict[str, Any]], where: str,
                    tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[a, b)`` of its assistant targets (a
    turn's tool calls included, as the template renders them).  ``tools`` go to the template
    (``apply_chat_template(tools=...)``); a template that renders them nowhere is refused."""
    full = _render(tok, msgs, False, tools, where)
    if tools and full == _render(tok, msgs, False, None, where):
        raise DataError(f"{where}: the record has 'tools' but the chat template does not render them, so the "
                        "model would not see them; use a template that renders tools or drop the key")
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, through = _render(tok, msgs[:i], True, tools, where), _render(tok, msgs[:i + 1], False, tools, where)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(f"{where}: the chat template renders assistant turn {i} differently inside the whole "
                            "conversation than on its own, so its tokens cannot be found; use a template whose "
                            "renderings of a conversation's prefixes are prefixes (--chat-template FILE)")
        end = len(through.rstrip())
        missing = [n for n in _function_names(m) if n not in through[len(before):end]]
        if missing:
            raise DataError(f"{where}: message {i}'s tool_calls ({', '.join(missing)}) are not rendered by the chat "
                            "template, so there is nothing to train on; use a template that renders tool_calls")
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def encode_record(tok: PreTrainedTokenizerBase, fmt: str, record: Any, where: str) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one record (``mask[t]`` = 1: token t is a target); ``where`` names it in errors."""
    if fmt != "chat" and isinstance(record, dict) and "messages" in record and "text" not in record \
            and "prompt" not in record:
        raise DataError(f"{where}: a chat record ('messages') where {fmt} records are expected; use --format chat")
    if fmt == "chat":
        text, spans = assistant_spans(tok, _messages(record, where), where, _tools(record, where))
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
