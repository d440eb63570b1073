"""The in-process rank runner: ranks forked from the preloaded forkserver see the caller's
*current* environment (not the one the forkserver started with), start without a process group,
and a rank that raises fails the call with its traceback."""
from __future__ import annotations

import os
import sys

import pytest

from dist_utils import run_ranks


def _report(rank: int) -> tuple:
    import torch.distributed as dist

    return (os.environ.get("DS_MP_TEST_MARK"), os.environ["RANK"], "deepspeed" in sys.modules,
            dist.is_initialized())


def _raise(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one says no")


def test_ranks_see_the_callers_current_environment(monkeypatch) -> None:
    run_ranks(_report, 1)  # the forkserver is running before the variable is set
    monkeypatch.setenv("DS_MP_TEST_MARK", "set-after-start")
    assert run_ranks(_report, 2) == [("set-after-start", "0", True, False), ("set-after-start", "1", True, False)]
    monkeypatch.delenv("DS_MP_TEST_MARK")
    assert run_ranks(_report, 1)[0][0] is None


def test_a_failing_rank_fails_the_call_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*rank one says no"):
        run_ranks(_raise, 2)
