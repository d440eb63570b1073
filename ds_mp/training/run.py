"""A run's parts once start-up is over: :class:`Run` holds them, :func:`build` makes them (the
engine, the data, the batch ramp and its LR scaling, the noise probe, the log) and restores a
checkpoint into them, :func:`save` writes them back — the same fields, both ways."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ds_mp.config import DsMpConfig, TrainingConfig, ramp_micro_multiple
from ds_mp.engine_view import EngineView
from ds_mp.training.csv_log import CsvLog


@dataclass
class Started:
    """What start-up decided (every rank agreed): the config, the data, the weights to start from,
    the checkpoint root and the one resume point (None: a fresh run)."""

    raw: dict
    cfg: DsMpConfig
    data_path: str
    train_ds: Any
    val_ds: Any
    init: Optional[str]
    ckpt_root: str
    resume_tag: Optional[str]
    notes: list[str]


@dataclass
class Run:
    """The parts of a run the training steps use and a checkpoint saves."""

    started: Started
    engine: EngineView
    sampler: Any  # the training rows, in order, by consumed samples (its state is the data position)
    val: Any  # the held-out batches, or None
    ramp: Any  # the batch ramp (training.batch_ramp), or None: a fixed batch
    lr_scaling: Any  # the LR scaling the ramp applies inside a step, or None
    probe: Any  # the gradient-noise-scale probe, or None
    hf_config: Any  # the family's config (the FLOPs per step count its own block)
    start_step: int
    log: Optional[CsvLog]  # rank 0's log.csv

    @property
    def cfg(self) -> DsMpConfig:
        return self.started.cfg

    @property
    def tcfg(self) -> TrainingConfig:
        return self.started.cfg.training

    @property
    def rank0(self) -> bool:
        return torch.distributed.get_rank() == 0


def build(started: Started) -> Run:
    """The engine and the run's parts; a resume restores each from the agreed checkpoint."""
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint
    from ds_mp.data import training_batches
    from ds_mp.models.family import model_config
    from ds_mp.training.batch_ramp import BatchRamp, LrScaling
    from ds_mp.training.epochs import epoch_note, epoch_steps
    from ds_mp.training.metrics import NoiseScaleProbe

    cfg, tcfg = started.cfg, started.cfg.training
    engine, _, _, _ = ds_mp.initialize(model=started.init, config=started.raw)
    topo, rank0 = engine.topology, torch.distributed.get_rank() == 0
    probe = NoiseScaleProbe.from_config(cfg, topo)  # None unless DP > 1 and on
    engine.use_noise_probe(probe)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    ramp = BatchRamp.from_config(cfg.batch_ramp, micro, topo.dp, ramp_micro_multiple(cfg))  # None: fixed batch
    lr_scaling = LrScaling(engine.optimizer) if ramp is not None else None  # scales inside the step only
    hf_config = model_config(cfg)  # the FLOPs per step count the family's own block
    sampler, val, report = training_batches(cfg, started.train_ds, started.val_ds, micro, gas, topo.dp_rank, topo.dp)
    if rank0 and report is not None:
        print(f"ds_mp: SFT data: {report}", flush=True)
    if rank0 and val is None and tcfg.eval_interval:
        print("ds_mp: no validation: the dataset has no held-out split (--val-fraction 0); name a held-out file "
              "with data.val_path to validate", flush=True)
    run = Run(started, engine, sampler, val, ramp, lr_scaling, probe, hf_config, 0, None)
    if started.resume_tag is not None:
        restore(run, load_checkpoint(engine, started.ckpt_root, started.resume_tag))
    if tcfg.epochs:  # the steps those epochs take from here (ds_mp.training.epochs)
        tcfg.steps = epoch_steps(tcfg.epochs, sampler.num_chunks, sampler.consumed_samples, run.start_step,
                                 engine.train_batch_size(), ramp)
    if rank0:
        print(epoch_note(sampler.num_chunks, engine.train_batch_size(), tcfg.steps, tcfg.epochs, ramp), flush=True)
    for note in started.notes if rank0 else []:
        print(note, file=sys.stderr)
    run.log = CsvLog(os.path.join(tcfg.output_dir, "log.csv"),
                     resume_step=run.start_step if started.resume_tag else None) if rank0 else None
    ramp_note = None if ramp is None or probe is None else ramp.warm_up_note(probe.interval, probe.estimator.beta,
                                                                             run.start_step, tcfg.steps)
    if rank0 and ramp_note:  # the noise-scale policy's wait for its EMA, said up front
        print(ramp_note)
    return run


def restore(run: Run, state: dict) -> None:
    """A checkpoint's client state into the run's parts: step, data position, ramp and LR scaling,
    the noise estimator, and (at the same layout) every rank's RNG streams."""
    from ds_mp.tensor_parallel.random import set_rng_state

    run.start_step = int(state["step"])
    restore_sampler(run.sampler, state, run.start_step)
    if run.ramp is not None and state.get("batch_ramp") is not None:  # current batch, samples, LR kept apart
        run.ramp.load_state_dict(state["batch_ramp"]["ramp"])
        run.lr_scaling.load_state_dict(state["batch_ramp"]["lr"])
    if run.probe is not None and state.get("noise_scale") is not None:  # the estimator's EMAs
        run.probe.estimator.load_state_dict(state["noise_scale"])
    rng = state.get("rng")
    if rng is not None and state.get("layout") == layout(run.engine.topology):  # the same ranks: their own streams
        set_rng_state(rng[torch.distributed.get_rank()] if isinstance(rng, list) else rng)


def save(run: Run, step: int, tag: str | None = None) -> None:
    """A regular ``stepN`` checkpoint (moves ``latest``), or a named diagnostic one (does not):
    the weights and optimizer, and the client state :func:`restore` reads back."""
    from ds_mp.checkpoint import save_checkpoint
    from ds_mp.tensor_parallel.random import rng_state
    from ds_mp.training.run_dir import rotate

    rngs: list = [None] * torch.distributed.get_world_size()  # every rank's streams (they differ over
    torch.distributed.all_gather_object(rngs, rng_state())  # TP and PP), by global rank: exact dropout
    ramp, lr_scaling, probe = run.ramp, run.lr_scaling, run.probe
    save_checkpoint(run.engine, run.started.ckpt_root, tag or f"step{step}",
                    {"step": step, "data": run.started.data_path, "rng": rngs, "layout": layout(run.engine.topology),
                     "sampler": run.sampler.state_dict(),
                     "batch_ramp": None if ramp is None else {"ramp": ramp.state_dict(), "lr": lr_scaling.state_dict()},
                     "noise_scale": None if probe is None else probe.estimator.state_dict()},
                    update_latest=tag is None)
    if run.rank0 and tag is None:  # training.keep_last; a tagged (diagnostic) save deletes nothing
        rotate(run.started.ckpt_root, run.tcfg.keep_last)


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


__all__ = ["Started", "Run", "build", "restore", "save", "restore_sampler", "layout"]
