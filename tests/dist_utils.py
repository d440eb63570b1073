"""In-process multi-rank runner for tests: N spawned CPU ranks over gloo, with a timeout.

``run_ranks(fn, n, *args)`` calls ``fn(rank, *args)`` in N fresh processes with the env
of a ``deepspeed`` launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and returns
the per-rank return values.  A rank that raises fails the test with its traceback; a
hang fails after ``timeout`` seconds instead of blocking CI.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, n: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_MP_TIMEOUT=os.environ.get("DS_MP_TIMEOUT", "120"))
    import torch

    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``n`` ranks; return the results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, n, port, out, fn, args), daemon=True) for r in range(n)]
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
