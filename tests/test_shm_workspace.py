"""DeepSpeed's CPU shm all-reduce workspaces leave nothing in /dev/shm (ds_mp/deepspeed_compat/shm.py).

DeepSpeed 0.19 never unlinks the 69 MB per-rank workspace its ``deepspeed_shm_comm`` op creates when
every rank is local: each CPU job left ranks × 69 MB of RAM in /dev/shm (17 GiB after a day of test
runs here, then the OOM killer).  Both ways into DeepSpeed's comm are checked on two real ranks:
the HF Trainer's (Accelerate starts the comm while the user's TrainingArguments are built) and a
comm started with the op (``DS_MP_SHM_COMM=1``), whose all-reduce must still work after the release.
"""
from __future__ import annotations

import glob
import os

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.timeout(600)


def leftovers() -> list[str]:
    """This job's workspaces still named in /dev/shm (the job's MASTER_PORT is unique)."""
    return sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{os.environ['MASTER_PORT']}_*"))


def _trainer_arguments(rank: int, out: str) -> tuple[int, list[str]]:
    import importlib

    import torch
    from transformers import TrainingArguments

    importlib.import_module("ds_mp.hf")  # what a Trainer script imports first
    args = TrainingArguments(output_dir=out, report_to="none", per_device_train_batch_size=1,
                             deepspeed={"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}})
    assert args.distributed_state is not None  # the comm is up (DeepSpeed's, as in a launched script)
    torch.distributed.barrier()  # both ranks' comms started before either looks
    return torch.distributed.get_world_size(), leftovers()


def _opted_in(rank: int) -> tuple[list[str], float]:
    import deepspeed.comm as dist
    import torch

    from ds_mp.engine.initialize import init_distributed

    init_distributed()
    torch.distributed.barrier()
    left = leftovers()
    t = torch.full((8,), float(rank + 1))
    dist.inference_all_reduce(t)  # the op reads its peers' mappings, still valid after the unlink
    return left, float(t[0])


def test_trainer_arguments_leave_no_workspace(tmp_path) -> None:
    got = run_ranks(_trainer_arguments, 2, str(tmp_path))
    assert got == [(2, []), (2, [])]


@pytest.mark.slow
def test_a_comm_started_with_the_op_is_released_and_still_reduces(monkeypatch) -> None:
    monkeypatch.setenv("DS_MP_SHM_COMM", "1")
    got = run_ranks(_opted_in, 2, timeout=540)
    assert got == [([], 3.0), ([], 3.0)]
