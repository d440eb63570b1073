"""README.md and docs/ stay true (conventions: docs/README.md, "Examples are tested").

* Every fenced ``bash``/``python`` block marked ``<!-- runnable -->`` runs, at tiny sizes, in a
  scratch directory per page (blocks of a page in order, like a reader following it), against
  fixtures that stand in for the user's text and for the Hugging Face Hub (an offline cache in
  which ``gpt2`` is a tiny GPT-2).  Blocks marked ``runnable: launcher`` start the real
  ``deepspeed`` launcher on CPU ranks; they run in their own test per page (``-m launcher``),
  in order among themselves, with ``append="ARGS"`` appended to every ``deepspeed`` command.
* Every bash/python block of ds_mp's own pages is marked (runnable, or not-runnable with a reason).
* Relative links and their ``#anchors`` resolve; tests and repository paths named in backticks exist.
* docs/img PNGs are small, shown by a page, and that page names the command that makes them.
* The combination tables equal the tests' case lists (:data:`docs_utils.MATRICES`), and
  docs/config.md is what ``python -m ds_mp.tools.config_reference --write`` writes.

``python tests/test_docs.py --write`` regenerates the tables and docs/config.md.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field

import pytest

from docs_utils import (MATRICES, OTHERS_PAGES, REPO, Block, blocks, clipping_errors, generated_blocks,
                        link_errors, marking_errors, matrix_table, named_thing_errors, pages, read, write_generated)

LINKED = ("ds_configs", "launch", "benchmarks", "scripts")  # symlinked into every page's scratch dir
CORPUS = ("textwrap", "shlex", "fnmatch", "glob", "colorsys", "bisect", "heapq")  # stdlib modules as "your text"
PREAMBLE = """set -eo pipefail
free_port() { python "$DOCS_TESTS/ports.py"; }
deepspeed() { command deepspeed --master_port "$(free_port)" "$@" $DOCS_APPEND; }
"""


def _to_run(page: str, launcher: bool) -> list[Block]:
    """The page's runnable blocks of this kind, less those an earlier page repeats verbatim (the
    README's examples reappear at the top of their pages; each runs once)."""
    earlier = {(b.code, b.options) for p in pages()[:pages().index(page)] for b in blocks(p)
               if b.marker == "runnable"}
    return [b for b in blocks(page) if b.marker == "runnable" and b.launcher == launcher
            and (b.code, b.options) not in earlier]


def _runnable(launcher: bool) -> list:
    """pytest params: one per page that has runnable blocks of this kind."""
    out = []
    for page in pages():
        if _to_run(page, launcher):
            marks = [pytest.mark.launcher, pytest.mark.slow, pytest.mark.timeout(900)] if launcher else \
                [pytest.mark.timeout(400)]
            out.append(pytest.param(page, id=page, marks=marks))
    return out


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict:
    """Your text (``my_corpus/``, ``held_out.txt``, ``lambada_test.jsonl``) and an offline Hub
    cache holding ``gpt2``: 2 layers × 64, n_positions 1024, a 400-token BPE trained on my_corpus."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from ds_mp.data import DatasetInfo, prepare_data

    root = tmp_path_factory.mktemp("docs_fixtures")
    stdlib = sysconfig.get_paths()["stdlib"]
    (root / "my_corpus").mkdir()
    for name in CORPUS:
        shutil.copy(os.path.join(stdlib, name + ".py"), root / "my_corpus" / (name + ".txt"))
    shutil.copy(os.path.join(stdlib, "string.py"), root / "held_out.txt")
    with open(root / "lambada_test.jsonl", "w") as f:
        for text in ("def main(): return main", "import os and import sys and import os",
                     "the quick brown fox jumps over the lazy fox"):
            f.write(json.dumps({"text": text}) + "\n")
    data = prepare_data([str(root / "my_corpus")], str(root / "tok_data"), vocab_size=400, val_fraction=0.3,
                        show_progress=False)
    tok = AutoTokenizer.from_pretrained(DatasetInfo.load(str(root / "tok_data")).tokenizer_dir)
    del data
    repo = root / "hf_home" / "hub" / "models--gpt2"
    snap = repo / "snapshots" / ("d" * 40)
    eos = tok.eos_token_id
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tok), n_positions=1024,
                               bos_token_id=eos, eos_token_id=eos)).save_pretrained(str(snap))
    tok.save_pretrained(str(snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)
    return {"root": str(root), "hf_home": str(root / "hf_home")}


def _scratch(tmp: str, fx: dict) -> str:
    for name in LINKED:
        os.symlink(os.path.join(REPO, name), os.path.join(tmp, name))
    shutil.copytree(os.path.join(fx["root"], "my_corpus"), os.path.join(tmp, "my_corpus"))
    for name in ("held_out.txt", "lambada_test.jsonl"):
        shutil.copy(os.path.join(fx["root"], name), tmp)
    return tmp


def _env(fx: dict, block: Block) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), HF_HOME=fx["hf_home"],
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_MP_TIMEOUT="60", PYTHONUNBUFFERED="1",
               MPLBACKEND="Agg", DOCS_APPEND=block.append, DOCS_TESTS=os.path.dirname(os.path.abspath(__file__)))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(block: Block, cwd: str, fx: dict, timeout: float) -> None:
    script = os.path.join(cwd, f"example_{block.line}.{'py' if block.lang == 'python' else 'sh'}")
    with open(script, "w") as f:
        f.write(block.code if block.lang == "python" else PREAMBLE + block.code)
    cmd = [sys.executable if block.lang == "python" else "bash", script]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(fx, block), capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{block.where} ({block.lang}) exited {proc.returncode}:\n{block.code}\n---\n{out}"


def _run_page(page: str, launcher: bool, tmp_path, fx: dict, timeout: float) -> None:
    cwd = _scratch(str(tmp_path), fx)
    for block in _to_run(page, launcher):
        _run(block, cwd, fx, timeout)


@pytest.mark.parametrize("page", _runnable(launcher=False))
def test_examples_run(page: str, tmp_path, fixtures) -> None:
    _run_page(page, False, tmp_path, fixtures, timeout=300)


@pytest.mark.parametrize("page", _runnable(launcher=True))
def test_launcher_examples_run(page: str, tmp_path, fixtures) -> None:
    _run_page(page, True, tmp_path, fixtures, timeout=600)


# ------------------------------------------------------------------ markers, links, names

def test_every_example_is_marked() -> None:
    errors = [e for p in pages() if p not in OTHERS_PAGES for e in marking_errors(p)]
    assert not errors, "\n".join(errors)
    assert sum(b.marker == "runnable" for p in pages() for b in blocks(p)) >= 10


def test_marking_check_catches_what_it_should() -> None:
    text = ("<!-- runnable -->\n```bash\necho ok\n```\n\n```python\nprint(1)\n```\n"
            "<!-- not-runnable -->\n```bash\nx\n```\n<!-- runnable: lanucher -->\n```bash\ny\n```\n"
            "```json\n{}\n```\n<!-- runnable: launcher append=\"--steps 2\" -->\n```bash\nz\n```\n")
    found = blocks("docs/x.md", text)
    assert [b.line for b in found] == [2, 6, 10, 14, 17, 21] and found[5].launcher and found[5].append == "--steps 2"
    errors = marking_errors("docs/x.md", text)
    assert len(errors) == 3, errors
    assert "docs/x.md:6" in errors[0] and "needs a reason" in errors[1] and "lanucher" in errors[2]


def test_every_deepspeed_config_example_names_gradient_clipping() -> None:
    """Issue 43 item 15: without the key DeepSpeed clips at 1.0, so no example leaves it out."""
    errors = [e for p in pages() for e in clipping_errors(p)]
    for path in sorted(glob.glob(os.path.join(REPO, "ds_configs", "*.json"))):
        with open(path) as f:
            if "gradient_clipping" not in json.load(f):
                errors.append(f"{os.path.relpath(path, REPO)}: no \"gradient_clipping\"")
    assert not errors, "\n".join(errors)
    missing = '<!-- runnable -->\n```python\nconfig = {"optimizer": {"type": "SGD"}}\n```\n```json\n{"optimizer": {}}\n```\n'
    assert [e.split(":")[1] for e in clipping_errors("docs/x.md", missing)] == ["2", "5"]
    assert not clipping_errors("docs/x.md", missing.replace('"SGD"}', '"SGD"}, "gradient_clipping": 0.0'
                                                           ).replace('{"optimizer": {}}', '{}'))


def test_relative_links_resolve() -> None:
    errors = [e for p in pages() for e in link_errors(p)]
    assert not errors, "\n".join(errors)


def test_link_check_catches_broken_links() -> None:
    text = ("[ok](layouts.md#what-combines-with-what) [gone](nowhere.md) [bad anchor](layouts.md#no-such)"
            " [web](https://example.com) `[code](not-a-link.md)`\n```\n[fenced](also-not.md)\n```\n")
    errors = link_errors("docs/README.md", text)
    assert len(errors) == 2 and "nowhere.md" in errors[0] and "#no-such" in errors[1], errors


def test_named_tests_and_paths_exist() -> None:
    errors = [e for p in pages() for e in named_thing_errors(p)]
    assert not errors, "\n".join(errors)


def test_pictures_are_small_linked_and_say_how_they_were_made() -> None:
    """Every docs/img PNG is under 200 KiB and shown by some page; every page showing one names
    the command that makes it (``python -m ds_mp.tools.docs_plots``)."""
    shown: set[str] = set()
    for page in pages():
        text = read(page)
        used = set(re.findall(r"!\[[^\]]*\]\((?:docs/)?(img/[^)\s]+\.png)\)", text))
        assert not used or "python -m ds_mp.tools.docs_plots" in text, f"{page} shows {sorted(used)} without its command"
        shown |= used
    pngs = {f"img/{name}" for name in os.listdir(os.path.join(REPO, "docs", "img")) if name.endswith(".png")}
    assert pngs and pngs == shown, f"PNGs no page shows: {sorted(pngs - shown)}; missing: {sorted(shown - pngs)}"
    big = {p: os.path.getsize(os.path.join(REPO, "docs", p)) for p in pngs}
    assert all(size < 200 * 1024 for size in big.values()), big


# ------------------------------------------------------------------ generated content

def test_combination_tables_equal_the_tests_case_lists() -> None:
    found = generated_blocks()
    for module in MATRICES:
        assert module in found, f"no '<!-- generated: {module} -->' table in README.md or docs/"
        page, current = found[module]
        assert current == matrix_table(module), \
            f"{page}: the {module} table differs from tests/{module}.py; run python tests/test_docs.py --write"


def test_case_tables_show_layouts_changes_and_dict_cases(monkeypatch) -> None:
    """The table renderer on a stand-in module: dict cases, LAYOUTS names as degrees, a layout
    change as an arrow, MATRICES' row function where given."""
    import types

    import docs_utils

    fake = types.ModuleType("fake_cases")
    fake.LAYOUTS = {"tp2": (2, 1, 1), "pp2dp2": (1, 2, 2)}
    fake.CASES = [{"precision": "fp32", "change": "tp2>pp2dp2"}, {"precision": "bf16", "change": "pp2dp2"}]
    monkeypatch.setitem(sys.modules, "fake_cases", fake)
    monkeypatch.setitem(docs_utils.MATRICES, "fake_cases", None)
    assert matrix_table("fake_cases").splitlines()[:4] == [
        "| precision | change |", "|---|---|", "| fp32 | TP=2 → PP=2 × DP=2 |", "| bf16 | PP=2 × DP=2 |"]
    monkeypatch.setitem(docs_utils.MATRICES, "fake_cases", lambda c: {"p": c["precision"].upper()})
    assert matrix_table("fake_cases").splitlines()[2] == "| FP32 |"


def test_config_reference_is_current() -> None:
    from ds_mp.tools import config_reference

    keys = config_reference.reference()  # raises UndocumentedKey naming every key without a comment
    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        assert f.read() == config_reference.render(keys), \
            "docs/config.md is stale; run python -m ds_mp.tools.config_reference --write"
    assert {"tensor_parallel.size", "pipeline.schedule", "model.n_layer", "lora.r"} <= {k.key for k in keys}


@dataclass
class _Inner:
    documented: int = 1  # a trailing comment
    # a comment block above
    # on two lines
    above: str = "x"
    bare: bool = False


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    items: list = field(default_factory=lambda: [1, 2])  # a list
    hidden: int = field(default=0, repr=False)


def test_config_reference_reads_comments_and_refuses_an_undocumented_key() -> None:
    from ds_mp.tools.config_reference import UndocumentedKey, field_comments, reference

    assert field_comments(_Inner) == {"documented": "a trailing comment", "above": "a comment block above on two lines",
                                      "bare": ""}
    with pytest.raises(UndocumentedKey, match=r"config keys without a '# comment' in ds_mp/config/schema.py: inner\.bare;"):
        reference(_Outer)  # inner.documented, inner.above and items are documented; hidden is not a key


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_docs.py --write   (regenerate the docs' generated tables and config.md)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print("rewrote:", ", ".join(write_generated()) or "nothing")
    from ds_mp.tools.config_reference import main

    sys.exit(main(["--write"]))
