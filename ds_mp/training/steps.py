"""The training steps of a built :class:`~ds_mp.training.run.Run` and its finish: per step the
batch (ramp), the step, the trace window, the NaN guard, validation, a log row (``log.csv`` and
DeepSpeed's monitors), checkpoints and the job-wide stop after a signal; at the end the last
checkpoint and the HF export."""
from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ds_mp.engine_view import EngineView
from ds_mp.training.run import Run, save
from ds_mp.training.signals import StopFlag, StopRequested, stop_message


class NonFiniteLoss(RuntimeError):
    """Raised when the loss is NaN/Inf and ``training.on_nan`` is "stop"."""


@dataclass
class Window:
    """What the log row of the steps since the last row reports."""

    steps: list[tuple[float, float, float]] = field(default_factory=list)  # (seconds, tokens, FLOPs) per step
    recorded: list = field(default_factory=list)  # the trace_steps window's instructions on this rank
    t_start: float = field(default_factory=time.time)


def train(run: Run, stop: StopFlag) -> Any:
    """Steps ``start_step + 1 … run.steps``; returns the progress bar (closed by :func:`finish`)."""
    from ds_mp.training.nan_guard import NanGuard

    engine, tcfg = run.engine, run.tcfg
    nan_guard = NanGuard(tcfg.on_nan, tcfg.max_consecutive_skips)
    bar = _progress(run.rank0, run.start_step, run.steps)
    engine.record_trace()
    window = Window()
    stop.running()  # start-up is over: a signal now ends the run after the step, with a save
    for step in range(run.start_step + 1, run.steps + 1):
        loss, dt, batch_size, step_lr, counts = _step(run, step, window, bar)
        if nan_guard.after_step(loss, engine.last_step_nonfinite):  # a diagnostic save; `latest` stays
            from ds_mp.training.run_dir import finished_tags

            save(run, step, f"nan-step{step}")
            raise NonFiniteLoss(nan_guard.stop_message(step, loss, os.path.join(run.started.ckpt_root,
                                                                                f"nan-step{step}"),
                                                       finished_tags(run.started.ckpt_root)))
        val_loss = evaluate(engine, run.val) if run.val is not None and tcfg.eval_interval and \
            step % tcfg.eval_interval == 0 else None
        if run.rank0:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{counts.counted / dt:,.0f}")
        if step % tcfg.log_interval == 0 or val_loss is not None or step == run.steps:
            _log_row(run, step, window, bar, loss, val_loss, dt, batch_size, step_lr, counts)
        _after_step(run, stop, step, bar)
    return bar


def _step(run: Run, step: int, window: Window, bar: Any) -> tuple[float, float, int, Optional[float], Any]:
    """One optimizer step (the ramp's batch first); returns loss, seconds, batch size, the LR the
    ramp scaled to (None: no ramp) and the step's token counts."""
    from ds_mp.data import step_tokens
    from ds_mp.training.metrics import decoder_flops

    engine, sampler, ramp, cfg = run.engine, run.sampler, run.ramp, run.cfg
    step_lr = None
    if ramp is not None:  # DeepSpeed's own batch change: more micro-batches per step, same engine
        batch = ramp.before_step(step, None if run.probe is None else run.probe.estimator)
        if batch != engine.train_batch_size():
            engine.set_train_batch_size(batch)
            sampler.set_grad_accum(engine.gradient_accumulation_steps())
        step_lr = run.lr_scaling.apply(ramp.lr_factor)[0]
    batch_size = engine.train_batch_size()
    flops_per_step = decoder_flops(run.hf_config, cfg.data.seq_len, batch_size)
    engine.trace.clear()
    t0 = time.perf_counter()
    loss = float(engine.train_batch(sampler))
    dt = time.perf_counter() - t0
    counts = step_tokens(sampler, batch_size, cfg.data.seq_len)
    window.steps.append((dt, counts.counted, flops_per_step))
    if ramp is not None:
        ramp.after_step()
    trace_first, trace_last = run.tcfg.trace_steps or (0, 0)
    if trace_first <= step <= trace_last:
        window.recorded.extend(engine.trace)
        if step == trace_last:
            _write_trace(engine, window.recorded, os.path.join(run.tcfg.output_dir, "trace.json"), bar)
    return loss, dt, batch_size, step_lr, counts


def _log_row(run: Run, step: int, window: Window, bar: Any, loss: float, val_loss: Optional[float], dt: float,
             batch_size: int, step_lr: Optional[float], counts: Any) -> None:
    """One ``log.csv`` row (rank 0) over the steps since the last one, also sent to DeepSpeed's monitors."""
    from ds_mp.training.metrics import bubble

    engine, log = run.engine, run.log
    secs = sum(w[0] for w in window.steps)
    tok_s, flop_s = sum(w[1] for w in window.steps) / secs, sum(w[2] for w in window.steps) / secs
    times = engine.instruction_times()
    if log is not None:
        norm = engine.get_global_grad_norm()
        metrics = {"epoch": run.sampler.consumed_samples / run.sampler.num_chunks, "loss": loss, "val_loss": val_loss,
                   "val_ppl": None if val_loss is None else _ppl(val_loss),
                   "lr": engine.get_lr()[0] if step_lr is None else step_lr, "tokens_per_s": tok_s,
                   "tflops": flop_s / 1e12, "bubble": bubble(times, dt),
                   "grad_norm": None if norm is None else float(norm),
                   "noise_scale": None if run.probe is None else run.probe.value,
                   "batch_size": batch_size, "peak_mem_mib": peak_memory_mib(),
                   "skipped": engine.nonfinite_steps + engine.skipped_steps,
                   "elapsed_s": time.time() - window.t_start, "target_tokens": counts.targets,
                   "padding_tokens": counts.padding}
        log.row(step=step, **{k: _fmt(k, v) for k, v in metrics.items()})
        monitor_metrics(engine, step, metrics)
        msg = f"step {step} loss {loss:.4f}"
        if val_loss is not None:
            msg += f" val {val_loss:.4f} (ppl {_ppl(val_loss):.2f})"
        bar.write(msg + f" | {tok_s:,.0f} tok/s")
    window.steps.clear()


def _after_step(run: Run, stop: StopFlag, step: int, bar: Any) -> None:
    """The interval checkpoint, then the job-wide stop (a signal, or rank 0's log failing): every
    rank ends after this same step, saved unless ``training.save_on_signal`` is off."""
    tcfg, log = run.tcfg, run.log
    saved = tcfg.checkpoint_interval and step % tcfg.checkpoint_interval == 0 and step != run.steps
    if saved:
        save(run, step)
    signum, log_failed = stop.agreed(run.engine.device, log is not None and log.error is not None)  # collective
    if log_failed or (signum and step != run.steps):
        bar.close()
        if log_failed:  # rank 0 could not write log.csv (a full disk): it says why, the others stop quietly
            raise log.error if log is not None else StopRequested("", 2)
        if tcfg.save_on_signal and not saved:  # a signal: save (unless off or just done), then exit
            save(run, step)
        message = stop_message(stop.describe(signum), step, run.started.ckpt_root,
                               bool(saved or tcfg.save_on_signal))
        raise StopRequested(message if run.rank0 else "", 128 + signum)


def finish(run: Run, bar: Any) -> None:
    """The last checkpoint (unless resumed at the end) and the HF export (merged + PEFT adapter with LoRA)."""
    import ds_mp

    tcfg, engine, started = run.tcfg, run.engine, run.started
    if run.start_step < run.steps:
        save(run, run.steps)
    tokenizer_dir = started.train_ds.info.tokenizer_dir
    if tcfg.export_hf and run.cfg.lora.r:  # the PEFT adapter, and the merged model as the HF directory
        ds_mp.save_lora(engine, os.path.join(tcfg.output_dir, "adapter"), base_model=started.init)
        ds_mp.save_lora(engine, os.path.join(tcfg.output_dir, "hf"), merge=True, tokenizer_dir=tokenizer_dir)
    elif tcfg.export_hf:
        ds_mp.save_hf(engine, os.path.join(tcfg.output_dir, "hf"), tokenizer_dir=tokenizer_dir)
    if run.rank0:
        bar.close()
        hf = f"HF model in {os.path.join(tcfg.output_dir, 'hf')}; " if tcfg.export_hf else ""
        print(f"ds_mp: done: {run.steps} steps; checkpoints in {started.ckpt_root}; {hf}"
              f"log {os.path.join(tcfg.output_dir, 'log.csv')}")


def evaluate(engine: EngineView, val_batches: Any) -> float:
    """The per-target-token loss over every row of ``val_batches`` (a
    :class:`ds_mp.data.validation.HeldOutBatches`); every rank returns the same value."""
    from ds_mp.data.validation import held_out_loss

    return held_out_loss(engine, val_batches)


def _write_trace(engine: EngineView, recorded: list, path: str, bar: Any) -> None:
    """Collective: gather every rank's recorded steps; rank 0 writes them to ``path`` (Chrome trace)."""
    from ds_mp.training.trace import gather_trace, write_chrome_trace

    traces = gather_trace(engine, recorded)
    if traces is not None:
        write_chrome_trace(traces, path)
        bar.write(f"timeline of training.trace_steps written: {path} (ds-mp timeline {path} --out timeline.png)")


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def _ppl(loss: float) -> float:
    """exp(loss), inf instead of an OverflowError for a diverged loss."""
    return math.inf if loss > 700 else math.exp(loss)


def _progress(enabled: bool, start: int, total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, desc="train", dynamic_ncols=True,
                file=sys.stdout)


__all__ = ["NonFiniteLoss", "Window", "train", "finish", "evaluate", "monitor_metrics", "peak_memory_mib",
           "MONITOR_PREFIX"]
