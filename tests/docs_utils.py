"""Reading README.md and docs/ for tests/test_docs.py: fenced examples and their markers,
relative links and anchors, test names and repository paths named in backticks, and the
generated tables of test case lists.  Pure text; nothing here runs an example."""
from __future__ import annotations

import dataclasses
import glob
import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pages other engineers own: their runnable blocks run and their links are checked, but an
# unmarked bash/python block there is not an error.
OTHERS_PAGES = {"docs/batch-ramp.md", "docs/models.md"}


def degrees(tp: int, pp: int, dp: int) -> str:
    """``TP=2 × DP=2`` (degrees of 1 left out)."""
    return " × ".join(f"{n}={d}" for n, d in (("TP", tp), ("PP", pp), ("DP", dp)) if d > 1) or "1 rank"


def _zero2_row(case: tuple) -> dict:
    _, (tp, pp, dp, schedule, bf16) = case
    return {"precision": "bf16" if bf16 else "fp32", "wrapper": "zero2", "layout": degrees(tp, pp, dp),
            "schedule": schedule}


# Test modules whose ``CASES`` is shown as a table in docs/: module -> row function from a case
# (a ``(name, value)`` pair when CASES is a dict) to ``{column: value}``; None: the module's
# ``case_values``, or the case itself when it is a dict or a dataclass.  The table appears in a
# page between ``<!-- generated: MODULE -->`` and ``<!-- end generated -->``.
MATRICES: dict[str, Callable[[Any], dict] | None] = {
    "test_combinations": None,
    "test_zero2": _zero2_row,
    "test_lifecycle": None,
}

MARKER = re.compile(r"^<!--\s*(runnable|not-runnable)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
RUN_LANGS = ("bash", "sh", "python")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: ``line`` is the fence's 1-based line number."""

    page: str          # path relative to the repository root
    line: int
    lang: str
    code: str
    marker: str | None  # "runnable", "not-runnable" or None
    options: str = ""

    @property
    def launcher(self) -> bool:
        return self.marker == "runnable" and bool(re.match(r"launcher\b", self.options))

    @property
    def append(self) -> str:
        m = re.search(r'append="([^"]*)"', self.options)
        return m.group(1) if m else ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``page``, each with the marker on the line right above its fence."""
    lines = (read(page) if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        mark = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:i]) + "\n",
                         mark.group(1) if mark else None, (mark.group(2) or "") if mark else ""))
        i += 1
    return out


def marking_errors(page: str, text: str | None = None) -> list[str]:
    """Unmarked bash/python blocks, not-runnable ones without a reason, unknown options."""
    errors = []
    for b in blocks(page, text):
        if b.lang not in RUN_LANGS:
            continue
        if b.marker is None:
            errors.append(f"{b.where}: a {b.lang} block without <!-- runnable --> or <!-- not-runnable: why -->")
        elif b.marker == "not-runnable" and not b.options:
            errors.append(f"{b.where}: <!-- not-runnable --> needs a reason after the colon")
        elif b.marker == "runnable":
            rest = re.sub(r'^launcher\b|append="[^"]*"', "", b.options).strip()
            rest = re.sub(r'append="[^"]*"', "", rest).strip()
            if rest:
                errors.append(f"{b.where}: unknown marker option {rest!r} (known: launcher, append=\"ARGS\")")
            if b.launcher and b.lang == "python":
                errors.append(f"{b.where}: launcher examples are bash blocks that call deepspeed")
    return errors


DS_CONFIG = re.compile(r"""["']optimizer["']\s*:""")  # a block that writes a DeepSpeed JSON (or its dict)


def clipping_errors(page: str, text: str | None = None) -> list[str]:
    """DeepSpeed configs in ``page``'s blocks without ``gradient_clipping``: DeepSpeed then clips
    at 1.0 silently (docs/config.md), so every example says which clipping it trains with."""
    return [f"{b.where}: a DeepSpeed config without \"gradient_clipping\" (DeepSpeed's default 1.0 applies "
            "silently); name it (0.0 = unclipped)" for b in blocks(page, text)
            if DS_CONFIG.search(b.code) and "gradient_clipping" not in b.code]


# ------------------------------------------------------------------ links, anchors, names

def _unfenced(text: str) -> str:
    """``text`` without its fenced blocks."""
    return re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(page: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _unfenced(read(page)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def link_errors(page: str, text: str | None = None) -> list[str]:
    """Relative links (and ``#anchors``) of ``page`` that lead nowhere."""
    errors = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(read(page) if text is None else text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(REPO, dest)):
            errors.append(f"{page}: link to {target} — {dest} does not exist")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            errors.append(f"{page}: link to {target} — {dest} has no heading with anchor #{anchor}")
    return errors


def defined_tests() -> set[str]:
    names = set()
    for path in glob.glob(os.path.join(REPO, "tests", "*.py")):
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", f.read(), flags=re.M))
    return names


def named_thing_errors(page: str) -> list[str]:
    """Tests (`test_x`) and repository paths (`ds_mp/...`, `tests/...`, ...) named in backticks
    that do not exist: a renamed test or a moved file leaves no stale pointer in the docs."""
    text, tests, errors = read(page), defined_tests(), []
    for name in sorted(set(re.findall(r"`(test_\w+)`", text))):
        if name not in tests:
            errors.append(f"{page}: names `{name}`, which no tests/*.py defines")
    roots = ("ds_mp/", "tests/", "benchmarks/", "ds_configs/", "launch/", "scripts/", "docs/", ".ci/")
    for span in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        path = span.split("::")[0].rstrip(".,:;")
        if not path.startswith(roots) or re.search(r"[<>{}|\[\]]|\.\.\.|…", path):
            continue
        if not glob.glob(os.path.join(REPO, path)):
            errors.append(f"{page}: names `{span}`, which does not exist in the repository")
    return errors


# ------------------------------------------------------------------ generated case tables

GENERATED = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _rows(module_name: str) -> tuple[list[dict], Any]:
    module = importlib.import_module(module_name)
    row_fn = MATRICES[module_name] or getattr(module, "case_values", None)
    rows = []
    cases = list(module.CASES.items()) if isinstance(module.CASES, dict) else module.CASES
    for case in cases:
        if row_fn is not None:
            rows.append(dict(row_fn(case)))
        elif isinstance(case, dict):
            rows.append(dict(case))
        elif dataclasses.is_dataclass(case):
            rows.append(dataclasses.asdict(case))
        else:
            raise TypeError(f"{module_name}.CASES holds {type(case).__name__}; give MATRICES a row function")
    return rows, module


def _layout(value: Any, layouts: dict) -> str:
    """A layout name of the module's ``LAYOUTS`` (``"tp2dp2"``) as its degrees, a layout change
    (``"tp2>pp2"``) as ``TP=2 → PP=2``; other values as they are."""
    names = value.split(">") if isinstance(value, str) else []
    if names and all(n in layouts for n in names):
        return " → ".join(degrees(*layouts[n]) for n in names)
    return str(value)


def matrix_table(module_name: str) -> str:
    """The markdown table of ``module_name.CASES``: one row per case, one column per factor."""
    rows, module = _rows(module_name)
    layouts = getattr(module, "LAYOUTS", {})
    cols = list(rows[0])
    out = ["| " + " | ".join(c.replace("_", " ") for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_layout(r[c], layouts) for c in cols) + " |")
    return "\n".join(out) + f"\n\n{len(rows)} cases from `tests/{module_name}.py` (`CASES`).\n"


def generated_blocks() -> dict[str, tuple[str, str]]:
    """``{module: (page, current block text)}`` for every generated table in the docs."""
    found = {}
    for page in pages():
        for m in GENERATED.finditer(read(page)):
            found[m.group(2)] = (page, m.group(3))
    return found


def write_generated() -> list[str]:
    """Rewrite every generated table in place; returns the pages changed."""
    changed = []
    for page in pages():
        text = read(page)
        new = GENERATED.sub(lambda m: m.group(1) + matrix_table(m.group(2)) + m.group(4), text)
        if new != text:
            with open(os.path.join(REPO, page), "w", encoding="utf-8") as f:
                f.write(new)
            changed.append(page)
    return changed

