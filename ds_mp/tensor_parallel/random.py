"""Model-parallel RNG, on DeepSpeed's RNG-states tracker.

Two streams (Megatron-LM §3): the *default* stream, seeded identically on all TP ranks
of a pipeline stage (and offset by 100 per stage), drives dropout outside parallel regions (embedding, residual), so every TP
rank drops the same activations; the *model-parallel* stream, seeded ``seed + 2718 +
tp_rank``, drives dropout inside parallel regions (attention probabilities of the rank's
own heads), so each rank draws its own mask.  DeepSpeed's activation checkpointing saves
and restores the tracker, so recomputation reproduces both masks.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

TP_STREAM = "model-parallel-rng"  # DeepSpeed's name for the model-parallel stream


def seed_everything(seed: int, tp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> dict:
    """Seed this rank's two streams, Megatron-LM style.

    Default stream: ``seed + 100·pp_rank`` — equal on the TP ranks of a stage (dropout
    outside parallel regions must agree over TP), different per pipeline stage (otherwise
    stage s would draw the same masks as stage 0 for its own layers).  TP stream:
    ``seed + 100·pp_rank + 2718 + tp_rank`` (differs over TP and over stages).  DP
    replicas share the seeds (as in Megatron-LM; they see different data).  Context-parallel
    ranks hold different tokens of the same rows: ``+ 1_000_003·cp_rank`` on both streams, so
    their dropout masks are independent (cp_rank 0: the seeds above, unchanged).

    Returns the seeds used (recorded in logs/checkpoints so runs reproduce).
    """
    import random

    import numpy as np

    base = seed + 100 * pp_rank + 1_000_003 * cp_rank
    random.seed(base)
    np.random.seed(base % 2**32)
    torch.manual_seed(base)
    tracker = ds_ckpt.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(TP_STREAM, base + 2718 + tp_rank)
    return {"default": base, "tensor_parallel": base + 2718 + tp_rank}


@contextlib.contextmanager
def parallel_region_rng() -> Iterator[None]:
    """Draw random numbers from this TP rank's own stream inside the block."""
    tracker = ds_ckpt.get_cuda_rng_tracker()
    if TP_STREAM not in tracker.get_states():
        yield  # not seeded for TP (e.g. plain single-process use): default stream
        return
    with tracker.fork(TP_STREAM):
        yield


def _accelerator() -> object | None:
    """DeepSpeed's accelerator when it has its own generator (not the CPU), else None."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else acc


def rng_state() -> dict:
    """Every stream's state, for checkpoints: the CPU generator, the accelerator's generator
    (``"accelerator"``, None on a CPU accelerator) and the model-parallel tracker."""
    acc = _accelerator()
    return {"torch": torch.get_rng_state(),
            "accelerator": acc.get_rng_state() if acc is not None else None,
            "tracker": {k: v.clone() for k, v in ds_ckpt.get_cuda_rng_tracker().get_states().items()}}


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s streams (an accelerator state saved on another kind of
    device, or missing in an older checkpoint, is skipped)."""
    torch.set_rng_state(state["torch"])
    acc = _accelerator()
    if acc is not None and state.get("accelerator") is not None:
        acc.set_rng_state(state["accelerator"])
    ds_ckpt.get_cuda_rng_tracker().set_states(state["tracker"])
