"""Chat data as fine-tuners have it (issue 43, items 10-12): tools and OpenAI-style tool calls reach the
template (masks equal HF's generation markers), templates that would train on the role markup or drop
the tools are refused with one line, bad records can be skipped and counted, and the end-of-turn
token of a template is found for the export."""
from __future__ import annotations

import json
import os

import pytest

from ds_mp.data import prepare_data_cli
from ds_mp.data.sft_format import CHATML, encode_record
from sft_utils import LLAMA3, LLAMA3_TOKENS, chat_tokenizer, write_jsonl

# ChatML with a tools block and <tool_call> rendering of assistant tool calls (Qwen2.5's scheme, shortened),
# with HF generation markers around the assistant targets: the outside oracle of the mask
TOOLS_CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{%- if message['content'] %}{{- message['content'] }}"
    "{%- endif %}{%- for call in message['tool_calls'] or [] %}{{- '<tool_call>' + (call['function'] | tojson)"
    " + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
NO_GENERATION_PROMPT = CHATML.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}", "")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOL_CHAT = [{"role": "user", "content": "why is sky blue"},
             {"role": "assistant", "content": None, "tool_calls": CALL},
             {"role": "tool", "content": "sorted 42"},
             {"role": "assistant", "content": "print 42"}]


@pytest.fixture(scope="module")
def tools_tok(tmp_path_factory):
    return chat_tokenizer(str(tmp_path_factory.mktemp("tools") / "tok"), TOOLS_CHATML)


def test_tools_and_tool_calls_reach_the_template_mask_equals_hf(tools_tok):
    """Outside oracle: HF's assistant mask (generation markers) with the same tools; the tool call
    rendered for a content-null assistant turn is its target."""
    ref = tools_tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = encode_record(tools_tok, "chat", {"messages": TOOL_CHAT, "tools": TOOLS}, "x")
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
    text = tools_tok.decode(ids)
    targets = tools_tok.decode([i for i, m in zip(ids, mask) if m])
    assert "get_weather" in text.split("<|im_end|>")[0]  # the tools block the model sees
    assert targets.startswith('<tool_call>{"name": "get_weather"') and "print 42" in targets
    assert "<|im_start|>" not in targets and "sorted 42" not in targets


def _prepare(tmp_path, records, tok, *extra) -> tuple[int, str, str]:
    src = write_jsonl(str(tmp_path / "in.jsonl"), records)
    code = prepare_data_cli([src, "--out", str(tmp_path / "o"), "--tokenizer", tok, "--format", "chat",
                             "--val-fraction", "0", "--no-progress", *extra])
    return code, src, ""


@pytest.mark.parametrize("case", ["tools ignored", "tool_calls not renderable", "no generation prompt"])
def test_templates_that_would_train_wrongly_are_refused(tmp_path, capsys, case):
    template, record = {
        "tools ignored": (CHATML, {"messages": TOOL_CHAT[:1] + TOOL_CHAT[3:], "tools": TOOLS}),
        "tool_calls not renderable": (CHATML, {"messages": TOOL_CHAT}),
        "no generation prompt": (NO_GENERATION_PROMPT, {"messages": TOOL_CHAT[:1] + TOOL_CHAT[3:]}),
    }[case]
    chat_tokenizer(str(tmp_path / "tok"), template)
    code, src, _ = _prepare(tmp_path, [record], str(tmp_path / "tok"))
    err = capsys.readouterr().err.strip()
    want = {"tools ignored": f"{src}:1: the record has 'tools' but the chat template does not render them",
            "tool_calls not renderable": f"{src}:1: the chat template cannot render this conversation",
            "no generation prompt": "ignores add_generation_prompt"}[case]
    assert code == 2 and len(err.splitlines()) == 1 and want in err, err


def test_bad_records_skipped_and_counted_default_strict(tmp_path, capsys):
    chat_tokenizer(str(tmp_path / "tok"))
    good = {"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": "print 42"}]}
    records = [good, {"messages": [{"role": "user", "content": "no answer"}]}, "{not json", good,
               {"text": "wrong format"}]
    code, src, _ = _prepare(tmp_path, records, str(tmp_path / "tok"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: {src}:2: conversation has no assistant turn, so nothing to learn; add one " \
                                "or drop the line (--bad-records skip skips such records)"
    code, _, _ = _prepare(tmp_path, records, str(tmp_path / "tok"), "--bad-records", "skip")
    out = capsys.readouterr().out
    assert code == 0 and "3 bad records skipped" in out and f"skipped: {src}:3: invalid JSON" in out
    with open(os.path.join(str(tmp_path / "o"), "meta.json")) as f:
        meta = json.load(f)
    assert meta["sft"]["bad"] == 3 and meta["sft"]["records"] == 5 and meta["train_documents"] == 2


def test_chat_records_given_as_text_are_recognised(tmp_path, capsys):
    chat_tokenizer(str(tmp_path / "tok"))
    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"messages": TOOL_CHAT[:1] + TOOL_CHAT[3:]}])
    code = prepare_data_cli([src, "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tok"), "--format",
                             "text", "--val-fraction", "0", "--no-progress"])
    err = capsys.readouterr().err.strip()
    want = f"{src}:1: a chat record ('messages') where text records are expected; use --format chat"
    assert code == 2 and want in err


@pytest.mark.parametrize("template,specials,end", [(CHATML, None, "<|im_end|>"), (LLAMA3, LLAMA3_TOKENS, "<|eot_id|>"),
                                                   (None, None, None)])
def test_end_of_turn_tokens_of_a_template(tmp_path, template, specials, end):
    from ds_mp.data.sft_format import end_of_turn_ids

    tok = chat_tokenizer(str(tmp_path / "t"), template, *([specials] if specials else []))
    assert end_of_turn_ids(tok) == ([tok.convert_tokens_to_ids(end)] if end else [])


class _Rows:
    """A split of ``n`` rows whose row r is the token r (label r): which rows a batch read, and as what."""

    def __init__(self, n: int) -> None:
        self.n = n

    def num_chunks(self, seq_len: int) -> int:
        return self.n

    def batch(self, ids, seq_len: int):
        import torch

        t = torch.as_tensor(ids).long()[:, None].repeat(1, seq_len)
        return (t, torch.zeros_like(t)), t.clone()


@pytest.mark.parametrize("n,dp,cap", [(15, 1, 0), (15, 2, 0), (7, 2, 0), (40, 2, 2)])
def test_held_out_batches_read_every_row_once(n, dp, cap):
    """Over the DP replicas: each row once (the first cap passes' rows with a cap), filler rows
    without a target, equal pass counts on every replica (the passes are collectives)."""
    from ds_mp.data.validation import HeldOutBatches

    micro, per_pass = 2, 2
    seen, passes = [], set()
    for rank in range(dp):
        b = HeldOutBatches(_Rows(n), 3, micro, per_pass, rank, dp, max_passes=cap)
        passes.add(b.passes)
        for (ids, _), labels in b:
            seen += [int(r) for r in labels[:, 0] if r != -100]
            assert ((labels == -100).all(1) | (labels == ids).all(1)).all()
    want = min(n, cap * micro * per_pass * dp) if cap else n
    assert sorted(seen) == list(range(want)) and len(passes) == 1
