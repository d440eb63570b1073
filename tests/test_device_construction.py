"""Device-correct by construction: NCCL refuses CPU tensors, and this CPU machine cannot show a
tensor built on the wrong device.  So the source is checked instead: in every ds_mp function that
calls a ``torch.distributed`` collective, every tensor factory (``torch.zeros``, ``torch.tensor``,
``torch.arange``, ...) names its ``device=`` — or is on :data:`ALLOWED` with the reason it never
reaches a collective.  ``*_like`` factories inherit their argument's device and pass.

(The dynamic twin is ``test_combinations.CollectiveDeviceGuard``: it marks factory-made tensors
without a device and fails when one reaches a collective, in training steps and in the lifecycle
tests' saves and loads.)"""
from __future__ import annotations

import ast
import os

import ds_mp

ROOT = os.path.dirname(ds_mp.__file__)
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "linspace",
             "as_tensor", "eye", "empty_strided"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "send", "recv",
               "isend", "irecv", "all_to_all_single", "gather", "scatter", "batch_isend_irecv"}

# (module path relative to ds_mp/, function, factory): tensors made here never enter a collective.
ALLOWED: set[tuple[str, str, str]] = set()


def _calls(fn: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)]


def _attr(call: ast.Call) -> tuple[str | None, str | None]:
    f = call.func
    if isinstance(f, ast.Attribute):
        base = f.value.id if isinstance(f.value, ast.Name) else getattr(f.value, "attr", None)
        return base, f.attr
    return None, f.id if isinstance(f, ast.Name) else None


def offenders() -> list[str]:
    bad = []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            tree = ast.parse(open(path).read())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                calls = _calls(fn)
                if not any(_attr(c)[0] in ("dist", "ds_dist", "comm", "distributed") and _attr(c)[1] in COLLECTIVES
                           for c in calls):
                    continue
                for c in calls:
                    base, attr = _attr(c)
                    if base == "torch" and attr in FACTORIES and not any(k.arg == "device" for k in c.keywords):
                        if (rel, fn.name, attr) not in ALLOWED:
                            bad.append(f"{rel}:{c.lineno} {fn.name}(): torch.{attr}(...) without device=")
    return bad


def test_factories_feeding_collectives_name_a_device():
    assert offenders() == []


def test_the_check_catches_a_cpu_buffer(tmp_path, monkeypatch):
    """The check is not vacuous: a collective on ``torch.zeros(n)`` (the bug of issue 27 item 4)
    is reported."""
    pkg = tmp_path / "ds_mp"
    pkg.mkdir()
    (pkg / "bad.py").write_text("import torch\nimport torch.distributed as dist\n\n"
                                "def gather(n):\n    buf = torch.zeros(n)\n    dist.all_reduce(buf)\n    return buf\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(pkg))
    assert offenders() == ["bad.py:5 gather(): torch.zeros(...) without device="]
