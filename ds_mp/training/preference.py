"""A DPO run under the launcher: ``"loss": {"type": "dpo", ...}`` with a preference JSONL as ``data.path``.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/dpo.json

``ds_mp.training.loop.main`` hands a run whose loss is ``"dpo"`` here.  The run:

1. reads ``data.path`` (TRL's ``prompt`` / ``chosen`` / ``rejected`` records, plain or
   conversational) and tokenizes it with the model directory's tokenizer as TRL 1.16 does
   (``ds_mp.data.preference``; ``data.seq_len`` is TRL's ``max_length``, ``keep_start``);
2. builds the engine from the model directory (``ds_mp.model`` or ``training.init_from``);
3. precomputes every pair's reference log-probs (chosen, rejected) once, with the initial weights
   (LoRA: the adapters disabled) on the same engine, forward only, with a progress bar on rank 0,
   and keeps them in ``<output_dir>/ref_logps.pt`` (per pair: a resume at another layout reads them);
4. trains ``training.steps`` steps (or ``training.epochs`` passes over the pairs), a step's
   ``micro · gas · dp`` rows being ``micro/2`` pairs per micro-batch, each pair in one micro-batch,
   the replicas reading distinct pairs; every ``log_interval`` steps rank 0 prints and appends to
   ``<output_dir>/dpo_log.jsonl`` the loss and TRL's ``rewards/*`` and ``logps/*`` metrics;
5. saves a layout-free checkpoint (``<output_dir>/checkpoints/stepN``) every
   ``checkpoint_interval`` steps and at the end; ``--resume`` (latest, or a tag) continues from one;
6. exports the HF directory to ``<output_dir>/hf`` (``training.export_hf``).

Not in this path: validation; a batch ramp (refused); the run-directory lock and signal handling
of the LM loop.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch

from ds_mp.config import ConfigError, load_config
from ds_mp.config.schema import DsMpConfig
from ds_mp.data.errors import DataError
from ds_mp.engine_view import RuntimeEngine


def wants_dpo(raw: dict) -> bool:
    """True if the DeepSpeed JSON's ``"ds_mp"`` block picks the ``"dpo"`` loss."""
    block = raw.get("ds_mp") if isinstance(raw, dict) else None
    loss = block.get("loss") if isinstance(block, dict) else None
    return isinstance(loss, dict) and loss.get("type") == "dpo"


def run_dpo(raw: dict, resume: Any) -> int:
    """The run (module docstring) on this rank, from the start or (``resume``: a tag or
    ``"latest"``) from a checkpoint of it; 0 on success, 2 after a refusal (printed)."""
    try:
        return _run(raw, resume)
    except (ConfigError, DataError) as err:
        print(f"ds_mp: error: {err}", file=sys.stderr)
        return 2


def _checked(raw: dict) -> tuple[Any, str, Any, list]:
    """Every check needing no communication: the config, the model directory, the data."""
    from transformers import AutoTokenizer

    from ds_mp.data.preference import read_preference_jsonl, tokenize_pairs
    from ds_mp.hub import resolve_model

    cfg, raw = load_config(raw, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.batch_ramp.policy:
        raise ConfigError("ds_mp.batch_ramp.policy: not supported with the 'dpo' loss; remove it")
    name = cfg.training.init_from or (cfg.model if isinstance(cfg.model, str) else "")
    if not name:
        raise ConfigError("ds_mp.model: the 'dpo' loss needs an HF model directory (with its tokenizer), not an "
                          "inline shape")
    model_dir = resolve_model(name, "ds_mp.model")
    micro = raw["train_micro_batch_size_per_gpu"]
    if micro % 2:
        raise ConfigError(f"train_micro_batch_size_per_gpu: {micro} rows; the 'dpo' loss reads [chosen; rejected] "
                          "rows, so use an even number (2 rows per pair)")
    if not cfg.data.path.endswith(".jsonl"):
        raise ConfigError(f"ds_mp.data.path: {cfg.data.path!r}; the 'dpo' loss reads a preference .jsonl file "
                          "(prompt/chosen/rejected records)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, dropped = tokenize_pairs(tokenizer, read_preference_jsonl(cfg.data.path), cfg.data.seq_len)
    if not pairs:
        raise DataError(f"data.path: every prompt fills data.seq_len={cfg.data.seq_len}; raise it")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return cfg, model_dir, (pad, dropped), pairs


def _run(raw: dict, resume: Any) -> int:
    import ds_mp
    from ds_mp.checkpoint.latest import LATEST
    from ds_mp.data.preference import pair_order
    from ds_mp.losses.dpo import dpo_metrics

    cfg, model_dir, (pad, dropped), pairs = _checked(raw)
    engine, *_ = ds_mp.initialize(model=model_dir, config=raw, loaded=cfg)
    run = _Run(engine, cfg, pairs, pad)
    rank0, out = torch.distributed.get_rank() == 0, cfg.training.output_dir
    root, refs_path = os.path.join(out, "checkpoints"), os.path.join(out, "ref_logps.pt")
    steps = math.ceil(cfg.training.epochs * len(pairs) / run.per_step) if cfg.training.epochs else cfg.training.steps
    if rank0:
        print(f"ds_mp: DPO data: {len(pairs)} pairs ({dropped} dropped: prompt fills seq_len), {run.per_step} "
              f"pairs a step, {steps} steps", flush=True)
    first = 0
    if resume is not None:
        _, state = engine.load_checkpoint(root, None if resume == LATEST else resume)
        if state is None:
            raise ConfigError(f"--resume: no checkpoint under {root}; start without --resume")
        first, ref = state["dpo_step"], torch.load(refs_path)
    else:
        ref = run.reference(math.ceil(len(pairs) / run.per_step), rank0)  # every pair (a resume may run longer)
        if rank0:
            os.makedirs(out, exist_ok=True)
            torch.save(ref, refs_path)
    log = os.path.join(out, "dpo_log.jsonl")
    if rank0 and resume is None:
        open(log, "w").close()
    interval = cfg.training.checkpoint_interval
    for step in range(first, steps):
        ids = pair_order(len(pairs), step, run.b, run.gas, run.topo.dp, cfg.data.seed)[:, run.topo.dp_rank]
        fed = [{**run.rows(k), "ref_logps": torch.cat([ref[k, 0], ref[k, 1]])} for k in ids]
        loss = float(engine.train_batch(iter(fed)))
        metrics = dpo_metrics(engine.step_rows(), engine.module.loss_spec.beta)
        if rank0 and ((step + 1) % max(cfg.training.log_interval, 1) == 0 or step + 1 == steps):
            line = json.dumps({"step": step + 1, "loss": loss, **metrics})
            print(f"ds_mp: {line}", flush=True)
            with open(log, "a") as fh:
                fh.write(line + "\n")
        if step + 1 == steps or (interval and (step + 1) % interval == 0):
            engine.save_checkpoint(root, f"step{step + 1}", client_state={"dpo_step": step + 1})
    if cfg.training.export_hf:
        ds_mp.save_hf(engine, os.path.join(out, "hf"), tokenizer_dir=model_dir)
    return 0


class _Run:
    """The run's pairs as micro-batches, and their reference log-probs."""

    def __init__(self, engine: RuntimeEngine, cfg: DsMpConfig, pairs: list, pad: int) -> None:
        self.engine, self.cfg, self.pairs, self.pad, self.topo = engine, cfg, pairs, pad, engine.topology
        self.b, self.gas = engine.train_micro_batch_size_per_gpu() // 2, engine.gradient_accumulation_steps()
        self.per_step = self.b * self.gas * self.topo.dp

    def rows(self, ids: Any) -> dict[str, torch.Tensor]:
        """The micro-batch of pairs ``ids`` (``ds_mp.data.preference.pair_rows``, ``data.seq_len`` wide)."""
        from ds_mp.data.preference import pair_rows

        T = self.cfg.data.seq_len
        return pair_rows([self.pairs[int(i)] for i in ids], T, T, self.pad)

    def reference(self, steps: int, show: bool) -> torch.Tensor:
        """``(pairs, 2)``: each pair's chosen and rejected reference log-probs, from the engine's
        current weights (adapters disabled), over the first ``steps`` steps' pairs (every pair
        once: they cover the first epoch); the same on every rank.  Collective."""
        from ds_mp.data.preference import pair_order
        from ds_mp.engine.reference import lora_disabled, ref_log_probs

        ref = torch.full((len(self.pairs), 2), float("nan"))
        with lora_disabled(self.engine):  # full fine-tune: nothing to disable, the initial weights are the reference
            for step in _progress(range(steps), show, "reference log-probs"):
                ids = pair_order(len(self.pairs), step, self.b, self.gas, self.topo.dp, self.cfg.data.seed)
                mine = [self.rows(k) for k in ids[:, self.topo.dp_rank]]
                every = ref_log_probs(self.engine, mine, every_replica=True).cpu()
                every = every.view(self.topo.dp, self.gas, 2, self.b)  # replica, micro-batch, chosen/rejected, pair
                order = torch.as_tensor(ids).permute(1, 0, 2)  # (dp, gas, b) as the rows
                ref[order.reshape(-1), 0] = every[:, :, 0].reshape(-1)
                ref[order.reshape(-1), 1] = every[:, :, 1].reshape(-1)
        return ref


def _progress(items: Any, show: bool, what: str) -> Any:
    """``items`` with a progress bar on rank 0."""
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"ds_mp: {what}", file=sys.stdout)


__all__ = ["wants_dpo", "run_dpo"]
