"""Test-wide settings: helpers importable, bounded collective timeouts, one thread per rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_MP_TIMEOUT", "60")  # a hung rendezvous/collective fails instead of blocking CI
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cpu_fp16 import allow_cpu_fp16  # noqa: E402 - needs the path above

allow_cpu_fp16()  # fp16 tests run on every CPU (see cpu_fp16.py)
