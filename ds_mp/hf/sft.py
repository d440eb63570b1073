"""``from ds_mp.hf import SFTTrainer``: TRL's ``SFTTrainer`` on ds_mp's TP × PP × DP, by one import.

Everything TRL does before training stays TRL's: ``messages`` and prompt/completion datasets through
the tokenizer's chat template, ``assistant_only_loss`` / ``completion_only_loss`` as -100 labels,
``max_length`` truncation, ``packing=True`` (best-fit, padding-free).  The optimizer step is the
mixin's (:mod:`ds_mp.hf.mixin`: one ``engine.train_batch`` over the step's micro-batches).  What this
class adds:

* **Padding-free micro-batches → fixed rows.**  With ``packing=True`` (or ``padding_free=True``)
  TRL's collator emits each micro-batch as ONE flattened row ``(1, T)``, ``T`` varying.  The collator
  is wrapped so that every batch comes out as ``(per_device_train_batch_size, ds_mp.data.seq_len)``
  rows (:func:`ds_mp.data.flatten.unflatten`: documents split at their boundaries, in order,
  next-fit; each document keeps its positions 0 … n-1; padding documents with labels -100), which
  ds_mp's packed-document attention runs exactly as HF runs each document alone.  ``seq_len``
  defaults to ``max_length`` (:mod:`ds_mp.hf.args`), so every micro-batch TRL packs fits.
* **``peft_config``** (a PEFT ``LoraConfig``): PEFT wraps the model as TRL would (same seed, same
  initial factors); ds_mp's LoRA under TP × PP (``ds_mp.lora`` from the config) reads those factors;
  ``save_model()`` writes a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads.  What ds_mp's LoRA does not
  compute (DoRA, rsLoRA, bias training, ``modules_to_save``, per-layer patterns) is refused.
* TRL's token metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) come from its fused LM
  head, which ds_mp's pipeline does not run: they are not logged; ``loss``, ``grad_norm``,
  ``learning_rate`` and ``eval_loss`` are (the global per-token means).
"""
from __future__ import annotations

from typing import Any

import trl

from ds_mp.config import ConfigError
from ds_mp.data.flatten import is_flattened, unflatten
from ds_mp.hf.mixin import PipelineTrainerMixin


class FixedRowsCollator:
    """``collator``'s padding-free batches re-formed into ``(rows, seq_len)`` rows; other batches
    pass unchanged (the mixin pads them)."""

    def __init__(self, collator: Any, rows: int, seq_len: int, pad_id: int) -> None:
        self.collator, self.rows, self.seq_len, self.pad_id = collator, rows, seq_len, pad_id

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        return unflatten(batch, self.rows, self.seq_len, self.pad_id) if is_flattened(batch) else batch


def lora_block(peft_config: Any) -> dict:
    """``ds_mp.lora`` for a PEFT ``LoraConfig``, or a one-line refusal naming the field."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config: {type(peft_config).__name__} is not supported by ds_mp (LoRA only); pass a "
                          "peft.LoraConfig")
    targets = peft_config.target_modules
    bad = [
        (not isinstance(targets, (list, set, tuple)), f"target_modules={targets!r}: name the modules as a list "
         "(e.g. ['q_proj', 'v_proj'])"),
        (peft_config.use_dora, "use_dora=True: ds_mp's LoRA has no DoRA magnitude; set use_dora=False"),
        (peft_config.use_rslora, "use_rslora=True: ds_mp scales by lora_alpha / r; set use_rslora=False"),
        (peft_config.bias != "none", f"bias={peft_config.bias!r}: ds_mp's LoRA trains the factors only; set "
         "bias='none'"),
        (peft_config.modules_to_save, f"modules_to_save={peft_config.modules_to_save!r}: not trained by ds_mp's "
         "LoRA; remove it"),
        (peft_config.rank_pattern or peft_config.alpha_pattern, "rank_pattern/alpha_pattern: ds_mp's LoRA has one "
         "r and alpha; remove them"),
        (peft_config.layers_to_transform is not None, "layers_to_transform: ds_mp adapts every layer; remove it"),
    ]
    msg = next((m for b, m in bad if b), None)
    if msg:
        raise ConfigError(f"peft_config: {msg}")
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": float(peft_config.lora_dropout),
            "target_modules": sorted(targets)}


class SFTTrainer(PipelineTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose optimizer step is one ds_mp ``engine.train_batch`` (module docstring).
    Arguments as TRL's; ``TrainingArguments(deepspeed=...)`` carries the ``"ds_mp"`` block."""

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None, formatting_func: Any = None) -> None:
        refused = [(compute_loss_func, "compute_loss_func: ds_mp's loss is the per-token cross-entropy; remove it"),
                   (optimizer_cls_and_kwargs, "optimizer_cls_and_kwargs: ds_mp builds the optimizer from optim; "
                    "remove it"),
                   (quantization_config, "quantization_config: ds_mp's TP layers are not quantized; remove it")]
        msg = next((m for bad, m in refused if bad is not None), None)
        if msg:
            raise ConfigError(msg)
        if args is not None and getattr(args, "loss_type", "nll") != "nll":
            raise ConfigError(f"loss_type={args.loss_type!r}: ds_mp's loss is the per-token NLL; set loss_type='nll'")
        if args is not None and getattr(args, "activation_offloading", False):
            raise ConfigError("activation_offloading: TRL's offloading hooks do not reach ds_mp's pipeline stages; set "
                              "activation_offloading=False (gradient_checkpointing is ds_mp's activation checkpointing)")
        self._ds_mp_lora = peft_config is not None
        if peft_config is not None:
            model = self._ds_mp_peft_model(model, args, peft_config)
        super().__init__(model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, compute_metrics=compute_metrics,
                         callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, formatting_func=formatting_func)
        engine = self.ds_mp_engine
        self.data_collator = FixedRowsCollator(self.data_collator, engine.train_micro_batch_size_per_gpu(),
                                               engine.ds_mp_config.data.seq_len, self._tokenizer.pad_token_id or 0)

    @staticmethod
    def _ds_mp_peft_model(model: Any, args: Any, peft_config: Any) -> Any:
        """The PEFT model TRL would build (seeded by ``args.seed`` as TRL seeds it), with ``ds_mp.lora``
        set in the DeepSpeed JSON so that the engine trains those factors."""
        from peft import get_peft_model
        from transformers import set_seed

        if args is None or getattr(args, "hf_deepspeed_config", None) is None:
            raise ConfigError("TrainingArguments.deepspeed: ds_mp.hf needs a DeepSpeed JSON (path or dict) with a "
                              "\"ds_mp\" block; pass deepspeed=... (e.g. ds_configs/trainer_tp2_pp2.json)")
        if isinstance(model, str):
            raise ConfigError("model: with peft_config, pass the model object (AutoModelForCausalLM.from_pretrained); "
                              "ds_mp reads the LoRA factors from the PEFT model")
        block = lora_block(peft_config)
        raw = args.hf_deepspeed_config.config.setdefault("ds_mp", {})
        if raw.get("lora") not in (None, {}, block):
            raise ConfigError(f"ds_mp.lora={raw['lora']!r} in the DeepSpeed JSON but peft_config gives {block}; "
                              "remove one")
        raw["lora"] = block
        set_seed(args.seed)  # as trl.SFTTrainer.__init__ does before get_peft_model
        return get_peft_model(model, peft_config)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective.  With ``peft_config``: the PEFT adapter directory (+ tokenizer); else the HF
        model directory (the mixin's)."""
        if not self._ds_mp_lora:
            return super().save_model(output_dir, _internal_call)
        import json
        import os

        import torch
        from safetensors.torch import save_file
        from transformers.trainer import TRAINING_ARGS_NAME

        from ds_mp.checkpoint.hf import full_state_dict, write_on_rank0
        from ds_mp.checkpoint.lora import adapter_config, peft_adapter_tensors

        out, engine = output_dir or self.args.output_dir, self.ds_mp_engine
        base = getattr(self.model.get_base_model().config, "_name_or_path", None) or None
        tensors = full_state_dict(engine)

        def write() -> None:  # beside what out holds already (checkpoints, the model card)
            os.makedirs(out, exist_ok=True)
            save_file(peft_adapter_tensors(tensors), os.path.join(out, "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            with open(os.path.join(out, "adapter_config.json"), "w") as f:
                json.dump(adapter_config(engine.ds_mp_config.lora, base, engine.module.family.fan_in_fan_out), f,
                          indent=2)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))
        write_on_rank0(engine, f"save_model to {out!r}", write)

__all__ = ["SFTTrainer", "FixedRowsCollator", "lora_block"]
