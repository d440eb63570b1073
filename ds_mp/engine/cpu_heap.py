"""CPU training keeps the memory it frees for the next micro-batch (glibc's malloc).

PyTorch's CPU allocator is plain ``malloc``/``free``.  glibc returns the top of its heap to the
kernel once more than ``M_TRIM_THRESHOLD`` bytes are free there (and maps large blocks with
``mmap`` below a threshold it adjusts as it goes), so a training step whose live memory swings by
tens of MiB per micro-batch (activations, gradients, the logits) gives memory back after every
backward and takes it again, page by page, in the next forward: each fresh 4 KiB page is a minor
fault the kernel zeroes.  Measured on the PP=2 benchmark shape (``benchmarks/schedules.py``):
5 000–14 000 faults per step on a ds_mp 1F1B rank and up to 26 000 under ZB-H1 (which holds B's
output gradients until W), against 1 500–3 500 for DeepSpeed's plain PipelineModule;
with the heap kept, under 1 000 for all.

:func:`keep_freed_memory` sets the mmap threshold to glibc's maximum dynamic value (32 MiB: what
it climbs to anyway once such blocks are freed) and the trim threshold out of reach, so the heap
stays at the step's peak — the memory the step needs at its peak anyway.  Process-wide; a
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` (or ``_TOP_PAD_``) variable set by the
user wins (nothing is changed).  A no-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
TRIM_THRESHOLD = 2**31 - 1  # never trim (mallopt takes an int)
USER_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory in the heap; True if it did (False: not glibc, or the user
    tuned malloc through its environment variables)."""
    if any(k in os.environ for k in USER_KNOBS):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


__all__ = ["keep_freed_memory"]
