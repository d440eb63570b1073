"""The ``"ds_mp"`` block of a DeepSpeed JSON: typed dataclasses and every check.

DeepSpeed ignores unknown top-level keys, so ds_mp lives beside ``train_batch_size``,
``optimizer`` and friends in the same file.  :func:`load_config` reads the file (or a
dict), parses the block into :class:`DsMpConfig`, and validates it against the world
size.  It runs on every rank *before* any collective, so a bad config fails everywhere
with the same single line instead of hanging a job.  Every failure is a
:class:`ConfigError` whose message names the key and the fix.
"""
from __future__ import annotations

from ds_mp.config.batching import ramp_micro_multiple
from ds_mp.config.checks import check_model_family, load_config, read_json, shape_of, validate
from ds_mp.config.schema import (LLAMA_LORA_TARGETS, LORA_TARGETS, MODEL_TYPES,
                                 BatchRampConfig, ConfigError, DataConfig, DsMpConfig, InlineModel, LoraConfig,
                                 OuroborosConfig, PipelineConfig, TensorParallelConfig, TeraPipeConfig,
                                 TrainingConfig, parse_config)

__all__ = ["BatchRampConfig", "ConfigError", "DataConfig", "DsMpConfig", "InlineModel", "LLAMA_LORA_TARGETS",
           "LORA_TARGETS", "LoraConfig", "MODEL_TYPES", "OuroborosConfig", "PipelineConfig",
           "TensorParallelConfig", "TeraPipeConfig", "TrainingConfig", "check_model_family", "load_config",
           "parse_config", "ramp_micro_multiple", "read_json", "shape_of", "validate"]
