"""Model-parallel RNG, on DeepSpeed's RNG-states tracker.

Two streams (Megatron-LM §3): the *default* stream, seeded identically on all TP ranks
of a replica, drives dropout outside parallel regions (embedding, residual), so every TP
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


def seed_everything(seed: int, tp_rank: int) -> dict:
    """Seed the default stream with ``seed`` and the TP stream with ``seed+2718+tp_rank``.

    Returns the seeds used (recorded in logs/checkpoints so runs reproduce).
    """
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tracker = ds_ckpt.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(TP_STREAM, seed + 2718 + tp_rank)
    return {"default": seed, "tensor_parallel": seed + 2718 + tp_rank}


@contextlib.contextmanager
def parallel_region_rng() -> Iterator[None]:
    """Draw random numbers from this TP rank's own stream inside the block."""
    tracker = ds_ckpt.get_cuda_rng_tracker()
    if TP_STREAM not in tracker.get_states():
        yield  # not seeded for TP (e.g. plain single-process use): default stream
        return
    with tracker.fork(TP_STREAM):
        yield


def rng_state() -> dict:
    """Both streams' states, for checkpoints."""
    return {"torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in ds_ckpt.get_cuda_rng_tracker().get_states().items()}}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    ds_ckpt.get_cuda_rng_tracker().set_states(state["tracker"])
