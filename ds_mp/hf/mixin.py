"""``PipelineTrainerMixin``: a ``transformers.Trainer`` whose optimizer step is ONE ds_mp
``engine.train_batch`` over the step's micro-batches, at any TP × PP × DP and schedule.

Where it plugs into the Trainer (transformers 5.2x), and nowhere else:

* ``__init__``: refuses what cannot apply (:mod:`ds_mp.hf.args`), then builds ds_mp's engine from
  the DeepSpeed JSON of ``TrainingArguments(deepspeed=...)`` (each rank reads only its shard of a
  model named by directory / Hub id or built on the meta device with its ``name_or_path``).
* ``_get_dataloader``: Accelerate's sampler shard keeps its seeded order but is split over the DP
  replicas only (TP and PP peers read their replica's rows): in step t, DP rank d's k-th micro-batch
  is global batch t·GA·DP + k·DP + d — the batches a single process sees, GA·DP per step.
* ``get_batch_samples``: the step's micro-batches, padded to fixed rows (:mod:`ds_mp.hf.rows`); the
  first carries the whole step.  ``training_step`` on it runs ``engine.train_batch`` (forward,
  backward, DP/TP/PP reductions, clipping, optimizer and LR-scheduler step) and returns the global
  per-token loss; on the step's other micro-batches it returns 0.  The Trainer's own
  ``optimizer.step()`` / ``lr_scheduler.step()`` are Accelerate's DeepSpeed no-op wrappers.
* ``_clip_grad_norm`` / ``_get_grad_norm`` / ``_get_learning_rate``: the engine's pre-clip global
  norm and the LR the step used.
* ``evaluate``: per-target-token loss over the whole eval set through ``engine.eval_batch``, read
  ``per_device_eval_batch_size`` rows per eval step (``on_prediction_step`` per step); a MoE's aux term
  pooled per eval step, as HF's model pools it (``_ds_mp_eval_loss``).
* ``save_model``: an HF directory (``from_pretrained`` loads it) + the tokenizer;
  ``_save_optimizer_and_scheduler``: ds_mp's layout-free checkpoint (``<checkpoint>/ds_mp``, with
  the scheduler); ``train(resume_from_checkpoint=...)`` loads it at any layout.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from ds_mp.config import ConfigError
from ds_mp.hf import compat, stop
from ds_mp.hf.args import check_layout, constructor_refusal, deepspeed_dict
from ds_mp.hf.lora import is_peft_model, set_lora_from_peft
from ds_mp.hf.model_sync import model_and_source
from ds_mp.hf.rows import Repeats, empty_rows, fixed_rows, keep_real_rows, step_rows
from ds_mp.hf.schedule import BoundLater, trainer_schedule

#: The tag of ds_mp's layout-free checkpoint inside a Trainer checkpoint directory.
CHECKPOINT_TAG = "ds_mp"


class StepBatch(dict):
    """A micro-batch as the Trainer's loop sees it; the step's first also carries ``rows``, every
    micro-batch of the step in ds_mp's fixed shape (None on the others)."""

    rows: list[dict] | None = None


class PipelineTrainerMixin:
    """Mix into a ``transformers.Trainer`` (subclass) ahead of it: ``class T(PipelineTrainerMixin, Trainer)``.

    The public surface beyond the Trainer's: ``ds_mp_engine`` (the engine), ``ds_mp_topology``
    (TP × PP × DP and this rank's place) and the hook :meth:`step_micro_batches`.
    ``ds_mp_rows_per_item``: the engine's rows per dataset item (a preference pair: 2).
    """

    ds_mp_rows_per_item: int = 1
    #: A mixture of experts' aux loss over a step's micro-batches and replicas (``ds_mp.models.carry``): HF's
    #: Trainer adds each forward's ``coef · aux`` whole ("sum"); TRL's SFTTrainer averages it ("mean").
    ds_mp_aux_reduction = "sum"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Before any constructor runs (a subclass's own refusals included): :func:`compat.before_trainer`
        (one-line refusals under a launcher, /dev/shm released, the private names checked)."""
        compat.before_trainer(cls)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import inspect

        from transformers import Trainer

        base = next(k for k in type(self).__mro__ if issubclass(k, Trainer) and not issubclass(k, PipelineTrainerMixin))
        bound = inspect.signature(base.__init__).bind_partial(None, *args, **kwargs)  # the base Trainer's, by name
        del bound.arguments[next(iter(bound.arguments))]  # self
        given = bound.arguments
        model, source = model_and_source(given.get("model"))
        train_args = given.get("args")
        msg = constructor_refusal(given)
        if msg:
            raise ConfigError(msg)
        if is_peft_model(model):
            set_lora_from_peft(model, train_args)  # ds_mp.lora from the PeftModel's LoraConfig: train the adapter
        if getattr(train_args, "hf_deepspeed_config", None) is not None:
            check_layout(train_args, source, model.config, self.ds_mp_rows_per_item)  # before any collective
        given["model"] = model
        super().__init__(*bound.args, **bound.kwargs)
        raw = deepspeed_dict(self.args, model.config, self.ds_mp_rows_per_item)
        import ds_mp

        engine, _, _, _ = ds_mp.initialize(model=source, config=raw, lr_scheduler=BoundLater)
        engine.use_aux_reduction(self.ds_mp_aux_reduction)
        self.ds_mp_engine = engine
        self.ds_mp_topology = engine.topology
        if compat.process_state_from_torch(self.args):  # logging, progress bar, saving: once per job
            self.state.is_world_process_zero = self.is_world_process_zero()
            self.state.is_local_process_zero = self.is_local_process_zero()
        self._ds_mp_lr: float | None = None
        self._ds_mp_repeats: Repeats | None = None  # the train loader's repeated rows (DP > 1)

    def ds_mp_sync_model(self) -> None:
        """Collective: write the engine's weights into ``trainer.model`` on every rank."""
        from ds_mp.checkpoint.hf import full_state_dict
        from ds_mp.hf.model_sync import broadcast_state, write_back

        engine = self.ds_mp_engine
        tensors = broadcast_state(full_state_dict(engine), engine.device)
        self.model = write_back(self.model, tensors)
        self.callback_handler.model = self.model

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: Any = None,
              **kwargs: Any) -> Any:
        """The Trainer's ``train``; a signal saves a checkpoint and stops every rank, resume picks
        only complete checkpoints (:mod:`ds_mp.hf.stop`); a ``resume_from_checkpoint`` path that holds no
        checkpoint is refused in the Trainer's own words (it would raise a raw FileNotFoundError).  After
        it, ``trainer.model`` holds the trained weights (those of the best checkpoint with
        ``load_best_model_at_end``) on every rank (:mod:`ds_mp.hf.model_sync`)."""
        path = resume_from_checkpoint
        if isinstance(path, (str, os.PathLike)) and not os.path.isdir(path):
            raise ConfigError(f"Can't find a valid checkpoint at {path}")
        out = stop.train(self, super().train, resume_from_checkpoint, trial, ignore_keys_for_eval=ignore_keys_for_eval,
                         **kwargs)
        self.ds_mp_sync_model()
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        stop.save_checkpoint(self, super()._save_checkpoint, model, trial)  # complete under its name, or absent

    def _get_output_dir(self, trial: Any) -> str:
        return stop.staging_root(self) or super()._get_output_dir(trial)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing to move: the Trainer's model may be on the meta device; ds_mp's engine placed its shards."""

    # --- data ---------------------------------------------------------------------------
    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, *a: Any, **kw: Any) -> Any:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ConfigError(f"{description} dataset: an IterableDataset cannot be split over DP replicas by ds_mp.hf; "
                              "pass a map-style dataset (datasets.Dataset, a list)")
        loader = super()._get_dataloader(dataset, description, batch_size, *a, **kw)
        shard, topo = getattr(loader, "batch_sampler", None), self.ds_mp_topology
        if hasattr(shard, "num_processes"):  # Accelerate's BatchSamplerShard: replicas, not processes
            shard.num_processes, shard.process_index = topo.dp, topo.dp_rank
            # with even_batches, Accelerate fills a short last batch with rows from the epoch's start even for
            # one replica (TP/PP only: its shard was built for the world); the plain Trainer on one process
            # has no shard and trains the short batch as it is
            if description == "Training" and keep_real_rows(shard, len(dataset)):
                self._ds_mp_repeats = Repeats(shard, self.args.gradient_accumulation_steps)
        sampler = getattr(getattr(shard, "batch_sampler", shard), "sampler", None)
        if hasattr(sampler, "initial_seed") and self.args.data_seed is None:
            # Accelerate's SeedableRandomSampler seeds its order with torch.initial_seed(): the Trainer's
            # set_seed(args.seed) on one process, but ds_mp reseeds each pipeline stage (seed + 100·stage)
            sampler.initial_seed = self.args.seed
        elif torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1 and topo.dp > 1:
            raise ConfigError(f"{description} dataloader: not sharded by Accelerate's BatchSamplerShard; ds_mp.hf "
                              "cannot split it over DP replicas")
        return loader

    def get_total_train_batch_size(self, args: Any) -> int:
        """Rows per optimizer step over every replica: micro × accumulation × DP (not × world)."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.ds_mp_topology.dp

    def step_micro_batches(self, batches: list[dict]) -> list[dict]:
        """The step's micro-batches as the engine reads them: exactly ``gradient_accumulation_steps``
        dicts of ``(per_device_train_batch_size, ds_mp.data.seq_len)`` tensors (HF keys).  Override
        to re-form another collator's batches (TRL's padding-free rows: ``ds_mp.hf.SFTTrainer``)."""
        engine = self.ds_mp_engine
        if getattr(engine.module, "carry", None) is not None:
            # HF pools every token it is given into a MoE's aux loss (all of them, without a mask): a mask of
            # ones keeps those and masks out only ds_mp's own padding to seq_len
            batches = [_with_mask(b) for b in batches]
        return step_rows(batches, engine.micro_batches, engine.train_micro_batch_size_per_gpu(),
                         engine.ds_mp_config.data.seq_len)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, None]:
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        marked = [StepBatch(b) for b in batches]
        repeats = self._ds_mp_repeats
        keep = repeats.real(epoch_iterator, len(batches), self.state.global_step) if repeats else [True] * len(batches)
        real = [dict(b) for b, k in zip(batches, keep) if k]
        if marked:
            rows = self.step_micro_batches(real or [dict(batches[0])])
            marked[0].rows = rows if real else [empty_rows(r) for r in rows]
        return marked, None  # the engine counts the targets itself (over DP, every schedule)

    # --- the step -----------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        rows = getattr(inputs, "rows", None)
        if rows is None:  # the step's later micro-batches: the first one's train_batch ran them
            return torch.zeros((), device=self.args.device)
        engine = self.ds_mp_engine
        self._ds_mp_lr = float(engine.get_lr()[0])
        loss = engine.train_batch(iter(rows))
        return loss.detach().float().to(self.args.device)

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.ds_mp_engine.get_global_grad_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        norm = self.ds_mp_engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return None if norm is None else float(norm)

    def _get_learning_rate(self) -> float:
        if self._ds_mp_lr is not None:
            return self._ds_mp_lr  # the LR of the last step (the engine stepped the scheduler already)
        return float(self.ds_mp_engine.get_lr()[0])

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> tuple:
        """The engine takes the place of Accelerate's DeepSpeed engine: its scheduler is bound to the
        Trainer's schedule for ``max_steps``; a resume loads ds_mp's checkpoint (any layout)."""
        from accelerate.utils import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper

        engine = self.ds_mp_engine
        engine.lr_scheduler.bind(trainer_schedule(self.args, max_steps))
        self.optimizer = DeepSpeedOptimizerWrapper(engine.optimizer)
        self.lr_scheduler = DeepSpeedSchedulerWrapper(engine.lr_scheduler, self.optimizer)
        self.model_wrapped = self.deepspeed = engine
        if resume_from_checkpoint is not None:
            self._ds_mp_resume(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    # --- evaluation ---------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """``{prefix}_loss``: Σ token losses / Σ targets over the whole eval set (every DP replica
        reads its share, every schedule), plus, for a MoE with its aux loss on, the mean over eval steps of
        HF's ``coef · aux`` of each (:meth:`_ds_mp_eval_loss`); and the Trainer's speed metrics."""
        from transformers.trainer_utils import speed_metrics

        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, dict):
            out: dict = {}
            for name, ds in dataset.items():
                out.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        if dataset is None:
            raise ValueError("evaluate: no eval_dataset; pass one to the Trainer or to evaluate()")
        self._memory_tracker.start()
        start = time.time()
        loss, steps = self._ds_mp_eval_loss(dataset)
        metrics = {f"{metric_key_prefix}_loss": loss}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=len(dataset), num_steps=steps))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics

    def _ds_mp_eval_loss(self, dataset: Any) -> tuple[float, int]:
        """(eval loss, eval steps of this replica).  As the Trainer reads it, an eval step is
        ``per_device_eval_batch_size`` rows; eval step i (in order) goes to DP rank i mod DP and is cut
        into micro-batches of ``per_device_train_batch_size`` rows (the pipeline's fixed shape),
        each collated on its own; each pass evaluates GA micro-batches per replica; passes are
        weighted by their global target counts (``data/validation.py``'s held-out loss): the LM part
        per target token.  A MoE with its aux loss on adds HF's term pooled per eval step, as HF's model
        pools it over the batch it is given: the carries of eval step i's micro-batches summed, then
        ``coef · aux``, averaged over the eval steps as the Trainer's ``evaluation_loop`` averages its
        per-batch losses (each weighted by its rows).  ``on_prediction_step`` fires once per eval step."""
        from torch.utils.data import DataLoader

        from ds_mp.data.validation import PooledAux, pass_weighted_loss

        engine, topo = self.ds_mp_engine, self.ds_mp_topology
        carry = getattr(engine.module, "carry", None)
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="evaluation")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="evaluation")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="evaluation")
        rows, seq = engine.train_micro_batch_size_per_gpu(), engine.ds_mp_config.data.seq_len
        per_step = self.args.per_device_eval_batch_size
        loader = DataLoader(dataset, batch_size=per_step, shuffle=False,
                            collate_fn=lambda feats: [collator(feats[i:i + rows]) for i in range(0, len(feats), rows)])
        sizes = [min(per_step, len(dataset) - i * per_step) for i in range(len(loader))]
        groups = [[i for i in range(d, len(sizes), topo.dp) for _ in range(-(-sizes[i] // rows))] for d in range(topo.dp)]
        mine, template = [], None
        for i, chunks in enumerate(loader):  # every replica collates all (a replica may own no eval step)
            if carry is not None:  # HF pools the tokens its mask keeps: the rows' padding to seq_len is masked
                chunks = [_with_mask(c) for c in chunks]
            fixed = [fixed_rows({k: v.to(engine.device) for k, v in c.items()}, rows, seq) for c in chunks]
            template = fixed[0] if template is None else template
            if i % topo.dp == topo.dp_rank:
                mine += fixed
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        if template is None:
            raise ValueError("evaluate: the eval set is empty; pass an eval_dataset with rows")
        n = engine.micro_batches
        passes = -(-max(len(g) for g in groups) // n)  # the replica that reads the most micro-batches sets the passes
        mine += [empty_rows(template) for _ in range(passes * n - len(mine))]
        aux = None if carry is None else PooledAux(carry, groups, {i: float(b) for i, b in enumerate(sizes)})
        return pass_weighted_loss(engine, iter(mine), passes, n, aux), len(sizes[topo.dp_rank::topo.dp])

    def predict(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError("predict: ds_mp.hf evaluates the loss only (evaluate()); export with save_model() "
                                  "and predict with the HF model")

    # --- saving -------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: an HF model directory in ``output_dir`` (weights + config; the tokenizer
        and ``training_args.bin`` too), which ``from_pretrained`` loads; other files there stay.
        A LoRA run (a PeftModel, or TRL's ``peft_config``) writes PEFT's adapter directory instead
        (``adapter_config.json`` + ``adapter_model.safetensors``), as the plain Trainer does."""
        from transformers.trainer import TRAINING_ARGS_NAME

        from ds_mp.checkpoint.hf import full_state_dict, write_hf_files, write_on_rank0
        from ds_mp.hf.lora import save_adapter

        out = output_dir or self.args.output_dir
        engine = self.ds_mp_engine
        tensors = full_state_dict(engine)
        lora = engine.ds_mp_config.lora.r > 0

        def write() -> None:
            os.makedirs(out, exist_ok=True)
            if lora:
                save_adapter(engine, self.model, tensors, out)
            else:
                write_hf_files(tensors, engine.hf_config, out)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))
        write_on_rank0(engine, f"save_model to {out!r}", write)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """ds_mp's layout-free checkpoint (weights, optimizer moments, LR schedule, counters, every
        rank's RNG streams) in ``<output_dir>/ds_mp``; the Trainer writes its state and RNG beside it."""
        import ds_mp
        from ds_mp.training.parts import rng_parts, save_states

        ds_mp.save_checkpoint(self.ds_mp_engine, output_dir, CHECKPOINT_TAG,
                              client_state=save_states(rng_parts(self.ds_mp_topology)))

    def _save_scaler(self, output_dir: str) -> None:
        """The fp16 loss scale is in ds_mp's checkpoint."""

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's ds_mp state (weights, optimizer, schedule)."""
        self._ds_mp_resume(self.state.best_model_checkpoint)

    def _ds_mp_resume(self, checkpoint: str) -> None:
        """ds_mp's checkpoint in ``checkpoint`` (weights, optimizer, schedule, counters at any layout;
        the RNG streams at the same layout: ``training/parts.py``)."""
        import ds_mp
        from ds_mp.training.parts import load_states, rng_parts

        if not os.path.isdir(os.path.join(checkpoint, CHECKPOINT_TAG)):
            raise ConfigError(f"resume_from_checkpoint: {checkpoint!r} has no {CHECKPOINT_TAG}/ (a ds_mp.hf "
                              "checkpoint); pass a checkpoint-N directory written by ds_mp.hf")
        state = ds_mp.load_checkpoint(self.ds_mp_engine, checkpoint, CHECKPOINT_TAG)
        load_states(rng_parts(self.ds_mp_topology), state)


def _with_mask(batch: dict) -> dict:
    """``batch`` with an ``attention_mask`` of ones where it has none: HF, given no mask, pools every token
    of the batch it is given into a MoE's aux loss; ds_mp's fixed rows then mask their own padding."""
    if "attention_mask" in batch:
        return batch
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}


__all__ = ["PipelineTrainerMixin", "StepBatch", "CHECKPOINT_TAG"]
