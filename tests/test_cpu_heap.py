"""A CPU engine keeps freed memory in the heap (``ds_mp.engine.cpu_heap``): a step's worth of
freed memory is not handed back to the kernel (to be faulted in again), the engine asks for it
on CPU, and a user's own glibc malloc variables are left alone."""
from __future__ import annotations

import subprocess
import sys

from dist_utils import run_ranks
from helpers import ds_config, tiny_gpt2

CHURN = """
import ctypes, os, torch
from ds_mp.engine.cpu_heap import M_MMAP_THRESHOLD, keep_freed_memory

def returned():  # MiB given back to the kernel when a step-like 160 MiB of 1 MiB blocks is freed
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    blocks = [torch.ones(1 << 18) for _ in range(160)]
    held = rss()
    del blocks
    return held - rss()

# glibc's start-up state, pinned: 1 MiB blocks are mmapped and unmapped on free. Left dynamic, the
# threshold climbs after the first free and whether the heap top is trimmed depends on what else
# sits on it (measured flaky: 1 run in 3 kept everything without being asked).
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
default = returned()
kept = keep_freed_memory()
returned()
print(default, kept, returned())
"""


def test_freed_memory_stays_in_the_heap() -> None:
    """From glibc's start-up state the freed 160 MiB goes back to the kernel (to be faulted in again,
    page by page, at the next allocation); after :func:`keep_freed_memory` the heap keeps it."""
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, check=True).stdout.split()
    default, kept, after = float(out[-3]), out[-2] == "True", float(out[-1])
    assert kept and default > 100 and after < 1, (default, kept, after)


def _rank(rank: int) -> list:
    import ds_mp
    from ds_mp.engine import cpu_heap

    calls = []
    keep = cpu_heap.keep_freed_memory
    cpu_heap.keep_freed_memory = lambda: calls.append(keep()) or calls[-1]
    try:
        ds_mp.initialize(model=tiny_gpt2(), config=ds_config())
    finally:
        cpu_heap.keep_freed_memory = keep
    return calls


def test_cpu_engine_keeps_freed_memory() -> None:
    assert run_ranks(_rank, 1, timeout=120) == [[True]]


def test_user_malloc_variables_win(monkeypatch) -> None:
    from ds_mp.engine import cpu_heap

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert cpu_heap.keep_freed_memory() is False
