"""Rendezvous ports for the tests' jobs, safe when two pytest-xdist workers start jobs at once.

A port found free by binding to port 0 is an *ephemeral* port: between the check and the job
binding it (seconds, while the ``deepspeed`` runner starts), any outgoing connection on the machine
— another worker's gloo pairs, its own probe — may be given the same number, and the job dies
with "the rendezvous port … is in use".  :func:`free_port` hands out ports below the OS's
ephemeral range (32768–60999 on Linux), from one disjoint block per xdist worker, and checks
that nothing is bound there now.  Standard library only: docs examples call it from bash.
"""
from __future__ import annotations

import os
import random
import socket

PORT_BASE, PORT_BLOCK, BLOCKS = 10000, 5000, 4  # ports 10000-29999: four workers' blocks


def worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` -> 3), 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def free_port() -> int:
    """A port in this worker's block that nothing is bound to now."""
    lo = PORT_BASE + PORT_BLOCK * (worker_index() % BLOCKS)
    for _ in range(200):
        port = random.randrange(lo, lo + PORT_BLOCK)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {lo}-{lo + PORT_BLOCK - 1} after 200 tries")


if __name__ == "__main__":
    print(free_port())
