"""A DPO run under the launcher: ``"loss": {"type": "dpo", ...}`` with a preference JSONL as ``data.path``.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/dpo.json

``ds_mp.training.loop.main`` hands a run whose loss is ``"dpo"`` here.  The run:

1. reads ``data.path`` (TRL's ``prompt`` / ``chosen`` / ``rejected`` records, plain or
   conversational) and tokenizes it with the model directory's tokenizer as TRL 1.16 does
   (``ds_mp.data.preference``; ``data.seq_len`` is TRL's ``max_length``, ``keep_start``);
2. builds the engine from the model directory (``ds_mp.model`` or ``training.init_from``);
3. precomputes the reference log-probs of every pair the run will read with the initial weights
   (LoRA: the adapters disabled) on the same engine, forward only, with a progress bar on rank 0;
4. trains ``training.steps`` steps (or ``training.epochs`` passes over the pairs), a step's
   ``micro · gas · dp`` rows being ``micro/2`` pairs per micro-batch, each pair in one micro-batch,
   the replicas reading distinct pairs; every ``log_interval`` steps rank 0 prints and appends to
   ``<output_dir>/dpo_log.jsonl`` the loss and TRL's ``rewards/*`` and ``logps/*`` metrics;
5. exports the HF directory to ``<output_dir>/hf`` (``training.export_hf``).

Not in this path (refused in one line where asked for): ``--resume`` and intermediate checkpoints,
validation, a batch ramp.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch

from ds_mp.config import ConfigError, load_config
from ds_mp.data.errors import DataError


def wants_dpo(raw: dict) -> bool:
    """True if the DeepSpeed JSON's ``"ds_mp"`` block picks the ``"dpo"`` loss."""
    loss = raw.get("ds_mp", {}).get("loss", {})
    return isinstance(loss, dict) and loss.get("type") == "dpo"


def run_dpo(raw: dict, resume: Any) -> int:
    """The run (module docstring) on this rank; 0 on success, 2 after a refusal (printed)."""
    try:
        return _run(raw, resume)
    except (ConfigError, DataError) as err:
        print(f"ds_mp: error: {err}", file=sys.stderr)
        return 2


def _checked(raw: dict, resume: Any) -> tuple[Any, str, Any, list]:
    """Every check needing no communication: the config, the model directory, the data."""
    from transformers import AutoTokenizer

    from ds_mp.data.preference import read_preference_jsonl, tokenize_pairs
    from ds_mp.hub import resolve_model

    cfg, raw = load_config(raw, int(os.environ.get("WORLD_SIZE", "1")))
    if resume is not None:
        raise ConfigError("--resume: a DPO run does not checkpoint yet; start it again")
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
    from ds_mp.data.preference import pair_order, pair_rows
    from ds_mp.engine.reference import lora_disabled, ref_log_probs
    from ds_mp.losses.dpo import dpo_metrics

    cfg, model_dir, (pad, dropped), pairs = _checked(raw, resume)
    engine, *_ = ds_mp.initialize(model=model_dir, config=raw, loaded=cfg)
    topo, rank0 = engine.topology, torch.distributed.get_rank() == 0
    b, gas, T = engine.train_micro_batch_size_per_gpu() // 2, engine.gradient_accumulation_steps(), cfg.data.seq_len
    per_step = b * gas * topo.dp
    steps = math.ceil(cfg.training.epochs * len(pairs) / per_step) if cfg.training.epochs else cfg.training.steps
    if rank0:
        print(f"ds_mp: DPO data: {len(pairs)} pairs ({dropped} dropped: prompt fills seq_len), {per_step} pairs a "
              f"step, {steps} steps", flush=True)

    def step_batches(step: int) -> list[dict[str, torch.Tensor]]:
        ids = pair_order(len(pairs), step, b, gas, topo.dp, cfg.data.seed)
        return [pair_rows([pairs[i] for i in ids[k, topo.dp_rank]], T, T, pad) for k in range(gas)]

    refs = []
    with lora_disabled(engine):  # full fine-tune: nothing to disable, the initial weights are the reference
        for step in _progress(range(steps), rank0, "reference log-probs"):
            refs.append(ref_log_probs(engine, step_batches(step)).cpu())
    log = os.path.join(cfg.training.output_dir, "dpo_log.jsonl")
    if rank0:
        os.makedirs(cfg.training.output_dir, exist_ok=True)
        open(log, "w").close()
    for step in range(steps):
        fed = [{**mb, "ref_logps": r} for mb, r in zip(step_batches(step), refs[step].split(2 * b))]
        loss = float(engine.train_batch(iter(fed)))
        metrics = dpo_metrics(engine.step_rows(), engine.module.loss_spec.beta)
        if rank0 and ((step + 1) % max(cfg.training.log_interval, 1) == 0 or step + 1 == steps):
            line = json.dumps({"step": step + 1, "loss": loss, **metrics})
            print(f"ds_mp: {line}", flush=True)
            with open(log, "a") as fh:
                fh.write(line + "\n")
    if cfg.training.export_hf:
        ds_mp.save_hf(engine, os.path.join(cfg.training.output_dir, "hf"), tokenizer_dir=model_dir)
    return 0


def _progress(items: Any, show: bool, what: str) -> Any:
    """``items`` with a progress bar on rank 0."""
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"ds_mp: {what}", file=sys.stdout)


__all__ = ["wants_dpo", "run_dpo"]
