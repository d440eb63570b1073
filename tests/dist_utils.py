"""In-process multi-rank runner for tests: N spawned CPU ranks over gloo, with a timeout.

``run_ranks(fn, n, *args)`` calls ``fn(rank, *args)`` in N fresh processes with the env
of a ``deepspeed`` launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and returns
the per-rank return values.  A rank that raises fails the test with its traceback; a
hang fails after ``timeout`` seconds instead of blocking CI.

Ranks are forked from one forkserver that has imported torch, DeepSpeed, transformers, PEFT,
datasets, TRL and ds_mp once (:data:`THIRD_PARTY`, :func:`_ds_mp_modules`): a freshly spawned
interpreter spends 3-10 s importing them, which was paid by every rank of every multi-rank test.
Each rank still starts from a clean state: no collective, engine or thread pool exists before the
fork, and the caller's current environment is installed in the rank (the forkserver's own was
captured when it started).  A persistent pool of rank processes reused across tests (DeepSpeed's
``reuse_dist_env``) was measured and not adopted: with these preloads a 2-rank engine test pays
about 1 s of start-up per call (0.2 s of it its own work), while a reused rank would carry each
test's process groups, signal handlers, threads, environment and library singletons into the next.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp
from ports import free_port


#: Third-party modules imported once by the forkserver, so forked ranks start with them loaded
#: (``datasets`` alone took 3 s per rank of every Trainer-path test; ``setuptools`` and DeepSpeed's
#: op list are what ``deepspeed.init_distributed`` imports; MoE/auto-EP what its engine imports).
THIRD_PARTY = ["torch", "torch.distributed", "deepspeed", "deepspeed.runtime.pipe.engine", "deepspeed.comm.mori",
               "deepspeed.ops.op_builder.all_ops", "deepspeed.module_inject.auto_ep_layer", "setuptools",
               "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
               "peft", "accelerate", "datasets", "trl"]
#: ds_mp modules the forkserver leaves to the ranks: ``ds_mp.hf``'s import has side effects whose
#: import order is under test, and the plotting tools pull in matplotlib.
NOT_PRELOADED = ("ds_mp.hf", "ds_mp.tools.viz", "ds_mp.tools.docs_plots", "ds_mp.tools.sft_plot")


def _ds_mp_modules() -> list[str]:
    """Every module of the ds_mp package on disk, less :data:`NOT_PRELOADED` (found without importing)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = []
    for folder, dirs, files in os.walk(os.path.join(root, "ds_mp")):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        package = os.path.relpath(folder, root).replace(os.sep, ".")
        names += [package if f == "__init__.py" else f"{package}.{f[:-3]}" for f in sorted(files) if f.endswith(".py")]
    return [n for n in names if not any(n == p or n.startswith(p + ".") for p in NOT_PRELOADED)]


_context: Any = None


def _spawn_context() -> Any:
    """The forkserver context (started on first use, preloading :data:`THIRD_PARTY` and ds_mp)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(THIRD_PARTY + _ds_mp_modules())
    return _context


def _entry(rank: int, n: int, port: int, out_dir: str, fn: Callable, args: tuple, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_MP_TIMEOUT=os.environ.get("DS_MP_TIMEOUT", "120"))
    import torch
    from cpu_fp16 import allow_cpu_fp16

    torch.set_num_threads(1)
    allow_cpu_fp16()  # as conftest does in the pytest process
    try:
        result: Any = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``n`` ranks; return the results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = _spawn_context()
        port = free_port()
        environ = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(r, n, port, out, fn, args, environ), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s (deadlock?)")
        results, errors = [], []
        for r in range(n):
            path = os.path.join(out, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} died without a result (exit code {procs[r].exitcode})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} failed:\n{value}")
            results.append(value)
        if errors:
            # A crashing rank makes its peers fail with "connection closed": show every rank.
            raise RuntimeError("\n".join(errors))
        return results
