"""DeepSpeed's CPU shared-memory all-reduce workspace: never built unless asked, released once mapped.

DeepSpeed 0.19's ``TorchBackend`` (``deepspeed.comm.torch``) JIT-builds the ``deepspeed_shm_comm``
op whenever DeepSpeed's op table calls it compatible, and when every rank is local
(``LOCAL_SIZE == WORLD_SIZE``, which the ``deepspeed`` launcher sets) each rank ``shm_open``s a
69 MB workspace ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
and maps every peer's.  Nothing ever ``shm_unlink``s them (the op's ``shared_close`` is never
called), so each CPU job left ranks × 69 MB in ``/dev/shm`` — RAM — until reboot.  Measured
here: 348 such files, 17 GiB, after a day of test runs; the OOM killer then ended a benchmark.

Two remedies, both here because both name DeepSpeed internals:

* :func:`skip_shm_comm_unless_asked` marks the op incompatible before DeepSpeed's comm starts
  (ds_mp's ``init_distributed``, and ``import ds_mp.hf``: Accelerate starts it when the user's
  ``TrainingArguments`` are built, before any Trainer exists).  ``DS_MP_SHM_COMM=1`` opts in.
* :func:`release_shm_workspace` — for a comm that someone else started with the op (a user's own
  ``deepspeed.init_distributed``, ``DS_MP_SHM_COMM=1``): after a barrier every rank has mapped
  every workspace, so each rank unlinks its own name.  The mappings stay valid (POSIX frees the
  memory at the last ``munmap``, when the processes end, killed or not) and nothing is left.
"""
from __future__ import annotations

import os

import torch

from ds_mp.deepspeed_compat.pipeline import DeepSpeedIncompatible

SHM_OP = "deepspeed_shm_comm"
#: ``SHM_BUFFER_NAME`` in DeepSpeed's ``ops/csrc/cpu/comm/shm.cpp``.
SHM_PREFIX = "deepspeed_allreduce_buffer"
_released: set[str] = set()  # names this process has unlinked (a second call is a no-op)


def skip_shm_comm_unless_asked() -> None:
    """Mark DeepSpeed's shm all-reduce op incompatible (never JIT-built, no workspace) unless
    ``DS_MP_SHM_COMM=1``.  Only DeepSpeed's inference all-reduce uses it; ds_mp never does."""
    if os.environ.get("DS_MP_SHM_COMM", "0") != "1":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_OP] = False


def shm_workspace_path(rank: int) -> str:
    """Where DeepSpeed's op put ``rank``'s workspace (its ``shm_initialize`` naming)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"/dev/shm/{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def _shm_op_active() -> bool:
    """Whether DeepSpeed's comm backend built the op and (all ranks local) created workspaces."""
    import deepspeed.comm.comm as dscomm

    if not hasattr(dscomm, "cdb"):
        raise DeepSpeedIncompatible("deepspeed.comm.comm.cdb is gone: ds_mp cannot find DeepSpeed's comm backend "
                                    "to release its /dev/shm all-reduce workspace (deepspeed_compat/shm.py)")
    cdb = dscomm.cdb
    if cdb is None or getattr(cdb, "shm_comm_op", None) is None:
        return False
    world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_SIZE", "0")
    return world == local


def release_shm_workspace() -> bool:
    """Unlink this rank's DeepSpeed shm workspace once every rank has mapped it; True if unlinked.

    Call after ``deepspeed.init_distributed`` on every rank (it is a collective when the op is
    active: a barrier on the world group).  Raises :class:`DeepSpeedIncompatible` when the op is
    active and its workspace is not where DeepSpeed 0.19 names it (the leak would come back silently)."""
    if not torch.distributed.is_initialized() or not _shm_op_active():
        return False
    path = shm_workspace_path(torch.distributed.get_rank())
    if path in _released:
        return False
    torch.distributed.barrier()  # every rank is past the op's initialize: each has mapped every workspace
    if not os.path.exists(path):
        raise DeepSpeedIncompatible(f"DeepSpeed's shm all-reduce op is active but {path} does not exist: its "
                                    "workspace naming moved (deepspeed_compat/shm.py); it would be left in /dev/shm")
    os.unlink(path)
    _released.add(path)
    return True
