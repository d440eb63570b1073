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
from ds_mp.hf.lora import lora_block, peft_model
from ds_mp.hf.mixin import PipelineTrainerMixin


class FixedRowsCollator:
    """``collator``'s padding-free batches re-formed into ``(rows, seq_len)`` rows; other batches
    pass unchanged (the mixin pads them)."""

    def __init__(self, collator: Any, rows: int, seq_len: int, pad_id: int) -> None:
        self.collator, self.rows, self.seq_len, self.pad_id = collator, rows, seq_len, pad_id

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        return unflatten(batch, self.rows, self.seq_len, self.pad_id) if is_flattened(batch) else batch


class SFTTrainer(PipelineTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose optimizer step is one ds_mp ``engine.train_batch`` (module docstring).
    Arguments as TRL's; ``TrainingArguments(deepspeed=...)`` carries the ``"ds_mp"`` block."""

    ds_mp_aux_reduction = "mean"  # TRL divides its weighted_aux_loss by the accumulation steps

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None, formatting_func: Any = None) -> None:
        if quantization_config is not None:
            raise ConfigError("quantization_config: ds_mp's TP layers are not quantized; remove it")
        if args is not None and getattr(args, "loss_type", "nll") != "nll":
            raise ConfigError(f"loss_type={args.loss_type!r}: ds_mp's loss is the per-token NLL; set loss_type='nll'")
        if args is not None and getattr(args, "activation_offloading", False):
            raise ConfigError("activation_offloading: TRL's offloading hooks do not reach ds_mp's pipeline stages; set "
                              "activation_offloading=False (gradient_checkpointing is ds_mp's activation checkpointing)")
        if peft_config is not None:
            model = self._ds_mp_peft_model(model, args, peft_config)
        super().__init__(model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, formatting_func=formatting_func)
        engine = self.ds_mp_engine
        self.data_collator = FixedRowsCollator(self.data_collator, engine.train_micro_batch_size_per_gpu(),
                                               engine.ds_mp_config.data.seq_len, self._tokenizer.pad_token_id or 0)

    @staticmethod
    def _ds_mp_peft_model(model: Any, args: Any, peft_config: Any) -> Any:
        """The PEFT model TRL would build (:func:`ds_mp.hf.lora.peft_model`)."""
        return peft_model(model, args, peft_config)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's ``evaluate``: a raw text, chat or prompt/completion ``eval_dataset`` is prepared as
        ``__init__`` prepares one (tokenized, packed if ``eval_packing``), then the mixin's loss."""
        if not self._skip_prepare_dataset and eval_dataset is not None and not isinstance(eval_dataset, str):
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing

            def prepare(dataset: Any, name: str) -> Any:
                return self._prepare_dataset(dataset, self.processing_class, self.args, packing,
                                             self._formatting_func, name)
            eval_dataset = ({k: prepare(d, k) for k, d in eval_dataset.items()} if isinstance(eval_dataset, dict)
                            else prepare(eval_dataset, "eval"))
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)


__all__ = ["SFTTrainer", "FixedRowsCollator", "lora_block"]
