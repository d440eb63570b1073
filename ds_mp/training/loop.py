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
               passes; data.val_path names a held-out records file): ds_mp.data.validation
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
import math
import os
import resource
import sys
import time
from typing import Any

import torch

from ds_mp.checkpoint.training import LATEST
from ds_mp.config import ConfigError, load_config, ramp_micro_multiple, read_json
from ds_mp.training.csv_log import CsvLog
from ds_mp.training.run_dir import RunDir, RunDirError
from ds_mp.training.signals import StopFlag, StopRequested, stop_grace_s, stop_message
from ds_mp.engine_view import EngineView


class NonFiniteLoss(RuntimeError):
    """Raised when the loss is NaN/Inf and ``training.on_nan`` is "stop"."""


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


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def evaluate(engine: EngineView, val_batches: Any) -> float:
    """The per-target-token loss over every row of ``val_batches`` (a
    :class:`ds_mp.data.validation.HeldOutBatches`); every rank returns the same value."""
    from ds_mp.data.validation import held_out_loss

    return held_out_loss(engine, val_batches)


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
    """The run; ``run_dir`` holds global rank 0's lock on the output directory, ``stop`` the
    signals and launcher watch (:mod:`ds_mp.training.signals`)."""
    import ds_mp
    from ds_mp.checkpoint import directory_source, load_checkpoint, save_checkpoint
    from ds_mp.engine.initialize import init_distributed
    from ds_mp.training.run_dir import check_unlocked, choose_resume, finished_tags, from_rank0, open_run_dir, rotate
    from ds_mp.training import startup
    from ds_mp.data import datasets_for, step_tokens, training_batches
    from ds_mp.hub import resolve_model
    from ds_mp.models.family import model_config
    from ds_mp.training.batch_ramp import BatchRamp, LrScaling
    from ds_mp.training.epochs import epoch_note, epoch_steps
    from ds_mp.training.metrics import NoiseScaleProbe, bubble, decoder_flops
    from ds_mp.training.nan_guard import NanGuard
    from ds_mp.tensor_parallel.random import rng_state, set_rng_state

    root: list[str] = []  # the checkpoint root, once the config says it

    def checks() -> tuple:
        """Everything that can be checked without communication, on every rank."""
        raw = _apply_overrides(read_json(args.deepspeed_config), args)
        cfg, raw = load_config(raw, int(os.environ.get("WORLD_SIZE", "1")))
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
        _warn_tokenizer(train_ds.info, init)
        check_unlocked(tcfg.output_dir)  # every rank, before any collective; rank 0 decides below
        choose_resume(root[0], args.resume)
        return raw, cfg, tcfg, data_path, train_ds, val_ds, init

    # one rank's failed check ends every rank of every node, each with the cause (training.startup)
    raw, cfg, tcfg, data_path, train_ds, val_ds, init = startup.checked_then_agreed(
        checks, lambda: startup.tags_view(root[0]) if root else None, init_distributed, _device)  # initialize reuses it
    ckpt_root = root[0]
    resume_tag, notes, holder = from_rank0(lambda: (*open_run_dir(run_dir, tcfg.output_dir, ckpt_root, args.resume),
                                                    run_dir.holder), _device())  # lock, leftovers, ONE resume point
    startup.check_shared_output_dir(tcfg.output_dir, holder, _device())  # every rank sees rank 0's lock: one filesystem
    engine, _, _, _ = ds_mp.initialize(model=init, config=raw)
    topo, rank0 = engine.topology, torch.distributed.get_rank() == 0
    probe = NoiseScaleProbe.from_config(cfg, topo)  # None unless DP > 1 and on
    engine.use_noise_probe(probe)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    ramp = BatchRamp.from_config(cfg.batch_ramp, micro, topo.dp, ramp_micro_multiple(cfg))  # None: fixed batch
    lr_scaling = LrScaling(engine.optimizer) if ramp is not None else None  # scales inside the step only
    hf_config = model_config(cfg)  # the FLOPs per step count the family's own block
    sampler, val, report = training_batches(cfg, train_ds, val_ds, micro, gas, topo.dp_rank, topo.dp)
    if rank0 and report is not None:
        print(f"ds_mp: SFT data: {report}", flush=True)
    if rank0 and val is None and tcfg.eval_interval:
        print("ds_mp: no validation: the dataset has no held-out split (--val-fraction 0); name a held-out file "
              "with data.val_path to validate", flush=True)
    start_step = 0
    if resume_tag is not None:
        state = load_checkpoint(engine, ckpt_root, resume_tag)
        start_step = int(state["step"])
        restore_sampler(sampler, state, start_step)
        if ramp is not None and state.get("batch_ramp") is not None:  # current batch, samples, LR kept apart
            ramp.load_state_dict(state["batch_ramp"]["ramp"])
            lr_scaling.load_state_dict(state["batch_ramp"]["lr"])
        if probe is not None and state.get("noise_scale") is not None:  # the estimator's EMAs
            probe.estimator.load_state_dict(state["noise_scale"])
        rng = state.get("rng")
        if rng is not None and state.get("layout") == _layout(topo):  # the same ranks: each its own streams
            set_rng_state(rng[torch.distributed.get_rank()] if isinstance(rng, list) else rng)
    if tcfg.epochs:  # the steps those epochs take from here (ds_mp.training.epochs)
        tcfg.steps = epoch_steps(tcfg.epochs, sampler.num_chunks, sampler.consumed_samples, start_step,
                                 engine.train_batch_size(), ramp)
    if rank0:
        print(epoch_note(sampler.num_chunks, engine.train_batch_size(), tcfg.steps, tcfg.epochs, ramp), flush=True)
    for note in notes if rank0 else []:
        print(note, file=sys.stderr)
    log = CsvLog(os.path.join(tcfg.output_dir, "log.csv"), resume_step=start_step if resume_tag else None) \
        if rank0 else None
    ramp_note = None if ramp is None or probe is None else ramp.warm_up_note(probe.interval, probe.estimator.beta,
                                                                             start_step, tcfg.steps)
    if rank0 and ramp_note:  # the noise-scale policy's wait for its EMA, said up front
        print(ramp_note)

    def save(step: int, tag: str | None = None) -> None:
        """A regular ``stepN`` checkpoint (moves ``latest``), or a named diagnostic one (does not)."""
        rngs: list = [None] * torch.distributed.get_world_size()  # every rank's streams (they differ over
        torch.distributed.all_gather_object(rngs, rng_state())  # TP and PP), by global rank: exact dropout
        save_checkpoint(engine, ckpt_root, tag or f"step{step}",
                        {"step": step, "data": data_path, "rng": rngs, "layout": _layout(topo),
                         "sampler": sampler.state_dict(),
                         "batch_ramp": None if ramp is None else {"ramp": ramp.state_dict(),
                                                                  "lr": lr_scaling.state_dict()},
                         "noise_scale": None if probe is None else probe.estimator.state_dict()},
                        update_latest=tag is None)
        if rank0 and tag is None:  # training.keep_last; a tagged (diagnostic) save deletes nothing
            rotate(ckpt_root, tcfg.keep_last)

    nan_guard = NanGuard(tcfg.on_nan, tcfg.max_consecutive_skips)
    bar = _progress(rank0, start_step, tcfg.steps)
    engine.record_trace()
    trace_first, trace_last = tcfg.trace_steps or (0, 0)
    recorded: list = []  # the trace_steps window's instructions on this rank
    window: list[tuple[float, float, float]] = []  # (seconds, tokens, FLOPs) of the steps since the last row
    t_start = time.time()
    stop.running()  # start-up is over: a signal now ends the run after the step, with a save
    for step in range(start_step + 1, tcfg.steps + 1):
        step_lr = None
        if ramp is not None:  # DeepSpeed's own batch change: more micro-batches per step, same engine
            batch = ramp.before_step(step, None if probe is None else probe.estimator)
            if batch != engine.train_batch_size():
                engine.set_train_batch_size(batch)
                sampler.set_grad_accum(engine.gradient_accumulation_steps())
            step_lr = lr_scaling.apply(ramp.lr_factor)[0]
        batch_size = engine.train_batch_size()
        flops_per_step = decoder_flops(hf_config, cfg.data.seq_len, batch_size)
        engine.trace.clear()
        t0 = time.perf_counter()
        loss = float(engine.train_batch(sampler))
        dt = time.perf_counter() - t0
        counts = step_tokens(sampler, batch_size, cfg.data.seq_len)
        tokens_per_step = counts.counted
        window.append((dt, tokens_per_step, flops_per_step))
        if ramp is not None:
            ramp.after_step()
        if trace_first <= step <= trace_last:
            recorded.extend(engine.trace)
            if step == trace_last:
                _write_trace(engine, recorded, os.path.join(tcfg.output_dir, "trace.json"), bar)
        if nan_guard.after_step(loss, engine.last_step_nonfinite):  # a diagnostic save; `latest` stays
            save(step, f"nan-step{step}")
            raise NonFiniteLoss(nan_guard.stop_message(step, loss, os.path.join(ckpt_root, f"nan-step{step}"),
                                                       finished_tags(ckpt_root)))
        val_loss = None
        if val is not None and tcfg.eval_interval and step % tcfg.eval_interval == 0:
            val_loss = evaluate(engine, val)
        if rank0:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if step % tcfg.log_interval == 0 or val_loss is not None or step == tcfg.steps:
            secs = sum(w[0] for w in window)
            tok_s, flop_s = sum(w[1] for w in window) / secs, sum(w[2] for w in window) / secs
            times = engine.instruction_times()
            if log is not None:
                noise = None if probe is None else probe.value
                norm = engine.get_global_grad_norm()
                metrics = {"epoch": sampler.consumed_samples / sampler.num_chunks, "loss": loss, "val_loss": val_loss,
                           "val_ppl": None if val_loss is None else _ppl(val_loss),
                           "lr": engine.get_lr()[0] if step_lr is None else step_lr, "tokens_per_s": tok_s,
                           "tflops": flop_s / 1e12, "bubble": bubble(times, dt),
                           "grad_norm": None if norm is None else float(norm), "noise_scale": noise,
                           "batch_size": batch_size, "peak_mem_mib": peak_memory_mib(),
                           "skipped": engine.nonfinite_steps + engine.skipped_steps,
                           "elapsed_s": time.time() - t_start, "target_tokens": counts.targets,
                           "padding_tokens": counts.padding}
                log.row(step=step, **{k: _fmt(k, v) for k, v in metrics.items()})
                monitor_metrics(engine, step, metrics)
                msg = f"step {step} loss {loss:.4f}"
                if val_loss is not None:
                    msg += f" val {val_loss:.4f} (ppl {_ppl(val_loss):.2f})"
                bar.write(msg + f" | {tok_s:,.0f} tok/s")
            window.clear()
        saved = tcfg.checkpoint_interval and step % tcfg.checkpoint_interval == 0 and step != tcfg.steps
        if saved:
            save(step)
        signum, log_failed = stop.agreed(engine.device, log is not None and log.error is not None)  # collective
        if log_failed or (signum and step != tcfg.steps):  # every rank ends after this same step
            bar.close()
            if log_failed:  # rank 0 could not write log.csv (a full disk): it says why, the others stop quietly
                raise log.error if log is not None else StopRequested("", 2)
            if tcfg.save_on_signal and not saved:  # a signal: save (unless off or just done), then exit
                save(step)
            message = stop_message(stop.describe(signum), step, ckpt_root, bool(saved or tcfg.save_on_signal))
            raise StopRequested(message if rank0 else "", 128 + signum)
    if start_step < tcfg.steps:
        save(tcfg.steps)
    if tcfg.export_hf and cfg.lora.r:  # the PEFT adapter, and the merged model as the HF directory
        ds_mp.save_lora(engine, os.path.join(tcfg.output_dir, "adapter"), base_model=init)
        ds_mp.save_lora(engine, os.path.join(tcfg.output_dir, "hf"), merge=True, tokenizer_dir=train_ds.info.tokenizer_dir)
    elif tcfg.export_hf:
        ds_mp.save_hf(engine, os.path.join(tcfg.output_dir, "hf"), tokenizer_dir=train_ds.info.tokenizer_dir)
    if rank0:
        bar.close()
        hf = f"HF model in {os.path.join(tcfg.output_dir, 'hf')}; " if tcfg.export_hf else ""
        print(f"ds_mp: done: {tcfg.steps} steps; checkpoints in {ckpt_root}; {hf}"
              f"log {os.path.join(tcfg.output_dir, 'log.csv')}")
    return 0


def _warn_tokenizer(info: Any, model_dir: str | None) -> None:
    """One line on rank 0 when the dataset was encoded by another tokenizer than the model's."""
    from ds_mp.data.checks import tokenizer_mismatch

    warning = tokenizer_mismatch(info, model_dir)
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr)


def _write_trace(engine: EngineView, recorded: list, path: str, bar: Any) -> None:
    """Collective: gather every rank's recorded steps; rank 0 writes them to ``path`` (Chrome trace)."""
    from ds_mp.training.trace import gather_trace, write_chrome_trace

    traces = gather_trace(engine, recorded)
    if traces is not None:
        write_chrome_trace(traces, path)
        bar.write(f"timeline of training.trace_steps written: {path} (ds-mp timeline {path} --out timeline.png)")


# log.csv cell format per metric (None -> empty cell)
_FORMATS = {"epoch": "{:.4f}", "loss": "{:.6f}", "val_loss": "{:.6f}", "val_ppl": "{:.4f}", "lr": "{}",
            "tokens_per_s": "{:.1f}",
            "tflops": "{:.4f}", "bubble": "{:.3f}", "grad_norm": "{:.4f}", "noise_scale": "{:.2f}", "batch_size": "{}",
            "peak_mem_mib": "{:.0f}", "skipped": "{}", "elapsed_s": "{:.1f}", "target_tokens": "{}",
            "padding_tokens": "{}"}

MONITOR_PREFIX = "ds_mp/"


def _fmt(key: str, value: Any) -> str:
    return "" if value is None else _FORMATS[key].format(value)


def monitor_metrics(engine: EngineView, step: int, metrics: dict[str, float | None]) -> list[tuple[str, float, int]]:
    """Send one log row through DeepSpeed's monitor (``"tensorboard"``/``"wandb"``/``"csv_monitor"``/
    ``"comet"`` blocks of the JSON): one event ``("ds_mp/<column>", value, step)`` per ``log.csv``
    column that has a value, x axis = optimizer step (DeepSpeed's own ``Train/Samples/*`` events
    use samples).  Call on rank 0 only (``MonitorMaster`` writes on rank 0 anyway); returns the
    events written (empty when no monitor is enabled)."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not monitor.enabled:
        return []
    events = [(MONITOR_PREFIX + k, float(v), step) for k, v in metrics.items() if v is not None]
    monitor.write_events(events)
    return events


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


def _ppl(loss: float) -> float:
    """exp(loss), inf instead of an OverflowError for a diverged loss."""
    return math.inf if loss > 700 else math.exp(loss)


def _device() -> torch.device:
    """This rank's accelerator device before the engine exists (collectives on NCCL need it)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


def _layout(topo: Any) -> list[int]:
    return [topo.tp, topo.pp, topo.dp]


def _progress(enabled: bool, start: int, total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, desc="train", dynamic_ncols=True,
                file=sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
