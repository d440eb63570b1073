"""ds_mp: tensor parallelism, TeraPipe and Ouroboros for Hugging Face GPT-2 (and Llama, Qwen2,
Mistral, Qwen3, Gemma 3: ``ds_mp.models``) on DeepSpeed.

``engine, optimizer, dataloader, lr_scheduler = ds_mp.initialize(model=..., config=...)``
mirrors ``deepspeed.initialize``; everything ds_mp does is read from the ``"ds_mp"``
block of the same DeepSpeed JSON.
"""
from __future__ import annotations

from ds_mp.launcher_guard import arm as _arm_launcher_guard

_arm_launcher_guard()  # first: a rank of DeepSpeed's launch.py never outlives it (before torch is imported)

from ds_mp.config import ConfigError, DsMpConfig, load_config
from ds_mp.config.registry import SCHEDULES, register_schedule

__version__ = "0.1.0"

__all__ = ["initialize", "ConfigError", "DsMpConfig", "load_config", "SCHEDULES", "register_schedule",
           "save_hf", "save_lora", "save_checkpoint", "load_checkpoint", "__version__"]


def initialize(model=None, config=None, training_data=None, args=None, optimizer=None, lr_scheduler=None,
               loaded=None):
    """Build the parallel model (GPT-2, Llama, Qwen2, Mistral, Qwen3, Gemma 3) and DeepSpeed's engine for it.

    Args:
        model: an HF ``…ForCausalLM`` of a family ds_mp knows, an HF checkpoint directory, or None (use
            ``ds_mp.model`` from the config: a directory or an inline shape).
        config: path or dict of the DeepSpeed JSON (default: ``args.deepspeed_config``).
        training_data, args, optimizer, lr_scheduler: as in ``deepspeed.initialize``.
        loaded: the ``DsMpConfig`` that ``load_config`` already returned for ``config`` (a run parses
            and validates its config once; None: ``initialize`` loads it).

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``; ``engine.train_batch(it)``
    takes an iterator of ``(input_ids, labels)`` pairs ``[micro_batch, seq]`` and
    returns the mean loss of the global batch.
    """
    from ds_mp.engine.initialize import build_engine
    from ds_mp.launcher_guard import engine_built

    built = build_engine(model=model, config=config, training_data=training_data, args=args,
                         optimizer=optimizer, lr_scheduler=lr_scheduler, loaded=loaded)
    engine_built()  # a signal the launcher guard still handles now ends a script's loop, not its start-up
    return built


def save_hf(engine, out_dir: str, tokenizer_dir: str | None = None) -> None:
    """Collective: every rank calls it; rank 0 writes a complete HF model directory."""
    from ds_mp.checkpoint.hf import save_hf as _save_hf

    _save_hf(engine, out_dir, tokenizer_dir=tokenizer_dir)


def save_lora(engine, out_dir: str, merge: bool = False, tokenizer_dir: str | None = None,
              base_model: str | None = None) -> None:
    """Collective: rank 0 writes the LoRA adapter in PEFT's format (``adapter_config.json`` +
    ``adapter_model.safetensors``), or with ``merge`` the merged HF model directory."""
    from ds_mp.checkpoint.lora import save_lora as _save_lora

    _save_lora(engine, out_dir, merge=merge, tokenizer_dir=tokenizer_dir, base_model=base_model)


def save_checkpoint(engine, ckpt_root: str, tag: str, client_state: dict | None = None) -> str:
    """Collective: write the layout-free training checkpoint ``<ckpt_root>/<tag>`` (weights,
    optimizer state, LR schedule, counters, loss scale, in-flight schedule work, ``client_state``)
    and point ``<ckpt_root>/latest`` at it; it resumes at any TP × PP × DP.  Returns its path.
    ``engine.save_checkpoint(dir, tag)`` (DeepSpeed's name) writes the same."""
    from ds_mp.checkpoint.training import save_checkpoint as _save

    return _save(engine, ckpt_root, tag, client_state=client_state)


def load_checkpoint(engine, ckpt_root: str, tag: str | None = None) -> dict:
    """Collective: resume ``engine`` from ``<ckpt_root>/<tag>`` (default: ``latest``), saved at
    any layout; returns the saved ``client_state``."""
    from ds_mp.checkpoint.training import load_checkpoint as _load

    return _load(engine, ckpt_root, tag)
