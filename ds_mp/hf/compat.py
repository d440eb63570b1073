"""Every private transformers / TRL / Accelerate name ds_mp.hf relies on, with why; and the one door
through which ds_mp.hf writes into their state.

The Trainer integration plugs into private ``transformers.Trainer`` hooks (``_get_dataloader``,
``_prepare_for_training``, ...), reads private state (``_memory_tracker``, ``_train_batch_size``,
TRL's ``_tokenizer``) and corrects Accelerate's process singletons.  A release that renames one
would turn an override into silent dead code, so, as ``ds_mp.deepspeed_compat`` does for
DeepSpeed:

* :data:`ASSUMPTIONS` is the table (owner, name, why) of every one of them;
* the private methods ds_mp.hf's classes override are read off the classes
  (:func:`overridden_private_names`), never listed by hand, and each must be in the table;
* :func:`check` verifies the table against the installed packages when a trainer is built
  (:func:`before_trainer`, before any constructor runs), failing with one line that names the missing name and the installed
  transformers / TRL / Accelerate versions;
* :func:`process_state_from_torch` is the only write into a third-party singleton (Accelerate's
  ``PartialState`` / ``AcceleratorState`` shared state).

ds_mp.hf's own private helpers are spelled ``_ds_mp_*`` (never an override).
Measured against transformers 5.25.0, trl 1.16.0, accelerate 1.15.0 (``pyproject.toml`` gives the ranges).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ds_mp.config import ConfigError

#: The versions ds_mp.hf is tested with (``pyproject.toml``), said in a failure.
SUPPORTED = "transformers>=5.23,<6, trl>=1.16,<1.17, accelerate>=1.15,<1.16"
#: Seconds a rank other than 0 waits before printing its refusal (:func:`one_line_refusals`).
REFUSAL_GRACE_S = 10.0
#: The prefix of ds_mp.hf's own private names (helpers, not overrides).
OWN_PREFIX = "_ds_mp_"


class HfIncompatible(RuntimeError):
    """The installed transformers / TRL / Accelerate lacks a private name ds_mp.hf relies on."""


@dataclass(frozen=True)
class Assumption:
    owner: str  # "Trainer" (transformers.Trainer), "SFTTrainer" / "DPOTrainer" (trl), "PartialState" / "AcceleratorState"
    # (accelerate.state), "BatchSamplerShard" (accelerate.data_loader), "PretrainedConfig" (transformers), or a
    # module named in full ("trl.trainer.utils", "transformers.trainer_utils") for a module-level function
    name: str
    why: str  # what ds_mp.hf relies on


ASSUMPTIONS: tuple[Assumption, ...] = (
    # --- the Trainer's private hooks ds_mp.hf overrides (PipelineTrainerMixin) ---
    Assumption("Trainer", "_move_model_to_device", "__init__/train() place the model through it; ds_mp's engine "
               "placed its shards (the Trainer's model may be on the meta device)"),
    Assumption("Trainer", "_get_dataloader", "get_train/eval_dataloader build their DataLoader through it; ds_mp "
               "splits Accelerate's BatchSamplerShard over the DP replicas only"),
    Assumption("Trainer", "_prepare_for_training", "train() wraps the model, builds optimizer and scheduler and loads "
               "a resumed checkpoint here; ds_mp's engine takes Accelerate's DeepSpeed engine's place"),
    Assumption("Trainer", "_clip_grad_norm", "the training loop clips through it; ds_mp's engine clipped in its step"),
    Assumption("Trainer", "_get_grad_norm", "turns _clip_grad_norm's value into the logged grad_norm"),
    Assumption("Trainer", "_get_learning_rate", "the logged learning_rate"),
    Assumption("Trainer", "_save_optimizer_and_scheduler", "_save_checkpoint writes the optimizer and scheduler "
               "through it; ds_mp writes its layout-free checkpoint (<checkpoint>/ds_mp) instead"),
    Assumption("Trainer", "_save_scaler", "_save_checkpoint writes the AMP grad scaler through it; ds_mp's checkpoint "
               "holds the fp16 loss scale"),
    Assumption("Trainer", "_load_best_model", "load_best_model_at_end loads the best checkpoint through it"),
    Assumption("Trainer", "_save_checkpoint", "train() saves checkpoint-N through it (model, optimizer, scheduler, "
               "trainer_state.json, RNG, rotation); ds_mp.hf.stop stages it and renames it only when complete"),
    Assumption("Trainer", "_get_output_dir", "_save_checkpoint writes checkpoint-N under the directory it returns; "
               "ds_mp.hf.stop returns the staging directory during a save"),
    # --- the Trainer's private state and helpers ds_mp.hf reads or calls ---
    Assumption("Trainer", "_memory_tracker", "set in __init__: evaluate() starts and stops it (memory metrics)"),
    Assumption("Trainer", "_remove_unused_columns", "evaluate(): drops a datasets.Dataset's columns the model's "
               "forward does not take"),
    Assumption("Trainer", "_get_collator_with_removed_columns", "evaluate(): the same for another dataset, in the "
               "collator"),
    Assumption("Trainer", "_train_batch_size", "set in __init__: the per-device micro-batch "
               "get_total_train_batch_size multiplies"),
    Assumption("SFTTrainer", "_tokenizer", "set in __init__: the tokenizer of processing_class (its pad id fills "
               "ds_mp's fixed rows)"),
    Assumption("SFTTrainer", "_prepare_dataset", "evaluate(eval_dataset=<raw text or chat set>): TRL's own "
               "tokenization / chat template / packing of a set, as its evaluate() does before ds_mp's"),
    Assumption("SFTTrainer", "_skip_prepare_dataset", "set in __init__: whether TRL prepares datasets at all "
               "(dataset_kwargs skip_prepare_dataset)"),
    Assumption("SFTTrainer", "_formatting_func", "set in __init__: the formatting_func _prepare_dataset applies"),
    Assumption("DPOTrainer", "_prepare_dataset", "evaluate(eval_dataset=<raw preference set>): TRL's own prompt "
               "extraction / EOS / chat template / tokenization of a set, as its evaluate() does"),
    Assumption("DPOTrainer", "_precompute_ref_logps", "TRL's constructor precomputes the reference log-probs through "
               "it; ds_mp.hf.dpo defers that until its engine exists"),
    Assumption("trl.trainer.dpo_trainer", "hash_module", "TRL's constructor hashes the model for its precompute cache "
               "through this module global; compat.trl_hash_module_off swaps it for a no-op while it runs (no cache, meta "
               "weights)"),
    Assumption("trl.trainer.utils", "create_model_from_path", "SFTTrainer(model=<path>, peft_config=...): the model "
               "loaded as TRL loads it (model_init_kwargs) before PEFT wraps it"),
    Assumption("transformers.trainer_utils", "rotate_checkpoints", "ds_mp.hf.stop rotates checkpoints as "
               "_save_checkpoint does after renaming a staged checkpoint into place"),
    Assumption("BatchSamplerShard", "even_batches", "set in __init__: the last round filled with rows repeated "
               "from the epoch's start; ds_mp.hf.rows drops them (its subclass wraps __iter__)"),
    Assumption("PretrainedConfig", "_name_or_path", "the directory or Hub id a model was loaded from: ds_mp reads a "
               "meta-device model's weights from it and names a PEFT adapter's base with it"),
    # --- Accelerate's process singletons (written by process_state_from_torch only) ---
    Assumption("PartialState", "_shared_state", "the dict every PartialState instance's __dict__ is (Borg): "
               "process_index, num_processes, local_process_index"),
    Assumption("AcceleratorState", "_shared_state", "the same dict for AcceleratorState"),
)


def versions() -> str:
    """``transformers X, trl Y, accelerate Z`` as installed (``not installed`` where absent)."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"
    return ", ".join(one(n) for n in ("transformers", "trl", "accelerate"))


def _fail(a: Assumption, where: str) -> HfIncompatible:
    return HfIncompatible(f"{versions()}: {where} has no '{a.name}'; ds_mp.hf relies on it ({a.why}); install "
                          f"{SUPPORTED}")


def _owners(trainer_cls: type | None = None) -> dict[str, type]:
    """Owner name -> class.  ``SFTTrainer`` only where ``trainer_cls`` derives from TRL's (or, with
    no class, where TRL is installed): TRL is an optional extra."""
    from accelerate.state import AcceleratorState, PartialState
    from transformers import PretrainedConfig, Trainer

    import transformers.trainer_utils
    from accelerate.data_loader import BatchSamplerShard

    owners: dict[str, Any] = {"Trainer": Trainer, "PartialState": PartialState, "AcceleratorState": AcceleratorState,
                              "PretrainedConfig": PretrainedConfig, "BatchSamplerShard": BatchSamplerShard,
                              "transformers.trainer_utils": transformers.trainer_utils}
    wants_trl = trainer_cls is None or any(k.__module__.split(".")[0] == "trl" for k in trainer_cls.__mro__)
    if wants_trl:
        try:
            import trl
        except ImportError:
            if trainer_cls is not None:
                raise
        else:
            import trl.trainer.utils

            import trl.trainer.dpo_trainer

            owners["SFTTrainer"] = trl.SFTTrainer
            owners["DPOTrainer"] = trl.DPOTrainer
            owners["trl.trainer.utils"] = trl.trainer.utils
            owners["trl.trainer.dpo_trainer"] = trl.trainer.dpo_trainer
    return owners


@functools.lru_cache(maxsize=None)
def _init_source(cls: type) -> str:
    """The source of ``cls``'s own ``__init__`` and ``__post_init__`` (a dataclass's), "" where it has
    neither or their source is not at hand."""
    out = []
    for name in ("__init__", "__post_init__"):
        try:
            out.append(inspect.getsource(vars(cls)[name]) if name in vars(cls) else "")
        except (OSError, TypeError):
            pass
    return "\n".join(out)


def defines(cls: type, name: str) -> bool:
    """``cls`` (or a class it derives from) has ``name`` as a class attribute or sets ``self.<name>``
    in its ``__init__`` / ``__post_init__`` (instance state)."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]+)?=(?!=)")
    return hasattr(cls, name) or any(pattern.search(_init_source(k)) for k in getattr(cls, "__mro__", ())
                                     if k is not object)


def overridden_private_names(trainer_cls: type) -> list[str]:
    """The private names ds_mp.hf's classes in ``trainer_cls``'s MRO define (read off the classes;
    ``_ds_mp_*`` helpers aside): each is an override of a third-party hook."""
    names: list[str] = []
    for k in trainer_cls.__mro__:
        if k.__module__.startswith("ds_mp.hf"):
            names += [n for n in vars(k) if n.startswith("_") and not n.startswith(("__", OWN_PREFIX))
                      and n not in names]
    return names


def check(trainer_cls: type | None = None, owners: dict[str, type] | None = None) -> list[str]:
    """Every assumption whose owner applies (``trainer_cls``'s bases; all with None) holds, and every
    private name ds_mp.hf's classes in ``trainer_cls`` override is in the table and defined by its
    owner; returns those overrides.  Raises :class:`HfIncompatible` (one line) naming the first
    missing name and the installed versions."""
    owners = _owners(trainer_cls) if owners is None else owners
    for a in ASSUMPTIONS:
        if a.owner in owners and not defines(owners[a.owner], a.name):
            o = owners[a.owner]
            raise _fail(a, o.__name__ if inspect.ismodule(o) else f"{o.__module__.split('.')[0]}.{o.__name__}")
    if trainer_cls is None:
        return []
    listed = {a.name: a for a in ASSUMPTIONS if a.owner in owners}
    names = overridden_private_names(trainer_cls)
    for name in names:
        if name not in listed:
            raise HfIncompatible(f"{versions()}: ds_mp.hf overrides '{name}', which ds_mp/hf/compat.py does not list; "
                                 f"add it to ASSUMPTIONS (or name a helper {OWN_PREFIX}*)")
    return names


def process_state_from_torch(args: Any) -> bool:
    """Make Accelerate's process state (hence ``args.process_index`` / ``local_process_index`` /
    ``world_size``, ``should_log``, ``should_save``, the Trainer's world-process-zero and the data
    loader's shard) that of ``torch.distributed``.  Accelerate's DeepSpeed state on CPU (no
    ``use_cpu``: no backend) reports one process of index 0 on every rank, so every rank printed the
    logs and the progress bar, rotated the checkpoints and read every row (no DP split).  Returns
    whether anything was corrected.  The one write into Accelerate's singletons (tests/test_hf_compat.py
    checks the installed Accelerate still needs it)."""
    from accelerate.state import AcceleratorState, PartialState

    state = getattr(args, "distributed_state", None)
    if state is None or not torch.distributed.is_initialized():
        return False
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if (state.process_index, state.num_processes) == (rank, world):
        return False
    fix = {"process_index": rank, "num_processes": world, "local_process_index": int(os.environ.get("LOCAL_RANK", rank))}
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):  # every instance reads these
        if shared:
            shared.update(fix)
    return True


@contextlib.contextmanager
def trl_hash_module_off() -> Iterator[None]:
    """Inside: TRL's DPO module hashes no model (``trl.trainer.dpo_trainer.hash_module`` answers "").
    TRL's constructor hashes the model's weights for its precompute cache; ds_mp keeps no such cache,
    and a model on the meta device has no weights to hash.  The one write into TRL's module state,
    restored on exit."""
    import trl.trainer.dpo_trainer as dpo_module

    hasher = dpo_module.hash_module
    dpo_module.hash_module = lambda module: ""
    try:
        yield
    finally:
        dpo_module.hash_module = hasher


def under_launcher() -> bool:
    """This process is a rank of a launcher: DeepSpeed's ``launch.py`` (ds_mp's launcher guard armed)
    or torch elastic (``torchrun``, ``accelerate launch``)."""
    from ds_mp import launcher_guard

    return launcher_guard.armed() is not None or "TORCHELASTIC_RUN_ID" in os.environ


def one_line_refusals() -> None:
    """Under a launcher, an uncaught :class:`ConfigError` (or :class:`HfIncompatible`) ends the rank
    with exit code 2 and its one line (``ds_mp: error: …``, as ds_mp's own launcher path prints it)
    instead of a traceback per rank.  Global rank 0 prints at once.  Another rank waits
    :data:`REFUSAL_GRACE_S` first, dying silently on the launcher's SIGTERM: every rank refuses the same arguments, so rank 0
    has printed and the launcher ends the job in the meantime (one line per job; a rank that exited
    first would otherwise get rank 0 killed before it printed); a refusal of that rank alone is
    printed after the wait (``rank N: …``).  Other exceptions keep the previous ``sys.excepthook``."""
    if not under_launcher() or getattr(sys.excepthook, "ds_mp_refusals", False):
        return
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if not issubclass(kind, (ConfigError, HfIncompatible)):
            return previous(kind, value, tb)
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher ending the job: no word from here
            sys.stdout.flush()
            time.sleep(REFUSAL_GRACE_S)
        said = str(value).removeprefix("ds_mp: ")
        print(f"ds_mp: error: {said}" if rank == "0" else f"ds_mp: error: rank {rank}: {said}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # no exit-time teardown of half-built process groups (their destructors abort)
    hook.ds_mp_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def before_trainer(trainer_cls: type) -> None:
    """What building a ds_mp.hf trainer does first (``PipelineTrainerMixin.__new__``: before any
    constructor, a subclass's own refusals included), on every rank: refusals
    become one line under a launcher; DeepSpeed's /dev/shm all-reduce workspaces (created when the
    TrainingArguments were built before ``import ds_mp.hf``) are released (collective where they
    exist); the installed transformers / TRL / Accelerate are checked against :data:`ASSUMPTIONS`."""
    from ds_mp.deepspeed_compat import release_shm_workspace

    one_line_refusals()
    release_shm_workspace()
    check(trainer_cls)


__all__ = ["ASSUMPTIONS", "Assumption", "HfIncompatible", "SUPPORTED", "before_trainer", "check", "defines",
           "one_line_refusals", "overridden_private_names", "process_state_from_torch", "under_launcher", "versions"]
