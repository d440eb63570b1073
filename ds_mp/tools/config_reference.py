"""The config reference, generated from the dataclasses in :mod:`ds_mp.config`.

    python -m ds_mp.tools.config_reference            print docs/config.md's text
    python -m ds_mp.tools.config_reference --write    (re)write docs/config.md
    python -m ds_mp.tools.config_reference --check    exit 1 when docs/config.md is stale

Every key of the ``"ds_mp"`` block is a dataclass field reachable from
:class:`ds_mp.config.DsMpConfig`; a field whose type is itself a config dataclass is a section
(``tensor_parallel``, ``pipeline``, …) and its fields are the keys ``section.key`` (a
``Union[str, InlineModel]`` field such as ``model`` is both a key and a section).  Fields with
``repr=False`` are filled by validation, not read from the JSON, and are left out, as the
parser leaves them out.

A key's meaning is the field's trailing ``# comment`` (on any line of the field's statement),
or, when the field has none, the block of ``#`` lines right above it.  :func:`reference`
raises :class:`UndocumentedKey` naming every key with neither, so a new key cannot ship
without its line in the reference (``tests/test_docs.py``).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from ds_mp import config as config_module

DOCS_PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "docs", "config.md")
COMMAND = "python -m ds_mp.tools.config_reference --write"

# section -> the docs page that explains it (optional: a section without one is still listed)
SECTION_PAGES: dict[str, str] = {
    "model": "fine-tuning.md#models-from-the-hub",
    "tensor_parallel": "layouts.md#tensor-parallelism",
    "context_parallel": "layouts.md#context-parallelism",
    "pipeline": "layouts.md#pipeline-parallelism",
    "terapipe": "schedules.md#terapipe",
    "ouroboros": "schedules.md#ouroboros",
    "data": "fine-tuning.md",
    "training": "monitoring.md",
    "lora": "fine-tuning.md#lora-fine-tuning",
    "batch_ramp": "batch-ramp.md",
}


class UndocumentedKey(ValueError):
    """Config keys whose dataclass field has no ``# comment``."""


@dataclass(frozen=True)
class Key:
    """One row of the reference: the dotted key, its type, its default and its meaning."""

    key: str
    type: str
    default: str
    meaning: str


def field_comments(cls: type) -> dict[str, str]:
    """``{field name: comment}`` of a dataclass: the trailing ``# comment`` of the field's
    statement, else the contiguous ``#`` lines right above it ("" when neither)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line -> comment text (1-based, in ``source``)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1)
                    if n in comments and not lines[n - 1].lstrip().startswith("#")]
        above: list[str] = []
        n = node.lineno - 1
        while n >= 1 and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        out[node.target.id] = trailing[-1] if trailing else " ".join(above)
    return out


def _sections(tp: Any) -> list[type]:
    """The config dataclasses a field's type holds (itself, or the members of a Union)."""
    options = get_args(tp) if get_origin(tp) is Union else (tp,)
    return [t for t in options if dataclasses.is_dataclass(t)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Union:
        names = [("object" if dataclasses.is_dataclass(a) else _type_name(a)) for a in get_args(tp)]
        return " or ".join(n for n in names if n != "NoneType")
    if tp is float:
        return "number"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if dataclasses.is_dataclass(value):
        return "the inline shape below"
    return f"`{json.dumps(value)}`"


def reference(root: type = config_module.DsMpConfig) -> list[Key]:
    """Every key under ``root`` in declaration order (sections' keys after the section key).
    Raises :class:`UndocumentedKey` listing the keys that lack a comment."""
    rows: list[Key] = []
    missing: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints, comments = get_type_hints(cls), field_comments(cls)
        for f in dataclasses.fields(cls):
            if not f.repr:  # filled by validate(), not a JSON key
                continue
            key, sections = prefix + f.name, _sections(hints[f.name])
            is_section_only = sections and sections == [hints[f.name]]
            if not is_section_only:
                meaning = comments.get(f.name, "")
                if not meaning:
                    missing.append(key)
                rows.append(Key(key, _type_name(hints[f.name]), _default(f), meaning))
            for section in sections:
                walk(section, key + ".")

    walk(root, "")
    if missing:
        raise UndocumentedKey(f"config keys without a '# comment' in ds_mp/config/schema.py: {', '.join(missing)}; "
                              f"add one per field, then run {COMMAND}")
    return rows


def _cell(text: str) -> str:
    """A table cell: pipes escaped, ``<x>`` shown literally (not as an HTML tag)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def render(rows: list[Key] | None = None) -> str:
    """docs/config.md: a table per section, in the order of :class:`DsMpConfig`."""
    rows = reference() if rows is None else rows
    out = [
        "# Config reference",
        "",
        f"<!-- generated by `{COMMAND}` from ds_mp/config/schema.py; do not edit by hand -->",
        "",
        "ds_mp reads one `\"ds_mp\"` block from the DeepSpeed JSON (DeepSpeed ignores it). Unknown keys,",
        "wrong types and impossible combinations fail on every rank before any collective, with one",
        "line naming the key and the fix. Check a config without starting anything:",
        "",
        "<!-- runnable -->",
        "```python",
        "from ds_mp.config import load_config",
        "cfg, ds_json = load_config(\"ds_configs/tp2_pp2.json\", world_size=4)",
        "print(cfg.tensor_parallel, cfg.pipeline, f\"DP={cfg.dp}\")",
        "```",
        "",
        "Every key below is a field of a dataclass in `ds_mp/config/schema.py`; its meaning is the field's",
        f"`# comment`, and this page is written by `{COMMAND}` (`tests/test_docs.py`",
        "fails when a key has no comment or this page is stale).",
        "",
    ]
    section = None
    for row in rows:
        head = row.key.split(".")[0]
        if head != section:
            section = head
            page = SECTION_PAGES.get(section)
            out += ["", f"## `{section}`", ""]
            if page:
                out += [f"Explained in [{page.split('#')[0].removesuffix('.md')}]({page}).", ""]
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out.append(f"| `{row.key}` | {row.type} | {_cell(row.default)} | {_cell(row.meaning)} |")
    out += [
        "",
        "## DeepSpeed's own keys",
        "",
        "The rest of the JSON is DeepSpeed's: `train_micro_batch_size_per_gpu`,",
        "`gradient_accumulation_steps` (= micro-batches per pipeline step), `optimizer`, `scheduler`,",
        "`gradient_clipping`, `bf16`, `fp16`, `zero_optimization` (stage 0, 1 or 2; 3 is refused),",
        "and the monitors ([monitoring](monitoring.md)). `\"optimizer\": {\"type\": \"Lamb\"}` uses",
        "ds_mp's own LAMB ([recipe](recipe.md)). World size = TP × PP × DP, DP inferred",
        "([layouts](layouts.md)).",
        "",
        "**`gradient_clipping` defaults to 1.0**: without the key DeepSpeed clips the global gradient",
        "norm at 1.0 (ds_mp computes that norm over every TP shard and stage and applies DeepSpeed's",
        "value), and ds_mp warns once. Set it explicitly: `0.0` trains unclipped (HF's plain",
        "`loss.backward(); opt.step()` loop; HF's `Trainer` clips at its `max_grad_norm`, also 1.0).",
        "Every example in these pages and in `ds_configs/` names the key.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_mp.tools.config_reference", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {os.path.relpath(DOCS_PAGE)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page differs from the config")
    p.add_argument("--out", default=DOCS_PAGE, help="the page (default docs/config.md)")
    args = p.parse_args(argv)
    try:
        text = render()
    except UndocumentedKey as e:
        print(f"config_reference: {e}", file=sys.stderr)
        return 1
    if args.write:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
        return 0
    if args.check:
        current = open(args.out).read() if os.path.isfile(args.out) else ""
        if current != text:
            print(f"config_reference: {args.out} is stale; run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
