"""``from ds_mp.hf import DPOTrainer``: TRL's ``DPOTrainer`` on ds_mp's TP × PP × DP, by one import.

What stays TRL's: the constructor (by keyword: ``model``, ``ref_model``, ``args`` = a ``trl.DPOConfig``
whose ``deepspeed=`` is the ds_mp JSON, ``train_dataset``, ``eval_dataset``, ``processing_class``,
``peft_config``, …), the dataset preparation (prompt extraction, EOS, chat template, tokenization into
``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``, prompts that fill ``max_length`` dropped) and its
``DataCollatorForPreference`` (``[chosen; rejected]`` rows, ``max_length`` truncation).  What is ds_mp's:

* **The loss** is the ``"dpo"`` loss spec (``ds_mp.losses.dpo``) on the last pipeline stage, its
  options from the DPOConfig (``beta``, ``loss_type``, ``loss_weights``, ``label_smoothing``) written
  into the ``"ds_mp"`` block's ``"loss"``; each TRL batch of ``b`` pairs is one micro-batch of ``2b``
  rows (``ds_mp.hf.preference``), so a pair never leaves its micro-batch.  What the spec does not
  compute (``aot*``, ``use_weighting``, ``ld_alpha``, another ``f_divergence_type``,
  ``sync_ref_model``, ``padding_free``) is refused in one line before any collective; TeraPipe and
  Ouroboros are refused by the spec's own check.
* **The reference log-probs** (ref-pass: a forward-only ``eval_batch`` of the same engine, training
  batch shape, per-row completion log-prob sums read back with ``engine.step_rows()``):
  ``peft_config`` given: the model with its LoRA adapter switched off, per step (or precomputed with
  ``precompute_ref_log_probs=True``); a full fine-tune (or a ``PeftModel`` passed whole): the initial
  weights, precomputed over the train and eval sets once the engine exists (TRL would keep a second
  full copy of the model on every rank instead); ``ref_model`` given: see :mod:`ds_mp.hf.dpo_ref`.
* **Metrics**: ``loss`` and TRL's ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
  ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` come from the last stage's rows, averaged as
  TRL on one process averages them (per micro-batch, then over the micro-batches since the last log);
  ``evaluate()`` returns ``eval_loss`` and the same names with ``eval_``.  TRL's fused-head metrics
  (``entropy``, ``logits/*``, ``mean_token_accuracy``, ``num_tokens``) are not computed.
* **A mixture of experts' aux loss**, as TRL 1.16 adds it: enabled when the model config has
  ``output_router_logits`` (whatever its value) and the coefficient (``DPOConfig.router_aux_loss_coef``,
  else the config's ``router_aux_loss_coef``) is non-zero, i.e. by default for a Qwen3-MoE
  (:func:`router_aux`).  Each micro-batch's loss is then ``dpo_mb + coef · aux_mb``, aux HF's
  load-balancing loss over the micro-batch's ``[chosen; rejected]`` rows (attention-masked), pooled over
  every MoE layer across the pipeline stages by the carry (``ds_mp.models.carry``), and the step's loss
  the mean over its micro-batches and replicas (``aux_reduction = "mean"``); ``aux_loss`` (raw aux, the
  mean over the logged micro-batches) is logged, and an eval step adds ``coef · aux`` of its whole
  forward to its loss, as TRL's.  Disabled (``router_aux_loss_coef=0.0``), no carry is built even where
  the config says ``output_router_logits=True``.  The flag reaches the engine through the model's config
  during the build (:func:`router_aux_config`, restored after: the saved config is the model's); a model
  given by path whose ``config.json`` disagrees is loaded whole on each rank (fp32), as TRL loads it
  (:func:`with_router_aux`).
* ``save_model``, checkpoints and resume are the mixin's (:mod:`ds_mp.hf.mixin`), as on the SFT path.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import trl

from ds_mp.config import ConfigError
from ds_mp.hf import dpo_ref
from ds_mp.hf.lora import peft_model
from ds_mp.hf.mixin import PipelineTrainerMixin
from ds_mp.hf.preference import micro_batch_means, preference_rows, step_stats
from ds_mp.hf.rows import empty_rows


def dpo_refusal(args: Any) -> None:
    """Refuse, in one line naming the ``DPOConfig`` field, what ds_mp's DPO does not compute."""
    from ds_mp.losses.dpo import TRL_ARGS, check_loss_types, refuse_trl_args

    if args is None:
        return
    refuse_trl_args("DPOConfig", **{k: getattr(args, k) for k in TRL_ARGS})
    check_loss_types(args.loss_type, args.loss_weights, "DPOConfig")
    if getattr(args, "activation_offloading", False):
        raise ConfigError("DPOConfig.activation_offloading: TRL's offloading hooks do not reach ds_mp's pipeline "
                          "stages; set activation_offloading=False (gradient_checkpointing is ds_mp's)")


def router_aux(model: Any, args: Any) -> tuple[float, bool]:
    """TRL 1.16's MoE aux loss for ``model`` (an object with a ``config``): (the effective coefficient,
    enabled), as ``trl.DPOTrainer.__init__`` computes them: ``DPOConfig.router_aux_loss_coef``, else the
    model config's ``router_aux_loss_coef`` (0.0 when it has none); enabled when the config has
    ``output_router_logits`` (whatever its value: TRL asks for the router logits per forward) and the
    coefficient is non-zero, e.g. a Qwen3-MoE by default (0.001)."""
    config = getattr(model, "config", None)
    if config is None or args is None:
        return 0.0, False
    text = config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    return float(coef), hasattr(text, "output_router_logits") and coef != 0.0


@contextlib.contextmanager
def router_aux_config(model: Any, enabled: bool, coef: float) -> Iterator[None]:
    """Around the engine's build: ``model``'s config says ``output_router_logits = enabled`` (and, enabled,
    ``router_aux_loss_coef = coef``), so ds_mp builds its carry (``ds_mp.models.carry``) exactly when TRL
    adds the aux term (a config loaded with ``output_router_logits=True`` and coef 0.0 trains without
    it, as TRL).  Restored after: the saved config is the model's, as TRL saves it."""
    text = model.config.get_text_config()
    if not hasattr(text, "output_router_logits"):
        yield
        return
    saved = (text.output_router_logits, getattr(text, "router_aux_loss_coef", None))
    text.output_router_logits = enabled
    if enabled:
        text.router_aux_loss_coef = coef
    try:
        yield
    finally:
        text.output_router_logits = saved[0]
        if enabled:
            text.router_aux_loss_coef = saved[1]


def with_router_aux(model: Any, args: Any) -> tuple[Any, float, bool]:
    """(the model to build, TRL's coefficient, enabled: :func:`router_aux`).  A directory or Hub id (or a
    model on the meta device) whose ``config.json`` disagrees with TRL's flag is loaded with TRL's
    values, as TRL's ``from_pretrained`` loads it (ds_mp's engine reads a directory's own config)."""
    from ds_mp.hf.model_sync import model_and_source

    if model is None or args is None:
        return model, 0.0, False
    obj, source = model_and_source(model)
    coef, enabled = router_aux(obj, args)
    text = obj.config.get_text_config()
    if source is obj or not hasattr(text, "output_router_logits"):
        return model, coef, enabled
    if bool(text.output_router_logits) == enabled and (not enabled or text.router_aux_loss_coef == coef):
        return model, coef, enabled
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), coef, enabled


def loss_block(args: Any) -> dict:
    """The ``"ds_mp"`` block's ``"loss"`` for a ``DPOConfig``.  ``"micro_batch"`` normalisation: a
    step's loss is the mean over its micro-batches (every replica's) of each one's mean over its
    pairs, as TRL's ``per_sequence_loss.mean()`` divided by the accumulation steps on one process."""
    return {"type": "dpo", "normalization": "micro_batch", "beta": float(args.beta), "loss_type": list(args.loss_type),
            "loss_weights": None if args.loss_weights is None else list(args.loss_weights),
            "label_smoothing": float(args.label_smoothing)}


def set_loss_block(args: Any) -> None:
    """Write :func:`loss_block` into ``args``' DeepSpeed JSON, refusing a JSON that names another loss."""
    if args is None or getattr(args, "hf_deepspeed_config", None) is None:
        return  # the mixin refuses it in its own words
    block = args.hf_deepspeed_config.config.setdefault("ds_mp", {})
    want, given = loss_block(args), block.get("loss")
    if given not in (None, {}, want) and given.get("type", "lm") != "dpo":
        raise ConfigError(f"ds_mp.loss={given!r} in the DeepSpeed JSON but DPOTrainer trains the 'dpo' loss; remove "
                          "the \"loss\" block (the DPOConfig sets it)")
    block["loss"] = {**(given or {}), **want}


class DPOTrainer(PipelineTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` whose optimizer step is one ds_mp ``engine.train_batch`` (module docstring)."""

    ds_mp_rows_per_item = 2  # a pair: its chosen and rejected rows
    ds_mp_aux_reduction = "mean"  # TRL: each micro-batch's dpo + coef · aux, divided by the accumulation steps

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 quantization_config: Any = None, peft_config: Any = None) -> None:
        dpo_refusal(args)
        if quantization_config is not None:
            raise ConfigError("quantization_config: ds_mp's TP layers are not quantized; remove it")
        if ref_model is not None and (ref_model is model or isinstance(ref_model, str)):
            raise ConfigError("ref_model: pass a model object other than model= (or omit it: the reference is then "
                              "the initial weights, precomputed)")
        set_loss_block(args)
        model, coef, enabled = with_router_aux(model, args)
        if peft_config is not None:
            model = peft_model(model, args, peft_config)
        # the reference: TRL's, without its second full model on every rank (module docstring)
        self._ds_mp_reference = ("ref_model" if ref_model is not None else
                                 "adapters_off" if peft_config is not None else "initial")
        self._ds_mp_per_step = (self._ds_mp_reference == "adapters_off"
                                and not getattr(args, "precompute_ref_log_probs", False))
        self._ds_mp_stats: dict[str, list[torch.Tensor]] = {"train": [], "aux": []}
        aux = contextlib.nullcontext() if model is None or isinstance(model, str) else \
            router_aux_config(model, enabled, coef)  # a path already says TRL's flag (with_router_aux)
        with dpo_ref.trl_builds_no_reference(args), aux:
            super().__init__(model, None, args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self.precompute_ref_logps = not self._ds_mp_per_step  # TRL's flag: the batches carry the ref log-probs
        self.ref_model = None
        self._ds_mp_ref_engine = dpo_ref.reference_engine(self, ref_model)
        carry = getattr(self.ds_mp_engine.module, "carry", None)
        if carry is not None:  # TRL's aux_loss metric: each training micro-batch's carry recorded
            self.ds_mp_engine.module.loss_fn.record_training = True
        if not self._ds_mp_per_step:
            self.train_dataset = self._ds_mp_precompute(self.train_dataset)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._ds_mp_precompute(d) for k, d in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self._ds_mp_precompute(self.eval_dataset)

    # --- data ---------------------------------------------------------------------------
    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute, called inside its constructor before ds_mp's engine exists: deferred to
        the end of ``__init__`` (:meth:`_ds_mp_precompute`)."""
        return dataset

    def _ds_mp_precompute(self, dataset: Any) -> Any:
        """``dataset`` with ``ref_chosen_logps`` / ``ref_rejected_logps`` columns: the reference's
        completion log-prob sums of every pair (collective; every rank gets every pair's)."""
        return dpo_ref.with_reference_columns(self, dataset)

    def step_micro_batches(self, batches: list[dict]) -> list[dict]:
        """TRL's preference batches as the ``"dpo"`` spec's micro-batches (:mod:`ds_mp.hf.preference`),
        the step filled with micro-batches without a pair."""
        engine = self.ds_mp_engine
        pairs, seq_len = self.args.per_device_train_batch_size, engine.ds_mp_config.data.seq_len
        rows = [preference_rows(b, pairs, seq_len) for b in batches]
        return rows + [empty_rows(rows[0]) for _ in range(engine.micro_batches - len(rows))]

    # --- the step -----------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The mixin's step (one ``engine.train_batch``), the reference log-probs of its pairs first
        when they come per step; then the step's rows for the logged metrics."""
        rows = getattr(inputs, "rows", None)
        if rows is None:
            return torch.zeros((), device=self.args.device)
        if self._ds_mp_per_step:
            dpo_ref.fill_reference(self, rows)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._ds_mp_stats["train"] += step_stats(self.ds_mp_engine.step_rows(), len(rows[0]["labels"]),
                                                 self.beta)
        carries = self.ds_mp_engine.step_carries()
        if carries is not None:
            self._ds_mp_stats["aux"] += dpo_ref.raw_aux(self.ds_mp_engine.module.carry, list(carries.double().cpu()))
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's ``log``; a training log also gets TRL's DPO metrics of the micro-batches since
        the last one (TRL's own ``log`` would add its fused-head metrics, which ds_mp does not compute)."""
        from transformers import Trainer

        if "loss" in logs and self._ds_mp_stats["train"]:
            logs.update(micro_batch_means(self._ds_mp_stats["train"]))
            self._ds_mp_stats["train"] = []
        if "loss" in logs and self._ds_mp_stats["aux"]:  # TRL's mean over the micro-batches since the last log
            logs["aux_loss"] = sum(self._ds_mp_stats["aux"]) / len(self._ds_mp_stats["aux"])
            self._ds_mp_stats["aux"] = []
        Trainer.log(self, logs, start_time)

    # --- evaluation ---------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's ``evaluate``: ``{prefix}_loss`` and ``{prefix}_rewards/…``, ``{prefix}_logps/…`` over
        the whole set as TRL on one process computes them, plus the Trainer's speed metrics.  A raw
        ``eval_dataset`` is prepared as ``__init__`` prepares one (:meth:`_ds_mp_prepare_eval`); a
        ``str`` names one of the trainer's eval sets; a dict is evaluated set by set."""
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            dataset = self.eval_dataset
        else:
            dataset = self._ds_mp_prepare_eval(eval_dataset)
        if dataset is None:
            raise ValueError("evaluate: no eval_dataset; pass one to the Trainer or to evaluate()")
        if isinstance(dataset, dict):
            out: dict = {}
            for name, ds in dataset.items():
                out.update(self._ds_mp_evaluate_set(ds, f"{metric_key_prefix}_{name}"))
            return out
        return self._ds_mp_evaluate_set(dataset, metric_key_prefix)

    def _ds_mp_prepare_eval(self, dataset: Any) -> Any:
        """A dataset passed to ``evaluate()``: tokenized by TRL, its reference log-probs precomputed
        unless they come per step (a full fine-tune's initial weights are gone after training: refused
        then, as TRL refuses it)."""
        if isinstance(dataset, dict):
            return {k: self._ds_mp_prepare_eval(d) for k, d in dataset.items()}
        prepared = self._prepare_dataset(dataset, self.processing_class, self.args, "eval")
        if self._ds_mp_per_step:
            return prepared
        if self._ds_mp_reference == "initial" and self.state.global_step > 0:
            raise ValueError("evaluate: the reference log-probs of a new eval_dataset cannot be computed after "
                             "training has started (the reference is the initial weights, precomputed); pass it as "
                             "eval_dataset at initialization, or pass a ref_model")
        return self._ds_mp_precompute(prepared)

    def _ds_mp_evaluate_set(self, dataset: Any, prefix: str) -> dict:
        import time

        from transformers.trainer_utils import speed_metrics

        self._memory_tracker.start()
        start = time.time()
        values, steps = dpo_ref.evaluate_pairs(self, dataset)
        metrics = {f"{prefix}_{k}": v for k, v in values.items()}
        metrics.update(speed_metrics(prefix, start, num_samples=len(dataset), num_steps=steps))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics


__all__ = ["DPOTrainer", "dpo_refusal", "loss_block", "set_loss_block"]
