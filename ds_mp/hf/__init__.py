"""ds_mp from the Hugging Face Trainer: ``from ds_mp.hf import Trainer`` (``SFTTrainer``, ``DPOTrainer`` for TRL).

    from ds_mp.hf import Trainer            # instead of: from transformers import Trainer
    args = TrainingArguments(..., deepspeed="ds_configs/trainer_tp2_pp2.json")   # carries the "ds_mp" block
    Trainer(model=..., args=args, train_dataset=..., data_collator=...).train()

launched with ``deepspeed --num_gpus N script.py``, ``torchrun --nproc_per_node N script.py`` or
``accelerate launch``; world = TP × PP × DP.  :class:`PipelineTrainerMixin` turns a user's own
Trainer subclass into one (``class MyTrainer(PipelineTrainerMixin, MyBase)``).
"""
from __future__ import annotations

from typing import Any

from transformers import Trainer as _HFTrainer

from ds_mp.deepspeed_compat import skip_shm_comm_unless_asked
from ds_mp.hf.mixin import PipelineTrainerMixin

# Accelerate starts DeepSpeed's comm when the user's TrainingArguments are built, before any Trainer
# exists.  Imported first (as documented), ds_mp.hf keeps DeepSpeed from JIT-building its shm all-reduce
# op at all: no 69 MB workspace per rank even for a moment (Docker's default /dev/shm is 64 MB).  In any
# import order, building the trainer releases a workspace that exists (compat.before_trainer).
skip_shm_comm_unless_asked()


class Trainer(PipelineTrainerMixin, _HFTrainer):
    """``transformers.Trainer`` whose optimizer step is one ds_mp ``engine.train_batch`` (see
    :mod:`ds_mp.hf.mixin` for what changes and :mod:`ds_mp.hf.args` for the argument mapping)."""


def __getattr__(name: str) -> Any:
    if name == "SFTTrainer":  # TRL is an optional extra (ds_mp[trl])
        from ds_mp.hf.sft import SFTTrainer

        return SFTTrainer
    if name == "DPOTrainer":
        from ds_mp.hf.dpo import DPOTrainer

        return DPOTrainer
    raise AttributeError(f"module 'ds_mp.hf' has no attribute {name!r}")


__all__ = ["Trainer", "PipelineTrainerMixin", "SFTTrainer", "DPOTrainer"]
