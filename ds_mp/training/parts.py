"""A run's stateful parts and the one loop that saves and restores them.

A checkpoint's client state (what :func:`ds_mp.checkpoint.save_checkpoint` keeps beside the
weights and optimizer) is ``{key: part.state_dict() for key, part in parts}``, and a resume is
``part.load_state_dict(state.get(key))`` for the same parts in the same order: what is saved is
exactly what is loaded (torch.distributed.checkpoint's ``Stateful``, torchtitan's
``CheckpointManager`` over its ``states``).  The keys are the on-disk names every ds_mp checkpoint
has used, so older checkpoints read unchanged; a key an older checkpoint lacks reaches its part as
``None``, and each part says what that means.

The parts, in restore order (a later one may read an earlier one's restored value; the RNG last,
after everything that could draw from it):

=============== ===========================================================================
``step``        :class:`Progress`: the optimizer step the checkpoint was taken after
``data``        :class:`DataSource`: the dataset path the run trained on (kept for the reader)
``layout``      :class:`Layout`: the [TP, PP, DP] degrees (RNG streams are per rank of one layout)
``sampler``     :class:`SamplerPosition`: the data position (consumed samples, data order)
``batch_ramp``  :class:`RampPart`: the batch ramp and its LR scaling (None: a fixed batch)
``noise_scale`` :class:`NoisePart`: the noise-scale estimator's EMAs (None: no probe)
``rng``         :class:`RngStreams`: every rank's RNG streams, restored at the same layout only
=============== ===========================================================================

The monitors (``log.csv``, DeepSpeed's monitors, the NaN guard) keep nothing across a resume:
``log.csv`` drops the rows after the resumed step, the guard's count of consecutive skips starts
at 0.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """A part of a run a checkpoint carries.  ``load_state_dict(part.state_dict())`` puts an equal
    part back; ``load_state_dict(None)`` is a checkpoint without the part (an older one, or a run
    that did not have it)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Progress:
    """The last optimizer step done (``step``)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> int:
        return self.step

    def load_state_dict(self, state: Optional[int]) -> None:
        self.step = int(state or 0)


class DataSource:
    """The dataset path the checkpoint's run trained on, written for a reader of the checkpoint; a
    resume reads its data from the config, so restoring it changes nothing."""

    def __init__(self, path: str) -> None:
        self.path = path

    def state_dict(self) -> str:
        return self.path

    def load_state_dict(self, state: Optional[str]) -> None:
        """Nothing to restore: the run's data is the config's (the saved path is informational)."""


class Layout:
    """This run's [TP, PP, DP]; :attr:`saved` is the checkpoint's (None before a restore)."""

    def __init__(self, topo: Any) -> None:
        self.degrees, self.saved = layout(topo), None

    def state_dict(self) -> list[int]:
        return self.degrees

    def load_state_dict(self, state: Optional[list[int]]) -> None:
        self.saved = state

    @property
    def same(self) -> bool:
        """The checkpoint was saved at this layout (each rank's own RNG streams apply)."""
        return self.saved == self.degrees


class RngStreams:
    """Every rank's RNG streams by global rank (they differ over TP and PP: exact dropout on resume).

    :meth:`state_dict` is a collective (an all-gather over the world).  A restore applies this
    rank's streams only when the checkpoint's layout is this run's (``layout``, restored first);
    checkpoints that saved one rank's streams as a dict apply that dict."""

    def __init__(self, layout_part: Layout) -> None:
        self.layout = layout_part

    def state_dict(self) -> list:
        from ds_mp.tensor_parallel.random import rng_state

        rngs: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rngs, rng_state())
        return rngs

    def load_state_dict(self, state: Any) -> None:
        from ds_mp.tensor_parallel.random import set_rng_state

        if state is not None and self.layout.same:
            set_rng_state(state[torch.distributed.get_rank()] if isinstance(state, list) else state)


class SamplerPosition:
    """The training sampler's position (:func:`restore_sampler`); a checkpoint without it puts the
    sampler at ``progress.step`` × the global batch (restored first)."""

    def __init__(self, sampler: Any, progress: Progress) -> None:
        self.sampler, self.progress = sampler, progress

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        restore_sampler(self.sampler, {"sampler": state}, self.progress.step)


class RampPart:
    """The batch ramp with its LR scaling (``{"ramp", "lr"}``), or None for a fixed batch; a
    checkpoint without a ramp leaves the ramp at its start."""

    def __init__(self, ramp: Any, lr_scaling: Any) -> None:
        self.ramp, self.lr_scaling = ramp, lr_scaling

    def state_dict(self) -> Optional[dict]:
        if self.ramp is None:
            return None
        return {"ramp": self.ramp.state_dict(), "lr": self.lr_scaling.state_dict()}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.ramp is not None and state is not None:  # current batch, samples, LR kept apart
            self.ramp.load_state_dict(state["ramp"])
            self.lr_scaling.load_state_dict(state["lr"])


class NoisePart:
    """The gradient-noise-scale estimator's EMAs, or None without a probe."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe

    def state_dict(self) -> Optional[dict]:
        return None if self.probe is None else self.probe.estimator.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.probe is not None and state is not None:
            self.probe.estimator.load_state_dict(state)


def rng_parts(topo: Any) -> dict[str, Stateful]:
    """``layout`` then ``rng``: the parts a checkpoint needs for exact dropout on resume, for a run
    whose other state is kept elsewhere (``ds_mp.hf``: the Trainer's ``trainer_state.json``)."""
    layout_part = Layout(topo)
    return {"layout": layout_part, "rng": RngStreams(layout_part)}


def save_states(parts: dict[str, Stateful]) -> dict:
    """Every part's state under its key (collective where a part's ``state_dict`` is: the RNG)."""
    return {key: part.state_dict() for key, part in parts.items()}


def load_states(parts: dict[str, Stateful], state: dict) -> None:
    """The inverse of :func:`save_states`: every part, in order, from its key (None when absent)."""
    for key, part in parts.items():
        part.load_state_dict(state.get(key))


def restore_sampler(sampler: Any, client_state: dict, step: int) -> None:
    """Put ``sampler`` where the checkpointed run stopped: at its consumed-sample count and
    data order (``client_state["sampler"]``, saved by global rank 0, a consuming rank), so a
    resume at another DP size (another global batch) repeats and skips nothing.  Checkpoints
    from before that field fall back to ``step × global batch`` (right only at the same DP)."""
    saved = client_state.get("sampler")
    have = getattr(sampler, "seq_len", None)
    if saved is not None and have is not None and saved.get("seq_len", have) != have:
        from ds_mp.data import DataError  # said as the key, not as the sampler's chunk counts

        raise DataError(f"ds_mp.data.seq_len: the checkpoint was trained with seq_len {saved['seq_len']}, this run has "
                        f"{have}; resume with seq_len {saved['seq_len']}, or start a new output_dir (init_from the "
                        "checkpoint's exported HF weights) to change it")
    if saved is not None:
        sampler.load_state_dict(saved)
    else:
        sampler.set_step(step)


def layout(topo: Any) -> list[int]:
    """The [TP, PP, DP] degrees a checkpoint was saved at (RNG streams are per rank of one layout)."""
    return [topo.tp, topo.pp, topo.dp]


__all__ = ["Stateful", "Progress", "DataSource", "Layout", "RngStreams", "SamplerPosition", "RampPart", "NoisePart",
           "rng_parts", "save_states", "load_states", "restore_sampler", "layout"]
