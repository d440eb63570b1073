"""The ``"ds_mp"`` block of a DeepSpeed JSON: typed dataclasses and every check.

DeepSpeed ignores unknown top-level keys, so ds_mp lives beside ``train_batch_size``,
``optimizer`` and friends in the same file.  :func:`load_config` reads the file (or a
dict) and parses the block into :class:`DsMpConfig` once; :func:`resolve_model_source` is
the one step that reads outside the JSON (a Hub id or directory -> its ``config.json``);
:func:`validate` checks the result against a world size it is given and returns a filled
copy, touching nothing else.  A run calls :func:`load_config` once, on every rank *before* any
collective, so a bad config fails everywhere with the same single line instead of hanging a
job, and hands the result to ``ds_mp.initialize(loaded=...)``.  Every failure is a
:class:`ConfigError` whose message names the key and the fix.
"""
from __future__ import annotations

from ds_mp.config.batching import ramp_micro_multiple
from ds_mp.config.checks import (check_deepspeed_blocks, check_model_family, load_config, read_json, validate,
                                 validate_model)
from ds_mp.config.resolve import resolve_model_source, shape_of
from ds_mp.config.schema import (LLAMA_LORA_TARGETS, LORA_TARGETS, MODEL_TYPES,
                                 BatchRampConfig, ConfigError, ContextParallelConfig, DataConfig, DsMpConfig, InlineModel, LoraConfig,
                                 OuroborosConfig, PipelineConfig, TensorParallelConfig, TeraPipeConfig,
                                 TrainingConfig, parse_config)

__all__ = ["BatchRampConfig", "ConfigError", "ContextParallelConfig", "DataConfig", "DsMpConfig", "InlineModel", "LLAMA_LORA_TARGETS",
           "LORA_TARGETS", "LoraConfig", "MODEL_TYPES", "OuroborosConfig", "PipelineConfig",
           "TensorParallelConfig", "TeraPipeConfig", "TrainingConfig", "check_deepspeed_blocks", "check_model_family",
           "load_config", "parse_config", "ramp_micro_multiple", "read_json", "resolve_model_source", "shape_of",
           "validate", "validate_model"]
