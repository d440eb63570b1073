"""The ``"ds_mp"`` block's schema: one dataclass per section, each field with its default and a
``# comment`` (docs/config.md is generated from them), and the type-checking parser
:func:`parse_config`.  The checks that need the world size or the model live in
:mod:`ds_mp.config.checks`."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

from ds_mp.config.families import FAMILIES
from ds_mp.context_parallel.rules import DEFAULT_IMPL


class ConfigError(ValueError):
    """A ds_mp configuration problem; the message is one line naming the key and the fix."""


def positive(value: int, key: str) -> None:
    """Refuse ``ds_mp.<key>`` below 1."""
    if value < 1:
        raise ConfigError(f"ds_mp.{key}: must be >= 1, got {value}")


@dataclass
class InlineModel:
    """A model shape for training from scratch: GPT-2's (fields as in ``transformers.GPT2Config``),
    or with ``model_type`` another registered decoder (its fields below; the family turns the shape into
    its ``config.json`` keys, ``Family.inline_hf``, and HF's defaults fill the rest)."""

    n_layer: int = 4  # transformer blocks
    n_embd: int = 128  # hidden size
    n_head: int = 4  # attention heads
    vocab_size: int = 8192  # true vocabulary size (padding is added for TP, never exported)
    n_positions: int = 1024  # maximum sequence length
    dropout: float = 0.0  # resid/embd/attn dropout probability (Llama family: attention_dropout)
    model_type: str = "gpt2"  # "gpt2", or another registered decoder: "llama", "qwen2", "mistral", "qwen3", "gemma3_text"
    n_kv_head: int = 0  # not GPT-2: key/value heads of grouped-query attention (0 = n_head)
    intermediate_size: int = 0  # not GPT-2: gated MLP width (0 = 4 × n_embd)
    tie_word_embeddings: bool = True  # not GPT-2: the LM head is the embedding (false: its own weight)


@dataclass
class TensorParallelConfig:
    size: int = 1  # TP degree; must divide n_head
    sequence_parallel: bool = False  # shard LayerNorm/dropout regions along the sequence
    vocab_pad_multiple: int = 128  # vocab is padded to a multiple of this × size
    overlap_comm: bool = True  # backward: all-reduce dX of column-parallel layers while computing dW


@dataclass
class ContextParallelConfig:
    size: int = 1  # CP degree C: each rank holds seq_len/C tokens of every micro-batch (1 = off)
    # "allgather": K/V all-gathered over the CP group, zigzag-balanced causal work, any head count (default:
    # the one that takes every model); "ulysses": all-to-all to a head split, heads divisible by TP × C
    impl: str = DEFAULT_IMPL


@dataclass
class PipelineConfig:
    stages: int = 1  # PP degree (number of pipeline stages)
    schedule: str = "1f1b"  # a name registered in ds_mp.SCHEDULES
    partition: Union[str, list] = "uniform"  # "uniform" | "parameters" | "cost" (measured) | [blocks per stage]
    activation_checkpoint_interval: int = 0  # checkpoint every N pipeline layers (0 = off)
    virtual_stages: int = 1  # "interleaved": chunks of blocks per stage (stage s holds chunks s, s+stages, …)
    zb_max_pending_w: Union[str, int] = "auto"  # "zb-h1": W passes stage s defers: "auto" s//2 (within 1F1B's memory), "paper" s, or int n: min(s, n); "zb-v": "auto" (W deferral bounded within 1F1B's memory) or "paper" (unbounded)


@dataclass
class TeraPipeConfig:
    slices: Union[str, list] = "auto"  # "auto" (planner) or token lengths summing to seq_len
    batch_slices: Union[int, str] = 1  # equal batch-slices per micro-batch, or "auto" (knapsack over sizes)
    granularity: int = 8  # planner slice lengths are multiples of this
    profile: str = ""  # cost-model JSON to reuse ("" = <output_dir>/terapipe_profile.json)
    order: str = "gpipe"  # "gpipe" (all slice forwards, then all backwards) or "1f1b" (activations bounded by stages)

    def validate(self, seq_len: int) -> None:
        """The block's own values (checked whatever the schedule): slices, batch slices, order."""
        bs = self.batch_slices
        if bs == "auto":
            if self.slices != "auto":
                raise ConfigError("ds_mp.terapipe.batch_slices: 'auto' chooses the batch split together with the "
                                  "token slices; set terapipe.slices to 'auto' too, or give batch_slices a number")
        elif isinstance(bs, str):
            raise ConfigError(f"ds_mp.terapipe.batch_slices: {bs!r} is not a positive integer or 'auto'")
        else:
            positive(bs, "terapipe.batch_slices")
        sl = self.slices
        if isinstance(sl, list):
            if not sl or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sl):
                raise ConfigError(f"ds_mp.terapipe.slices: expected positive integers, got {sl}")
            if sum(sl) != seq_len:
                raise ConfigError(f"ds_mp.terapipe.slices: {sl} sums to {sum(sl)} but data.seq_len "
                                  f"is {seq_len}; make the slices sum to {seq_len}")
        elif sl != "auto":
            raise ConfigError(f"ds_mp.terapipe.slices: {sl!r} is not 'auto' or a list of lengths")
        if self.order not in ("gpipe", "1f1b"):
            raise ConfigError(f"ds_mp.terapipe.order: {self.order!r} is not 'gpipe' (all slice forwards, then "
                              "all backwards) or '1f1b' (each sequence's slices backwarded as soon as possible)")


@dataclass
class OuroborosConfig:
    modules: int = 0  # K modules on K-1 ranks (0 = pipeline.stages + 1)
    delay: bool = True  # False reduces to synchronous backprop (for testing)
    split: Union[str, list] = "balanced"  # "balanced" (rank costs, head included), "equal" (paper), [blocks per module]
    # replay delayed modules with the "current" weights or the "stashed" ones, or "none": keep the forward's
    # graph (activations) until its delayed backward, the maths of "stashed" without the replay's forward
    recompute: str = "current"
    repeat_dropout: bool = True  # the replay applies its forward's dropout masks (False: fresh masks, an ablation)


@dataclass
class DataConfig:
    path: str = ""  # prepared dataset dir (ds-mp prepare-data); "" = embedded stdlib corpus
    seq_len: int = 128  # tokens per sample
    vocab_size: int = 8192  # tokenizer vocab for the embedded default corpus
    seed: int = 1234  # shuffle seed
    cache_dir: str = ""  # default corpus; token-id stats of read-only datasets ("" = ~/.cache/ds_mp)
    packing: bool = True  # SFT datasets: pack documents into rows (best-fit decreasing); false = one per row, padded
    overlong: str = "truncate"  # SFT documents longer than seq_len: "truncate" (keep the first seq_len tokens) or "drop"
    val_path: str = ""  # SFT: a held-out records file (.jsonl/.parquet/.arrow) to validate on ("" = the dataset's val split)


@dataclass
class TrainingConfig:
    steps: int = 100  # optimizer steps
    epochs: float = 0.0  # > 0: train this many passes over the training rows (steps derived; overrides steps)
    log_interval: int = 10  # steps between log lines / CSV rows
    eval_interval: int = 50  # steps between validation passes (0 = off)
    eval_batches: int = 0  # validation reads the whole held-out split (0), or its first N passes of GA micro-batches
    checkpoint_interval: int = 50  # steps between checkpoints (0 = only at the end)
    output_dir: str = "runs/ds_mp"  # checkpoints, logs, exported model
    seed: int = 1234  # model init / dropout seed
    on_nan: str = "stop"  # "stop" (save diagnostics, exit) or "skip" the step
    max_consecutive_skips: int = 10  # on_nan "skip": stop after this many skipped steps in a row (0 = no limit)
    init_from: str = ""  # HF dir or ds_mp checkpoint to initialise weights from
    export_hf: bool = True  # write an HF directory at the end of training
    noise_scale_interval: int = 0  # steps between gradient-noise-scale measurements (0 = off; needs DP > 1)
    trace_steps: list = field(default_factory=list)  # [first, last]: record a timeline of these steps ([] = off)
    keep_last: int = 0  # keep the newest N stepN checkpoints, delete older ones after each save (0 = keep all)
    save_on_signal: bool = True  # on SIGTERM/SIGINT (or the launcher gone): finish the step, save, then exit


#: Views of the family registry (ds_mp.config.families, the one table; this module imports no model):
#: HF model_type -> the PEFT-style LoRA target names its family accepts.
MODEL_TYPES: dict[str, tuple[str, ...]] = {t: e.lora_targets for t, e in FAMILIES.items()}
LORA_TARGETS, LLAMA_LORA_TARGETS = FAMILIES["gpt2"].lora_targets, FAMILIES["llama"].lora_targets


@dataclass
class LoraConfig:
    r: int = 0  # rank of the low-rank update (0 = LoRA off: full fine-tuning)
    alpha: float = 16.0  # scaling = alpha / r (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the LoRA branch's input (PEFT's lora_dropout)
    # layers to adapt, PEFT-style names: c_attn, c_fc, c_proj (= attn.c_proj + mlp.c_proj), attn.c_proj, mlp.c_proj
    target_modules: list = field(default_factory=lambda: ["c_attn", "c_proj", "c_fc"])
    # fused parameters to adapt (PEFT's target_parameters; LoRA dropout must be 0): a mixture of experts'
    # mlp.experts.gate_up_proj and mlp.experts.down_proj (ΔW_e = alpha/r · B_e A_e per expert); [] = none
    target_parameters: list = field(default_factory=list)


@dataclass
class BatchRampConfig:
    policy: str = ""  # "" (off: the JSON's fixed batch), "linear" (start -> max over ramp_samples) or "noise_scale"
    start: int = 0  # first global batch in samples (a multiple of micro-batch × DP)
    max: int = 0  # largest global batch in samples (a multiple of micro-batch × DP)
    ramp_samples: int = 0  # "linear": samples consumed while the batch grows from start to max
    interval: int = 10  # optimizer steps between batch decisions (noise_scale: from the smoothed B_simple)
    lr_scaling: str = "none"  # LR × (batch / start)^p as the batch grows: "none" (p=0), "sqrt" (1/2), "linear" (1)


@dataclass
class LossConfig:
    # the loss's registered name (ds_mp.config.losses: "lm", HF's per-token causal-LM loss; "dpo", TRL's DPO
    # loss, whose options beta, loss_type, loss_weights, label_smoothing sit beside type: docs/dpo.md; a user's
    # register_loss adds more); its spec (ds_mp.losses.spec) states the normalisation below
    type: str = "lm"
    # "tokens": a step's loss is the sum of its token losses over every micro-batch and DP replica / the
    # global batch's target count (HF's and Megatron's per-token loss); "micro_batch": DeepSpeed's mean of
    # micro-batch means (each divided by its own count; equal to "tokens" when every row is all targets)
    normalization: str = "tokens"
    # every other key of the block: the spec's own options (DPO's "beta", "loss_type", ...), checked by
    # the spec at load_config (LossSpec.with_options: an unknown key or a bad value refused in one line)
    options: dict = field(default_factory=dict, repr=False)
    OPEN = True  # _parse: unknown keys go to ``options`` instead of being refused


@dataclass
class MoeConfig:
    # mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe) under TP: "whole" (each TP rank holds
    # E/TP whole experts; E must divide by TP) or "split" (each expert's intermediate dimension cut over
    # TP like the dense MLP); docs/models.md says which is faster and why it is the default
    expert_layout: str = "whole"


@dataclass
class DsMpConfig:
    model: Union[str, InlineModel] = field(default_factory=InlineModel)  # HF dir, Hub id, or inline shape
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    terapipe: TeraPipeConfig = field(default_factory=TeraPipeConfig)
    ouroboros: OuroborosConfig = field(default_factory=OuroborosConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    # Filled by validate(): the degrees and the model shape actually used (a copy: the input is not changed).
    world_size: int = field(default=1, repr=False)
    dp: int = field(default=1, repr=False)
    shape: InlineModel | None = field(default=None, repr=False)
    hf_config: dict = field(default_factory=dict, repr=False)  # the model's HF config.json ({} for an inline shape)
    # Filled by resolve_model_source(): where hf_config was read ("" = the inline shape is the model's)
    model_source: str = field(default="", repr=False)

    @property
    def tp(self) -> int:
        return self.tensor_parallel.size

    @property
    def pp(self) -> int:
        return self.pipeline.stages

    @property
    def cp(self) -> int:
        """The context-parallel degree C; ``dp`` = world / (TP × PP × CP) counts the ranks that read
        distinct rows (CP peers read the same rows)."""
        return self.context_parallel.size


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` coerced to ``tp`` or raise ConfigError naming ``key``."""
    origin = get_origin(tp)
    if origin is Union:
        for option in get_args(tp):
            if option is type(None) and value is None:
                return value
            try:
                return _check_type(value, option, key)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in get_args(tp))
        raise ConfigError(f"ds_mp.{key}: expected {names}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"ds_mp.{key}: expected an object {{...}}, got {value!r}")
        return _parse(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"ds_mp.{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"ds_mp.{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"ds_mp.{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"ds_mp.{key}: expected a string, got {value!r}")
        return value
    if tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"ds_mp.{key}: expected a list, got {value!r}")
        return value
    return value


def _parse(cls: type, raw: dict, prefix: str) -> Any:
    hints = get_type_hints(cls)
    public = [f.name for f in dataclasses.fields(cls) if f.repr]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in public and getattr(cls, "OPEN", False):  # a block whose owner checks the rest
            kwargs.setdefault("options", {})[key] = value
            continue
        if key not in public:
            close = difflib.get_close_matches(key, public, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(public)}"
            raise ConfigError(f"ds_mp.{path}: unknown key; {hint}")
        kwargs[key] = _check_type(value, hints[key], path)
    return cls(**kwargs)


def parse_config(raw: dict) -> DsMpConfig:
    """Parse the ``"ds_mp"`` block (types and key names only; see :func:`validate`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"ds_mp: expected an object {{...}}, got {raw!r}")
    return _parse(DsMpConfig, raw, "")

