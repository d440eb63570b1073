"""The training / fine-tuning loop behind ``launch/train.py`` and ``launch/finetune.py``.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/quickstart.json

Reads everything from the ``"ds_mp"`` block; rank 0 shows a progress bar (loss,
tokens/s) and writes ``<output_dir>/log.csv``; validation every ``eval_interval``
steps; layout-free checkpoints every ``checkpoint_interval`` steps and at the end
(``--resume`` continues from the latest, ``--resume TAG`` from that one, at any TP × PP × DP);
an HF directory is exported to ``<output_dir>/hf`` at the end.  One run owns ``output_dir`` at a
time and every rank resumes from the tag global rank 0 chose (:mod:`ds_mp.training.run_dir`);
SIGTERM/SIGINT to any process of the job ends every rank after the step and a save
(:mod:`ds_mp.training.signals`).

Every metric row also goes to DeepSpeed's monitors (the JSON's ``"tensorboard"``, ``"wandb"``,
``"csv_monitor"``, ``"comet"`` blocks) as ``ds_mp/<column>`` events (:func:`monitor_metrics`).

Metrics (per log interval):
  tokens/s   = global batch × seq_len / mean step time; on SFT datasets target tokens / step time
  target_tokens, padding_tokens = the step's tokens with a label (shifted labels != -100) and pad tokens,
               all DP ranks (ds_mp.data.step_tokens)
  TFLOP/s    = F / step time, with Megatron-LM's count for a GPT of l layers, hidden h,
               vocab V, batch B, sequence s (forward + backward, no recomputation):
               F = 72 B s l h² (1 + s/(6h) + V/(12 l h))
  bubble     = 1 − (forward + backward time) / step time on this rank (pipeline idle share)
  peak_mem   = peak resident memory of this rank (CPU) or peak allocated (GPU), MiB
  val_loss   = loss per target token over the whole held-out split (or its first training.eval_batches
               passes; data.val_path names a held-out records file), plus a MoE's aux term per micro-batch
               as HF's model adds it: ds_mp.data.validation
  val_ppl    = exp(val_loss)
  epoch      = samples consumed / rows per epoch after the step (ds_mp.training.epochs)
  noise_scale = EMA-smoothed gradient noise scale B_simple in samples (ds_mp.training.metrics),
               when training.noise_scale_interval > 0 (or the noise_scale batch ramp) and DP > 1
  batch_size = global samples of that optimizer step (changes under ds_mp.batch_ramp; with a ramp,
               ``lr`` is the LR that step used, scaled per batch_ramp.lr_scaling)
  skipped    = optimizer steps skipped so far: non-finite gradients (fp32/bf16, ds_mp) plus
               DeepSpeed's fp16 loss-scale overflows (engine.skipped_steps)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import torch

from ds_mp.checkpoint.training import LATEST
from ds_mp.config import ConfigError, load_config, read_json, resolve_model_source, validate_model
from ds_mp.training.run import Started, build, restore_sampler
from ds_mp.training.preference import run_dpo, wants_dpo
from ds_mp.training.run_dir import RunDir, RunDirError
from ds_mp.training.signals import StopFlag, StopRequested, stop_grace_s
from ds_mp.training.steps import NonFiniteLoss, evaluate, finish, monitor_metrics, peak_memory_mib, train


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train or fine-tune GPT-2 with ds_mp (run under `deepspeed`).")
    p.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", required=True,
                   help="DeepSpeed JSON with a \"ds_mp\" block")
    p.add_argument("--resume", nargs="?", const=LATEST, default=None, metavar="TAG",
                   help="continue from <output_dir>/checkpoints/latest, or from the checkpoint TAG (e.g. step200)")
    p.add_argument("--model", default=None, help="HF directory or Hub id (gpt2, Qwen/Qwen2.5-0.5B, org/name@rev) of a "
                   "GPT-2, Llama, Qwen2 or Mistral model to fine-tune (overrides ds_mp.model)")
    p.add_argument("--data", default=None, help="prepared dataset dir (overrides ds_mp.data.path)")
    p.add_argument("--steps", type=int, default=None, help="override ds_mp.training.steps")
    p.add_argument("--output_dir", default=None, help="override ds_mp.training.output_dir")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _apply_overrides(raw: dict, args: argparse.Namespace) -> dict:
    block = raw.setdefault("ds_mp", {})
    if args.model:
        block["model"] = args.model
    if args.data:
        block.setdefault("data", {})["path"] = args.data
    if args.steps is not None:  # an explicit step count wins over training.epochs
        block.setdefault("training", {}).update(steps=args.steps, epochs=0)
    if args.output_dir:
        block.setdefault("training", {})["output_dir"] = args.output_dir
    return raw


def main(argv: list[str] | None = None) -> int:
    from ds_mp.checkpoint import CheckpointError
    from ds_mp.data import DataError
    from ds_mp.hub import HubError
    from ds_mp.models.token_ids import TokenIdError
    from ds_mp.training.startup import StartupError

    args = parse_args(argv)
    run_dir, stop = RunDir(), StopFlag(stop_grace_s()).install()
    try:
        return _run(args, run_dir, stop)
    except StopRequested as e:
        if str(e):
            print(e, file=sys.stderr)
        return e.code
    except (ConfigError, DataError, TokenIdError, CheckpointError, HubError, NonFiniteLoss, RunDirError,
            StartupError) as e:
        print(f"ds_mp: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, NonFiniteLoss) else 2
    finally:
        stop.uninstall()
        run_dir.release()


def _run(args: argparse.Namespace, run_dir: RunDir, stop: StopFlag) -> int:
    """The run's four phases; ``run_dir`` holds global rank 0's lock on the output directory, ``stop``
    the signals and launcher watch (:mod:`ds_mp.training.signals`).  A run of the ``"dpo"`` loss
    is :mod:`ds_mp.training.preference`'s."""
    try:
        raw = _apply_overrides(read_json(args.deepspeed_config), args)
    except ConfigError:  # an unreadable config: start_up reports it, agreed over the ranks
        raw = {}
    if wants_dpo(raw):
        return run_dpo(raw, args.resume)
    started = start_up(args, run_dir)  # checked, agreed by every rank, locked, one resume point
    run = build(started)  # engine, data, ramp, probe, log; a resume restored into them
    bar = train(run, stop)  # the steps, with their logs, checkpoints and stop after a signal
    finish(run, bar)  # the last checkpoint and the HF export
    return 0


def start_up(args: argparse.Namespace, run_dir: RunDir) -> Started:
    """Every check that needs no communication on every rank, the rendezvous, the agreement on
    their outcome (one rank's failure ends every rank with its cause: :mod:`ds_mp.training.startup`),
    then global rank 0's lock on the output directory and its choice of the resume point."""
    from ds_mp.checkpoint import directory_source
    from ds_mp.data import datasets_for
    from ds_mp.engine.initialize import init_distributed
    from ds_mp.hub import resolve_model
    from ds_mp.training import startup
    from ds_mp.training.run_dir import check_unlocked, choose_resume, from_rank0, open_run_dir

    root: list[str] = []  # the checkpoint root, once the config says it

    def checks() -> tuple:
        """Everything that can be checked without communication, on every rank: the config parsed and
        validated once (its model resolved in the one step that may read the Hub), the data, the
        weights to start from; the config the engine gets is the one that trains those weights."""
        world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; initialize re-checks the rendezvous'
        cfg, raw = load_config(_apply_overrides(read_json(args.deepspeed_config), args), world)
        tcfg = cfg.training
        root.append(os.path.join(tcfg.output_dir, "checkpoints"))
        startup.check_deepspeed_blocks(raw)
        data_path, train_ds, val_ds = datasets_for(cfg)
        if os.path.exists(tcfg.output_dir) and not os.path.isdir(tcfg.output_dir):
            raise ConfigError(f"ds_mp.training.output_dir: {tcfg.output_dir!r} is a file; choose a directory")
        init = tcfg.init_from or (cfg.model if isinstance(cfg.model, str) else None)  # cfg.model: Hub id resolved
        if tcfg.init_from:
            init = resolve_model(tcfg.init_from, "ds_mp.training.init_from")
        if init:
            directory_source(init)  # config, files, keys and shapes: fails before any collective
        if tcfg.init_from:  # the run trains init_from's weights: its shape is the model's
            cfg = validate_model(resolve_model_source(dataclasses.replace(cfg, model=init, model_source="")), world)
        _warn_tokenizer(train_ds.info, init)
        check_unlocked(tcfg.output_dir)  # every rank, before any collective; rank 0 decides below
        choose_resume(root[0], args.resume)
        return raw, cfg, data_path, train_ds, val_ds, init

    # one rank's failed check ends every rank of every node, each with the cause (training.startup)
    raw, cfg, data_path, train_ds, val_ds, init = startup.checked_then_agreed(
        checks, lambda: startup.tags_view(root[0]) if root else None, init_distributed, _device)  # initialize reuses it
    ckpt_root, out = root[0], cfg.training.output_dir
    resume_tag, notes, holder = from_rank0(lambda: (*open_run_dir(run_dir, out, ckpt_root, args.resume),
                                                    run_dir.holder), _device())  # lock, leftovers, ONE resume point
    startup.check_shared_output_dir(out, holder, _device())  # every rank sees rank 0's lock: one filesystem
    return Started(raw, cfg, data_path, train_ds, val_ds, init, ckpt_root, resume_tag, notes)


def _warn_tokenizer(info: Any, model_dir: str | None) -> None:
    """One line on rank 0 when the dataset was encoded by another tokenizer than the model's."""
    from ds_mp.data.checks import tokenizer_mismatch

    warning = tokenizer_mismatch(info, model_dir)
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr)


def _device() -> torch.device:
    """This rank's accelerator device before the engine exists (collectives on NCCL need it)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


__all__ = ["main", "parse_args", "start_up", "NonFiniteLoss", "evaluate", "restore_sampler", "monitor_metrics",
           "peak_memory_mib"]


if __name__ == "__main__":
    sys.exit(main())
