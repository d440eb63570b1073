"""Test-wide settings: helpers importable, bounded collective timeouts, one thread per rank."""
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_MP_TIMEOUT", "60")  # a hung rendezvous/collective fails instead of blocking CI
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cpu_fp16 import allow_cpu_fp16  # noqa: E402 - needs the path above
from ports import free_port  # noqa: E402

allow_cpu_fp16()  # fp16 tests run on every CPU (see cpu_fp16.py)
# A one-process group started in this pytest process (ds_mp.initialize without a launcher, or Accelerate
# when TrainingArguments are built after it) rendezvouses on MASTER_PORT, 29511 by default: two xdist
# workers holding theirs at once collided (EADDRINUSE).  Each worker's own port, from its block:
os.environ.setdefault("MASTER_PORT", str(free_port()))


@pytest.fixture(autouse=True)
def _free_master_port() -> None:
    """Before each test, unless this process holds a group already: a MASTER_PORT free now.  A port
    chosen once per worker (above) can be taken by the time a later test starts its group (a fresh-clone
    run failed 8 in-process tests of one worker with EADDRINUSE on it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        os.environ["MASTER_PORT"] = str(free_port())


#: Rough seconds per test by marker, to hand the heaviest files out first (below).
_WEIGHTS = {"launcher": 60, "slow": 20}


def pytest_collection_modifyitems(config, items) -> None:
    """Order the test files heaviest first (a file's weight: its tests' :data:`_WEIGHTS`, 1 for an
    unmarked test), keeping the order inside a file.  ``scripts/test.sh`` gives whole files to two
    xdist workers in this order (``--dist loadfile --no-loadscope-reorder``): a long file handed
    out last would leave one worker running it alone while the other idles."""
    weight: dict[str, int] = {}
    for item in items:
        cost = max([_WEIGHTS[m.name] for m in item.iter_markers() if m.name in _WEIGHTS], default=1)
        weight[item.nodeid.split("::")[0]] = weight.get(item.nodeid.split("::")[0], 0) + cost
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: a file's order stays


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: Any) -> str:
    """A tiny GPT-2 checkpoint directory (``helpers.tiny_gpt2``), one per test module."""
    from helpers import tiny_gpt2

    path = str(tmp_path_factory.mktemp("gpt2"))
    tiny_gpt2().save_pretrained(path)
    return path
