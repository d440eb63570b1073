"""The tree tells the architecture: ds_mp's modules form floors, and nothing imports from a
floor above its own (no cycles either); ``import ds_mp.config`` stays light; every private
DeepSpeed name ds_mp relies on exists, and a missing one fails with a message naming it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import ds_mp

ROOT = os.path.dirname(ds_mp.__file__)

# Floors, ground first.  A module may import from its own floor or below.
FLOORS: list[tuple[str, ...]] = [
    ("ds_mp", "ds_mp.config", "ds_mp.topology", "ds_mp.deepspeed_compat", "ds_mp.atomic", "ds_mp.context_parallel.rules"),
    ("ds_mp.tensor_parallel", "ds_mp.context_parallel", "ds_mp.losses"),
    ("ds_mp.models",),
    ("ds_mp.data", "ds_mp.optim"),
    ("ds_mp.checkpoint",),
    ("ds_mp.schedules",),
    ("ds_mp.engine",),
    ("ds_mp.training",),
    ("ds_mp.tools",),
    ("ds_mp.hf",),
]


def floor_of(module: str) -> int:
    """The floor of the longest listed prefix of ``module``."""
    best, floor = -1, None
    for level, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), level
    assert floor is not None, f"{module} is on no floor; add it to FLOORS"
    return floor


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def imports_of(path: str, module: str) -> set[str]:
    """Every ds_mp module ``path`` imports, at module level or inside functions."""
    tree = ast.parse(open(path).read())
    found = set()
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ds_mp")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("ds_mp"):
                found.add(base)
    return found


def test_no_upward_imports() -> None:
    bad = []
    for module, path in modules().items():
        for target in imports_of(path, module):
            if module == "ds_mp" and target.startswith("ds_mp."):
                continue  # the package root's public API imports lazily inside functions
            if floor_of(target) > floor_of(module):
                bad.append(f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {m: {t for t in imports_of(p, m) if t in mods and t != m} for m, p in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle between concerns
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in graph[m]:
            if seen.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m)


def test_config_import_does_not_load_engines() -> None:
    code = ("import sys, ds_mp, ds_mp.config, ds_mp.data; "
            "bad = [m for m in sys.modules if m.startswith(('deepspeed.runtime.pipe.engine', 'ds_mp.engine', "
            "'ds_mp.schedules.terapipe', 'ds_mp.schedules.ouroboros'))]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_registered_schedule_resolves() -> None:
    from deepspeed.runtime.pipe.schedule import PipeSchedule

    from ds_mp.config.registry import SCHEDULES, ScheduleSpec, load, resolve, schedule_spec

    for name in SCHEDULES:
        assert issubclass(resolve(name), PipeSchedule), name
        spec = schedule_spec(name)
        assert isinstance(spec, ScheduleSpec), name
        for hook in (spec.runtime, spec.param_groups):  # every "module:function" a spec names resolves
            assert hook is None or callable(load(hook)), (name, hook)


def schedule_files(name: str) -> set[str]:
    """The modules of a built-in schedule: its spec's module (with the subpackage it sits in, e.g.
    ``schedules/terapipe/``), its timetable's, its runtime's and its parameter-group hook's."""
    from ds_mp.config.registry import SCHEDULES, schedule_spec

    spec, mods = schedule_spec(name), modules()
    owners = {SCHEDULES[name].split(":")[0]}
    for hook in (spec.timetable, spec.runtime, spec.param_groups):
        if hook is not None:
            owners.add(hook.split(":")[0] if isinstance(hook, str) else hook.__module__)
    package = next(iter(owners)).rsplit(".", 1)[0] if next(iter(owners)).endswith(".spec") else None
    return {m for m in mods if m in owners or (package and m.startswith(package + "."))}


# files that may name another schedule, and why (besides the registry table itself)
SCHEDULE_NAME_EXEMPT = {
    "ds_mp.config.schema": "the block's defaults: pipeline.schedule is 1f1b; terapipe.order takes 'gpipe'/'1f1b'",
    "ds_mp.schedules.terapipe.schedule": "terapipe.order's values 'gpipe'/'1f1b' pick its slice order",
    "ds_mp.schedules.zb_v": "ZB-V's projection table compares it with 1F1B and interleaved by name",
    "ds_mp.tools.docs_plots": "documentation: the timeline figure of each schedule",
    "ds_mp.tools.config_reference": "documentation: the link from a config block to its schedule's page",
}


def schedule_names_in(source: str, names: set[str]) -> list[str]:
    """String constants (f-string parts included) that are exactly one of ``names``."""
    return [f"line {n.lineno}: {n.value!r}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]


def test_no_builtin_schedule_name_outside_its_files() -> None:
    """Config, batching, the engine build and everything else ask a schedule's spec, never its name:
    a built-in name appears only in that schedule's own files, the registry table, and the
    exemptions above (each with its reason)."""
    from ds_mp.config.registry import SCHEDULES

    assert schedule_names_in('if s == "ouroboros" or f"{x}" in ("zb-h1",): pass', {"ouroboros", "zb-h1"}) == [
        "line 1: 'ouroboros'", "line 1: 'zb-h1'"]
    builtins = {n for n, entry in SCHEDULES.items() if isinstance(entry, str)}
    assert {"1f1b", "gpipe", "terapipe", "zb-h1", "ouroboros", "interleaved"} <= builtins
    own = {n: schedule_files(n) for n in builtins}
    bad = []
    for module, path in modules().items():
        if module in ("ds_mp.config.registry", "ds_mp.schedules.registry") or module in SCHEDULE_NAME_EXEMPT:
            continue
        foreign = {n for n in builtins if module not in own[n]}
        bad += [f"{module} {hit}" for hit in schedule_names_in(open(path).read(), foreign)]
    assert not bad, "built-in schedule names outside their own files (ask the spec):\n" + "\n".join(bad)


def test_deepspeed_private_names_exist() -> None:
    from ds_mp import deepspeed_compat as compat

    compat.check()  # the installed DeepSpeed has every name ds_mp relies on


def test_missing_private_name_fails_naming_the_assumption() -> None:
    from ds_mp import deepspeed_compat as compat
    from ds_mp.deepspeed_compat.pipeline import _owners

    owners = _owners()

    fake = type("OldPipelineEngine", (), {k: getattr(owners["engine"], k) for k in dir(owners["engine"])
                                          if k != "_next_batch" and not k.startswith("__")})
    with pytest.raises(compat.DeepSpeedIncompatible, match=r"OldPipelineEngine has no '_next_batch'.*data iterator"):
        compat.check({**owners, "engine": fake})


def test_package_is_pyflakes_clean() -> None:
    """No unused imports or names, no undefined names anywhere in ds_mp."""
    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter
    import io

    out = io.StringIO()
    warnings = checkRecursive([ROOT], Reporter(out, out))
    assert warnings == 0, out.getvalue()


THIRD_PARTY = ("torch", "deepspeed", "transformers", "peft", "accelerate", "trl")
#: Methods that change the container they are called on (a dict, list or set of someone else's state).
MUTATING_METHODS = {"update", "setdefault", "pop", "popitem", "clear", "append", "extend", "insert", "remove", "add",
                    "discard", "__setitem__", "__delitem__"}
#: Where a third-party module, class or singleton may be written, and why: the adapters.
THIRD_PARTY_WRITES_ALLOWED = {
    "ds_mp.deepspeed_compat": "DeepSpeed's internals, each write an accessor checked against DeepSpeed",
    "ds_mp.hf.compat": "Accelerate's process singletons (process_state_from_torch), checked against Accelerate",
}


def third_party_writes(source: str) -> list[str]:
    """Writes into a module, class or shared object imported from a third-party package
    (:data:`THIRD_PARTY`): a process-wide patch of someone else's function or state.  A write is an
    assignment (``x.attr = …``, ``x[k] = …``, ``x.attr += …``, ``del x.attr``, ``setattr``/``delattr``)
    or a mutating call (``x.attr.update(…)``, ``.setdefault``, ... :data:`MUTATING_METHODS`) whose
    target is reached from such a name, directly or through a local name bound to it (``shared =
    PartialState._shared_state``, ``for shared in (A._state, B._state)``).  Names are those the file
    binds by an import statement anywhere (``import torch``, ``from deepspeed.runtime.pipe import p2p``)."""
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] in THIRD_PARTY}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in THIRD_PARTY:
            imported |= {a.asname or a.name for a in node.names}

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    def reaches(expr: ast.expr) -> bool:
        """``expr`` (or, for a tuple/list, one of its elements) is reached from a third-party name."""
        if isinstance(expr, (ast.Tuple, ast.List)):
            return any(reaches(e) for e in expr.elts)
        return isinstance(expr, (ast.Attribute, ast.Subscript, ast.Name)) and root(expr) in imported

    changed = True  # local names bound to third-party state, to a fixed point
    while changed:
        changed = False
        for node in ast.walk(tree):
            pairs = [(t, node.value) for t in node.targets] if isinstance(node, ast.Assign) else \
                [(node.target, node.iter)] if isinstance(node, (ast.For, ast.comprehension)) else []
            for target, value in pairs:
                names = [e for e in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(e, ast.Name)]
                for n in names:
                    if n.id not in imported and reaches(value):
                        imported.add(n.id)
                        changed = True

    bad = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_METHODS \
                and reaches(node.func.value):
            bad.append(f"line {node.lineno}: {ast.unparse(node.func)}(…)")
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, (ast.Attribute, ast.Subscript)) and root(leaf) in imported:
                    bad.append(f"line {node.lineno}: {ast.unparse(leaf)}")
    return bad


def test_detector_sees_process_wide_patches() -> None:
    old = ("import torch\nfrom deepspeed.runtime.pipe import p2p\nimport deepspeed.ops\n"
           "def f(post):\n    torch.Tensor.backward = post\n    p2p.send = post\n"
           "    setattr(torch.Tensor, 'backward', post)\n    deepspeed.ops.x = 1\n")
    assert len(third_party_writes(old)) == 4
    singletons = ("from accelerate.state import AcceleratorState, PartialState\nimport deepspeed.ops\n"
                  "def f(fix):\n    deepspeed.ops.__compatible_ops__['shm'] = False\n"
                  "    PartialState._shared_state.update(fix)\n"
                  "    for shared in (PartialState._shared_state, AcceleratorState._shared_state):\n"
                  "        shared.update(fix)\n    s = AcceleratorState._shared_state\n    s['x'] = 1\n"
                  "    s.setdefault('y', 2)\n")
    assert len(third_party_writes(singletons)) == 5, third_party_writes(singletons)
    fine = ("import torch\ndef f(t, engine, d):\n    t.grad = None\n    engine.x = torch.ones(1)\n"
            "    y = torch.zeros(2)\n    y[0] = 1\n    d.update(a=torch.ones(1))\n")
    assert third_party_writes(fine) == []


def test_nothing_patches_a_third_party_module_or_class() -> None:
    """No module of the package writes into torch, DeepSpeed, transformers, PEFT, Accelerate or TRL
    modules, classes or singletons (ZB-H1's input-only backward is a scoped ``TorchFunctionMode``;
    posted sends are ds_mp's own ``isend``s, ``engine/p2p.py``), except the adapters
    (:data:`THIRD_PARTY_WRITES_ALLOWED`)."""
    bad = []
    for module, path in modules().items():
        if any(module == m or module.startswith(m + ".") for m in THIRD_PARTY_WRITES_ALLOWED):
            continue
        bad += [f"{module} {hit}" for hit in third_party_writes(open(path).read())]
    assert not bad, "process-wide patches of third-party code:\n" + "\n".join(bad)


#: DeepSpeed internals that are not underscored: used only in deepspeed_compat/ (accessors there).
DEEPSPEED_INTERNALS = {"agg_train_loss", "grad_layer", "bf16_groups", "fp32_groups_gradients",
                       "get_gradient_for_reduction", "clear_lp_grads", "activation_checkpoint_func", "forward_funcs",
                       "is_checkpointable_results", "tied_modules", "tied_comms", "prev_stage", "next_stage"}


def deepspeed_private_names() -> set[str]:
    """Every underscored name DeepSpeed's pipeline engine, its base engine and the pipeline module
    define (class attributes and ``self._x =`` in their source)."""
    import inspect
    import re

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    names: set[str] = set()
    for cls in (PipelineEngine, PipelineModule, DeepSpeedEngine):
        for k in cls.__mro__:
            if k.__module__.startswith("deepspeed"):
                names |= {n for n in vars(k) if n.startswith("_") and not n.startswith("__")}
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*=", inspect.getsource(cls)))
    return names


def deepspeed_internal_uses(source: str, private: set[str]) -> list[str]:
    """Uses of DeepSpeed internals in ``source``: an attribute or a method definition named in
    ``private`` or :data:`DEEPSPEED_INTERNALS`, ``<…>module.parts``, an import from a private
    torch/DeepSpeed module (a dotted path with an underscored part)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute):
            base = node.value
            is_module = (isinstance(base, ast.Name) and base.id == "module") or \
                (isinstance(base, ast.Attribute) and base.attr == "module")
            if node.attr in private or node.attr in DEEPSPEED_INTERNALS or (node.attr == "parts" and is_module):
                name = ast.unparse(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private:
            name = f"def {node.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            parts = (node.module or "").split(".")
            if parts[0] in ("torch", "deepspeed") and any(p.startswith("_") for p in parts[1:]):
                name = f"from {node.module} import …"
        if name:
            bad.append(f"line {node.lineno}: {name}")
    return bad


def test_detector_sees_deepspeed_internals() -> None:
    old = ("from torch.distributed.pipelining._backward import stage_backward_weight\n"
           "class E:\n    def _exec_reduce_tied_grads(self):\n        self.grad_layer = self.module.parts\n"
           "        self.optimizer.clear_lp_grads()\n        return self._INSTRUCTION_MAP\n")
    assert len(deepspeed_internal_uses(old, deepspeed_private_names())) == 6
    fine = "def f(self, engine):\n    self.parts = compat.stage_bounds(engine.module)\n    return self.parts[0]\n"
    assert deepspeed_internal_uses(fine, deepspeed_private_names()) == []


def test_deepspeed_internals_only_in_deepspeed_compat() -> None:
    """Every private DeepSpeed name and internal attribute (and torch's private split backward) is
    used only inside ``ds_mp/deepspeed_compat/``, behind accessors checked when an engine is built."""
    from transformers import Trainer

    private, bad = deepspeed_private_names(), []
    trainer_names = {n for k in Trainer.__mro__ for n in vars(k)}  # ds_mp/hf overrides the Trainer's (e.g.
    for module, path in modules().items():                       # _save_checkpoint, a name DeepSpeed shares)
        if module.startswith("ds_mp.deepspeed_compat"):
            continue
        names = private - trainer_names if module.startswith("ds_mp.hf") else private
        bad += [f"{module} {hit}" for hit in deepspeed_internal_uses(open(path).read(), names)]
    assert not bad, "DeepSpeed internals outside deepspeed_compat/:\n" + "\n".join(bad)


def test_adapter_overrides_are_checked() -> None:
    """The adapter's overrides of DeepSpeed's private hooks come from the class itself, each one
    checked against DeepSpeed (``_exec_reduce_tied_grads`` included), and a rename fails naming it."""
    from ds_mp import deepspeed_compat as compat
    from ds_mp.deepspeed_compat.engine_adapter import HANDLERS, PipelineEngineAdapter

    names = compat.check_overrides()
    assert {"_exec_reduce_tied_grads", "_INSTRUCTION_MAP", *HANDLERS} <= set(names)
    renamed = type("Adapter", (PipelineEngineAdapter,), {"_exec_reduce_tied_grad_sums": lambda self: None})
    with pytest.raises(compat.DeepSpeedIncompatible, match="no '_exec_reduce_tied_grad_sums'"):
        compat.check_overrides(renamed)


RUNTIMES = ("ds_mp.engine.zero_bubble", "ds_mp.engine.terapipe", "ds_mp.engine.interleaved", "ds_mp.engine.ouroboros")


def engine_writes(source: str) -> list[str]:
    """Assignments to an attribute of the engine (``engine.x =``, ``e.x =``, ``self.engine.x =``)."""
    def is_engine(expr: ast.expr) -> bool:
        return (isinstance(expr, ast.Name) and expr.id in ("engine", "e")) or \
            (isinstance(expr, ast.Attribute) and expr.attr == "engine")

    bad = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, ast.Attribute) and is_engine(leaf.value):
                    bad.append(f"line {node.lineno}: {ast.unparse(leaf)}")
    return bad


def test_schedule_runtimes_own_their_state() -> None:
    """A schedule's runtime keeps its state and handlers itself: it sets no attribute on the engine
    (no ``engine.zero_bubble =``, no instance method shadowing an engine's)."""
    assert len(engine_writes("def f(engine, e):\n    engine.terapipe = 1\n    e.is_first_stage = g\n"
                             "    self.engine.x, y = 1, 2\n")) == 3
    mods = modules()
    bad = [f"{m} {hit}" for m in RUNTIMES for hit in engine_writes(open(mods[m]).read())]
    assert not bad, "schedule runtimes writing to the engine:\n" + "\n".join(bad)


# where an engine attribute may be set from outside the engine class, and why
ENGINE_WRITES_ALLOWED = {
    "ds_mp.deepspeed_compat": "the adapter door: DeepSpeed's own attributes, set only through named accessors",
}


def test_nothing_sets_engine_attributes_from_outside() -> None:
    """Everything the engine needs is given at construction or through one of its methods
    (``use_noise_probe``, ``record_trace``): no ``engine.X =`` anywhere in the package outside the
    engine class, except the DeepSpeed accessors (:data:`ENGINE_WRITES_ALLOWED`)."""
    bad = []
    for module, path in modules().items():
        if any(module == m or module.startswith(m + ".") for m in ENGINE_WRITES_ALLOWED):
            continue
        bad += [f"{module} {hit}" for hit in engine_writes(open(path).read())]
    assert not bad, "attributes set on an engine from outside its class:\n" + "\n".join(bad)


MAX_LINES = 400
# files allowed past MAX_LINES until the work named beside them (none today)
LONG_FILES: dict[str, str] = {}


def test_files_stay_small() -> None:
    """No module past :data:`MAX_LINES` lines (a file that grows that long holds two concerns)."""
    long = {m: n for m, path in modules().items() if (n := len(open(path).read().splitlines())) > MAX_LINES}
    assert set(long) <= set(LONG_FILES), f"files over {MAX_LINES} lines (split them by concern): " + ", ".join(
        f"{m} ({n})" for m, n in sorted(long.items()) if m not in LONG_FILES)


# --- model families: one folder each, one registry, DeepSpeed's module protocol in compat (#42) ---

FAMILY_FILES = ("__init__.py", "plan.py", "layers.py", "hf_adapter.py")


def model_type_literals(source: str, model_types: set[str]) -> list[str]:
    """Tables keyed by model type outside the registry: a dict literal with a registered
    ``model_type`` as a key, or a tuple/list/set literal holding two or more of them."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in model_types]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            keys = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in model_types]
            keys = keys if len(keys) > 1 else []
        else:
            continue
        if keys:
            bad.append(f"line {node.lineno}: {keys}")
    return bad


def test_one_family_registry() -> None:
    """``ds_mp.config.families.FAMILIES`` is the only table keyed by model type (config's views
    and the families' ``model_types``/``architectures`` derive from it), and every entry resolves to
    a family folder whose ``FAMILY`` has the entry's name."""
    from ds_mp.config.families import FAMILIES
    from ds_mp.models.family import family_named

    types = set(FAMILIES)
    assert model_type_literals('A = {"gpt2": 1}\nB = ("llama", "qwen2")\nC = ("gpt2",)\n', types) == [
        "line 1: ['gpt2']", "line 2: ['llama', 'qwen2']"]
    bad = []
    for module, path in modules().items():
        if module != "ds_mp.config.families":
            bad += [f"{module} {hit}" for hit in model_type_literals(open(path).read(), types)]
    assert not bad, "tables keyed by model type outside ds_mp/config/families.py:\n" + "\n".join(bad)
    for model_type, entry in FAMILIES.items():
        family = family_named(model_type)
        assert family.name == entry.family and model_type in family.model_types, model_type
        folder = os.path.join(os.path.dirname(ROOT), *entry.package.split("."))
        missing = [f for f in FAMILY_FILES if not os.path.isfile(os.path.join(folder, f))]
        assert not missing, f"{entry.package} is not a family folder: no {', '.join(missing)}"


def literal_kinds(source: str) -> list[str]:
    """Calls that pass a shard kind as a literal (``kind="qkv"``): a cut picked by hand, not read
    from the plan."""
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and any(k.arg == "kind" and isinstance(k.value, ast.Constant) for k in n.keywords)]


def test_family_layers_are_built_from_the_plan() -> None:
    """A family's layers take their TP cut from its plan (the table that also shards its checkpoints),
    never a hand-written ``kind=``: change the plan and both follow."""
    from ds_mp.config.families import FAMILIES

    assert len(literal_kinds('ColumnParallelLinear(w, b, kind="qkv")\nf(kind=plan[k])\n')) == 1
    bad = []
    for package in {e.package for e in FAMILIES.values()}:
        path = modules()[package + ".layers"]
        bad += [f"{package}.layers {hit}" for hit in literal_kinds(open(path).read())]
    assert not bad, "layers cut by hand instead of by the plan:\n" + "\n".join(bad)


def test_ctx_and_families_sit_below_the_pipeline() -> None:
    """``Ctx`` has its own module, importing neither the pipeline nor a family, and no family imports
    the pipeline: ``family_named`` imports a family by name, so a family importing the pipeline
    (which imports ``family``) would be a cycle no import statement shows."""
    from ds_mp.config.families import FAMILIES

    mods = modules()
    packages = {e.package for e in FAMILIES.values()}
    bad = [t for t in imports_of(mods["ds_mp.models.ctx"], "ds_mp.models.ctx")
           if t == "ds_mp.models.pipeline" or any(t == p or t.startswith(p + ".") for p in packages)]
    for module, path in mods.items():
        if any(module == p or module.startswith(p + ".") for p in packages):
            bad += [f"{module} imports {t}" for t in imports_of(path, module) if t == "ds_mp.models.pipeline"]
    assert not bad, "\n".join(bad)


DEEPSPEED_CLASSES = {"PipelineModule", "PipelineEngine", "DeepSpeedEngine"}


def deepspeed_subclasses(source: str) -> list[str]:
    """Classes deriving directly from one of DeepSpeed's :data:`DEEPSPEED_CLASSES`."""
    return [f"line {n.lineno}: class {n.name}" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)
            and any((b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)) in DEEPSPEED_CLASSES
                    for b in n.bases)]


def test_deepspeed_classes_subclassed_only_in_compat() -> None:
    """DeepSpeed's engine and module are subclassed only by the adapters in ``deepspeed_compat/``;
    ds_mp's own classes derive from the adapters."""
    assert len(deepspeed_subclasses("class A(PipelineModule): pass\nclass B(pipe.PipelineEngine): pass\n")) == 2
    bad = []
    for module, path in modules().items():
        if not module.startswith("ds_mp.deepspeed_compat"):
            bad += [f"{module} {hit}" for hit in deepspeed_subclasses(open(path).read())]
    assert not bad, "DeepSpeed classes subclassed outside deepspeed_compat/:\n" + "\n".join(bad)


def test_deepspeed_layer_naming_decoded_only_in_compat() -> None:
    """DeepSpeed's names for a pipeline's parameters (``tied_modules.<key>.…`` for a tied layer) are
    decoded by ``PipelineModuleAdapter.param_layer`` alone: no other module spells the prefix."""
    bad = []
    for module, path in modules().items():
        if module.startswith("ds_mp.deepspeed_compat"):
            continue
        bad += [f"{module} line {n.lineno}" for n in ast.walk(ast.parse(open(path).read()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and "tied_modules" in n.value]
    assert not bad, "DeepSpeed's tied_modules naming outside deepspeed_compat/:\n" + "\n".join(bad)


def test_module_adapter_overrides_are_checked() -> None:
    """The module adapter's overrides of DeepSpeed's build hooks are read off the class and checked
    against DeepSpeed at engine build (``compat.check_overrides()``); a rename fails naming it."""
    from ds_mp import deepspeed_compat as compat
    from ds_mp.deepspeed_compat.pipeline_module import PipelineModuleAdapter

    assert {"_build", "_partition_layers", "_synchronize_tied_weights"} <= set(compat.check_overrides())
    renamed = type("Adapter", (PipelineModuleAdapter,), {"_build_stage": lambda self: None})
    with pytest.raises(compat.DeepSpeedIncompatible, match="PipelineModule has no '_build_stage'"):
        compat.check_overrides(renamed)


# --- #42 runparts: short functions, typed engines, one config parse ----------------------------------
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_FOLDERS = ("ds_mp.training", "ds_mp.config", "ds_mp.engine")
# functions allowed past MAX_FUNCTION_LINES, by "module.qualname", with the reason
LONG_FUNCTIONS: dict[str, str] = {}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(qualname, lines)`` of every function or method of ``source`` longer than ``limit`` lines
    (decorators and docstring included)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    if child.end_lineno - first + 1 > limit:
                        found.append((name, child.end_lineno - first + 1))
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def test_long_function_detector() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(70))
    source = f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n"
    assert long_functions(source) == [("C.long", 71)]


def test_functions_stay_short() -> None:
    """No function over :data:`MAX_FUNCTION_LINES` lines in training/, config/ and engine/: a longer
    one does several things, each of which deserves a name (exemptions in :data:`LONG_FUNCTIONS`)."""
    bad = [f"{module}.{name} ({n} lines)" for module, path in sorted(modules().items())
           if any(module == f or module.startswith(f + ".") for f in SHORT_FUNCTION_FOLDERS)
           for name, n in long_functions(open(path).read()) if f"{module}.{name}" not in LONG_FUNCTIONS]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them, one named step each):\n" + "\n".join(bad)


# modules whose `engine` parameters may stay untyped, with the reason (none today)
UNTYPED_ENGINE_ALLOWED: dict[str, str] = {}


def untyped_engine_params(source: str) -> list[str]:
    """Parameters or fields named ``engine`` annotated ``Any`` (what the function reads is written nowhere)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            targets = [(p.arg, p.annotation, p.lineno) for p in a.posonlyargs + a.args + a.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [(node.target.id, node.annotation, node.lineno)]
        hits += [f"line {line}" for name, ann, line in targets
                 if name == "engine" and isinstance(ann, ast.Name) and ann.id == "Any"]
    return hits


def test_engine_parameters_are_typed() -> None:
    """Every ``engine`` parameter says what it reads: :class:`ds_mp.engine_view.EngineView`, the
    runtime's :class:`ds_mp.engine.view.RuntimeEngine`, or DeepSpeed's ``PipelineEngine`` in
    deepspeed_compat — never ``Any`` (:data:`UNTYPED_ENGINE_ALLOWED` aside)."""
    assert untyped_engine_params("def f(engine: Any, x: Any): ...\nclass S:\n    engine: Any\n") == ["line 1", "line 3"]
    bad = [f"{module} {hit}" for module, path in sorted(modules().items())
           if not any(module == m or module.startswith(m + ".") for m in UNTYPED_ENGINE_ALLOWED)
           for hit in untyped_engine_params(open(path).read())]
    assert not bad, "`engine: Any` parameters (type them):\n" + "\n".join(bad)


def test_config_validation_has_no_side_effects() -> None:
    """``validate`` returns a filled copy and leaves its input as it was; it reads no environment
    (the world size is an argument) and a model directory only through ``resolve_model_source``."""
    from ds_mp.config import ConfigError, parse_config, validate

    cfg = parse_config({"tensor_parallel": {"size": 2}, "model": {"n_layer": 2, "n_embd": 32, "n_head": 4}})
    before = repr(cfg), cfg.dp, cfg.world_size, cfg.shape
    done = validate(cfg, 4)
    assert (done.dp, done.world_size, done.shape.n_layer) == (2, 4, 2)
    assert (repr(cfg), cfg.dp, cfg.world_size, cfg.shape) == before
    with pytest.raises(ConfigError, match="resolve_model_source"):
        validate(parse_config({"model": "gpt2"}), 1)
