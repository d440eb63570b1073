"""A run once start-up is over: :class:`Run` holds its parts, :func:`build` makes them (the
engine, the data, the batch ramp and its LR scaling, the noise probe, the log) and restores a
checkpoint into them, :func:`save` writes them back — one loop over the same
:mod:`~ds_mp.training.parts`, both ways."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ds_mp.config import DsMpConfig, TrainingConfig, ramp_micro_multiple
from ds_mp.engine_view import EngineView
from ds_mp.training.csv_log import CsvLog
from ds_mp.training.parts import (DataSource, Layout, NoisePart, Progress, RampPart, RngStreams, SamplerPosition,
                                  Stateful, layout, load_states, restore_sampler, save_states)


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
    """The parts of a run the training steps use; :attr:`parts` are those a checkpoint saves
    (:mod:`ds_mp.training.parts`: one symmetric loop each way)."""

    started: Started
    engine: EngineView
    sampler: Any  # the training rows, in order, by consumed samples (its state is the data position)
    val: Any  # the held-out batches, or None
    ramp: Any  # the batch ramp (training.batch_ramp), or None: a fixed batch
    lr_scaling: Any  # the LR scaling the ramp applies inside a step, or None
    probe: Any  # the gradient-noise-scale probe, or None
    hf_config: Any  # the family's config (the FLOPs per step count its own block)
    parts: dict[str, Stateful]  # what a checkpoint carries, by its on-disk key, in restore order
    start_step: int = 0  # the step a resume continues after (0: a fresh run)
    steps: int = 0  # the last step: training.steps, or the steps training.epochs take from start_step
    log: Optional[CsvLog] = None  # rank 0's log.csv

    @property
    def cfg(self) -> DsMpConfig:
        return self.started.cfg

    @property
    def tcfg(self) -> TrainingConfig:
        return self.started.cfg.training

    @property
    def rank0(self) -> bool:
        return torch.distributed.get_rank() == 0


def run_parts(engine: EngineView, data_path: str, sampler: Any, ramp: Any, lr_scaling: Any,
              probe: Any) -> dict[str, Stateful]:
    """The run's checkpointed parts by on-disk key, in restore order (:mod:`ds_mp.training.parts`)."""
    progress, layout_part = Progress(), Layout(engine.topology)
    return {"step": progress, "data": DataSource(data_path), "layout": layout_part,
            "sampler": SamplerPosition(sampler, progress), "batch_ramp": RampPart(ramp, lr_scaling),
            "noise_scale": NoisePart(probe), "rng": RngStreams(layout_part)}


def build(started: Started) -> Run:
    """The engine and the run's parts; a resume restores each from the agreed checkpoint."""
    import ds_mp
    from ds_mp.models.family import model_config
    from ds_mp.training.batch_ramp import BatchRamp, LrScaling
    from ds_mp.training.metrics import NoiseScaleProbe

    cfg = started.cfg
    engine, _, _, _ = ds_mp.initialize(model=started.init, config=started.raw, loaded=cfg)
    probe = NoiseScaleProbe.from_config(cfg, engine.topology)  # None unless DP > 1 and on
    engine.use_noise_probe(probe)
    micro = engine.train_micro_batch_size_per_gpu()
    ramp = BatchRamp.from_config(cfg.batch_ramp, micro, engine.topology.dp, ramp_micro_multiple(cfg))  # None: fixed
    lr_scaling = LrScaling(engine.optimizer) if ramp is not None else None  # scales inside the step only
    sampler, val = _data(started, engine)
    run = Run(started, engine, sampler, val, ramp, lr_scaling, probe, model_config(cfg),  # FLOPs: its own block
              run_parts(engine, started.data_path, sampler, ramp, lr_scaling, probe))
    if started.resume_tag is not None:
        restore(run)
    run.steps = _last_step(run)
    _open_log(run)
    return run


def _data(started: Started, engine: EngineView) -> tuple[Any, Any]:
    """This DP rank's training sampler and the held-out batches (None: no validation), said on rank 0."""
    from ds_mp.data import training_batches

    cfg, topo, rank0 = started.cfg, engine.topology, torch.distributed.get_rank() == 0
    sampler, val, report = training_batches(cfg, started.train_ds, started.val_ds, engine.train_micro_batch_size_per_gpu(),
                                            engine.gradient_accumulation_steps(), topo.dp_rank, topo.dp)
    if rank0 and report is not None:
        print(f"ds_mp: SFT data: {report}", flush=True)
    if rank0 and val is None and cfg.training.eval_interval:
        print("ds_mp: no validation: the dataset has no held-out split (--val-fraction 0); name a held-out file "
              "with data.val_path to validate", flush=True)
    return sampler, val


def _last_step(run: Run) -> int:
    """``training.steps``, or with ``training.epochs`` the steps those epochs take from here
    (:mod:`ds_mp.training.epochs`); said on rank 0."""
    from ds_mp.training.epochs import epoch_note, epoch_steps

    tcfg, sampler, batch = run.tcfg, run.sampler, run.engine.train_batch_size()
    steps = tcfg.steps
    if tcfg.epochs:
        steps = epoch_steps(tcfg.epochs, sampler.num_chunks, sampler.consumed_samples, run.start_step, batch, run.ramp)
    if run.rank0:
        print(epoch_note(sampler.num_chunks, batch, steps, tcfg.epochs, run.ramp), flush=True)
    return steps


def _open_log(run: Run) -> None:
    """Rank 0: start-up's notes, ``log.csv`` (cut back to a resumed step) and the noise-scale
    policy's wait for its EMA, said up front."""
    started, tcfg, ramp, probe = run.started, run.tcfg, run.ramp, run.probe
    if not run.rank0:
        return
    for note in started.notes:
        print(note, file=sys.stderr)
    run.log = CsvLog(os.path.join(tcfg.output_dir, "log.csv"),
                     resume_step=run.start_step if started.resume_tag else None)
    if ramp is not None and probe is not None:
        note = ramp.warm_up_note(probe.interval, probe.estimator.beta, run.start_step, run.steps)
        if note:
            print(note)


def restore(run: Run) -> None:
    """The agreed checkpoint into the engine (weights, optimizer, counters) and into every part:
    step, data position, ramp and LR scaling, the noise estimator, and (at the same layout) every
    rank's RNG streams."""
    from ds_mp.checkpoint import load_checkpoint

    load_states(run.parts, load_checkpoint(run.engine, run.started.ckpt_root, run.started.resume_tag))
    run.start_step = run.parts["step"].state_dict()


def save(run: Run, step: int, tag: str | None = None) -> None:
    """A regular ``stepN`` checkpoint (moves ``latest``), or a named diagnostic one (does not):
    the weights and optimizer, and every part's state (what :func:`restore` loads back)."""
    from ds_mp.checkpoint import save_checkpoint
    from ds_mp.training.run_dir import rotate

    run.parts["step"].load_state_dict(step)
    save_checkpoint(run.engine, run.started.ckpt_root, tag or f"step{step}", save_states(run.parts),
                    update_latest=tag is None)
    if run.rank0 and tag is None:  # training.keep_last; a tagged (diagnostic) save deletes nothing
        rotate(run.started.ckpt_root, run.tcfg.keep_last)


__all__ = ["Started", "Run", "run_parts", "build", "restore", "save", "restore_sampler", "layout"]
