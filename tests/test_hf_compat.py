"""ds_mp.hf's private transformers / TRL / Accelerate names are listed and checked like the DeepSpeed
ones (ds_mp/hf/compat.py), its one write into Accelerate's singletons is an adapter whose need is
re-checked against the installed Accelerate, and what a trainer's construction refuses is refused
before any dataset work, in one line, leaving nothing in /dev/shm whatever the import order."""
from __future__ import annotations

import ast
import glob
import json
import os
import sys
from typing import Any

import pytest

from dist_utils import run_ranks
from helpers import tiny_gpt2
from launcher_utils import REPO
from test_hf_trainer import collate, ds_json, rows, training_args
from test_shm_workspace import leftovers

pytestmark = pytest.mark.timeout(600)

HF = os.path.join(REPO, "ds_mp", "hf")

#: What PipelineTrainerMixin overrides today (the compat table must cover these and the check find them).
MIXIN_OVERRIDES = {"_move_model_to_device", "_get_dataloader", "_prepare_for_training", "_clip_grad_norm",
                   "_get_grad_norm", "_get_learning_rate", "_save_optimizer_and_scheduler", "_save_scaler",
                   "_load_best_model", "_save_checkpoint", "_get_output_dir"}


def test_installed_packages_have_every_private_name() -> None:
    from ds_mp.hf import SFTTrainer, Trainer, compat

    assert compat.check() == []  # every owner, TRL's included
    assert set(compat.check(Trainer)) == MIXIN_OVERRIDES
    assert set(compat.check(SFTTrainer)) == MIXIN_OVERRIDES  # SFTTrainer's own helpers are _ds_mp_*


def test_a_missing_name_fails_in_one_line_naming_it_and_the_versions(monkeypatch: Any) -> None:
    """A transformers that renamed ``_get_dataloader`` fails the trainer's construction first, in one line."""
    import transformers

    from ds_mp.hf import Trainer, compat

    monkeypatch.delattr(transformers.Trainer, "_get_dataloader")
    with pytest.raises(compat.HfIncompatible) as err:
        Trainer(model=None, args=None)  # checked before any constructor runs
    msg = str(err.value)
    assert "\n" not in msg
    assert f"transformers {transformers.__version__}" in msg and "trl 1.16" in msg and "accelerate 1.15" in msg
    assert "transformers.Trainer has no '_get_dataloader'" in msg and "DataLoader" in msg
    monkeypatch.undo()

    fake = type("OldSFTTrainer", (), {})  # a TRL whose SFTTrainer no longer sets self._tokenizer
    with pytest.raises(compat.HfIncompatible, match=r"OldSFTTrainer has no '_tokenizer'"):
        compat.check(None, {**compat._owners(), "SFTTrainer": fake})
    unlisted = type("T", (Trainer,), {"__module__": "ds_mp.hf.mine", "_evaluate_step": lambda self: None})
    with pytest.raises(compat.HfIncompatible, match="overrides '_evaluate_step', which ds_mp/hf/compat.py does not"):
        compat.check(unlisted)


HF_PACKAGES = ("transformers", "trl", "accelerate", "peft")


def private_attributes(source: str) -> set[str]:
    """Every private name ``source`` reads, writes, calls or defines as a method: ``x._name``
    attributes and ``def _name`` inside a class (not dunders, not ds_mp.hf's own ``_ds_mp_*``, not
    an attribute of a module imported from outside the HF packages, such as ``os._exit``)."""
    tree = ast.parse(source)
    other = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names if not ((getattr(n, "module", None) or a.name).split(".")[0] in HF_PACKAGES)}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and not (isinstance(n.value, ast.Name) and n.value.id in other)}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names |= {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if n.startswith("_") and not n.startswith(("__", "_ds_mp_"))}


def test_the_table_covers_every_private_name_used_in_ds_mp_hf() -> None:
    from ds_mp.hf import compat

    sample = ("import os\nfrom accelerate.state import PartialState\nclass T:\n    def _get_dataloader(self):\n"
              "        self._ds_mp_x = self._memory_tracker\n        os._exit(PartialState._shared_state, self.__class__)\n")
    assert private_attributes(sample) == {"_get_dataloader", "_memory_tracker", "_shared_state"}
    listed = {a.name for a in compat.ASSUMPTIONS}
    used = {name: f for f in sorted(glob.glob(os.path.join(HF, "*.py")))
            for name in private_attributes(open(f).read())}
    missing = {n: os.path.basename(f) for n, f in used.items() if n not in listed}
    assert not missing, f"private third-party names used in ds_mp/hf but not in compat.ASSUMPTIONS: {missing}"
    assert MIXIN_OVERRIDES <= set(used)


def _arguments_first(rank: int, model_dir: str, out: str) -> dict:
    """A script that builds its TrainingArguments (Accelerate starts DeepSpeed's comm, shm op and all)
    before it imports ds_mp.hf, then has a trainer refused, then builds one and resumes from a wrong path."""
    import torch
    from transformers import TrainingArguments

    got: dict = {"imported_first": "ds_mp.hf" in sys.modules}
    kw = dict(report_to="none", per_device_train_batch_size=2, max_steps=1, save_strategy="no", disable_tqdm=True)
    args = TrainingArguments(output_dir=out, deepspeed=ds_json(tp=2, pp=2), **kw)  # no use_cpu
    got["accelerate"] = (args.process_index, args.world_size, torch.distributed.get_world_size())
    torch.distributed.barrier()
    got["at_arguments"] = leftovers()
    from ds_mp.config import ConfigError
    from ds_mp.hf import Trainer

    try:
        Trainer(model=model_dir, args=args, train_dataset=rows(8), data_collator=collate)
    except ConfigError as e:  # 2 ranks for TP 2 × PP 2: refused before the Trainer's own constructor
        got["refused"] = str(e)
    torch.distributed.barrier()
    got["after_refusal"] = leftovers()
    args = TrainingArguments(output_dir=out, deepspeed=ds_json(), **kw)
    trainer = Trainer(model=model_dir, args=args, train_dataset=rows(8), data_collator=collate)
    got["corrected"] = (args.process_index, args.world_size, trainer.is_world_process_zero())
    try:
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-7"))
    except ConfigError as e:
        got["resume"] = str(e)
    return got


def test_arguments_before_import_refusal_adapter_and_resume_path(tmp_path: Any) -> None:
    """On two real ranks, TrainingArguments built before ``import ds_mp.hf``:

    * Accelerate's DeepSpeed state on CPU without ``use_cpu`` still reports one process of index 0
      on every rank (when this fails, Accelerate fixed it: remove ``compat.process_state_from_torch``);
      the built trainer's arguments are torch.distributed's (the adapter);
    * the shm op's workspaces existed, and a trainer refused at construction leaves none in /dev/shm;
    * the layout refusal (world 2 for TP 2 × PP 2) is one line;
    * ``resume_from_checkpoint`` at a path without a checkpoint says so in the Trainer's words."""
    model_dir = str(tmp_path / "model")
    tiny_gpt2().save_pretrained(model_dir)
    got = run_ranks(_arguments_first, 2, model_dir, str(tmp_path / "out"))
    for rank, g in enumerate(got):
        assert not g["imported_first"]
        assert g["accelerate"] == (0, 1, 2), "Accelerate reports the right process state now: drop the adapter"
        assert len(g["at_arguments"]) == 2, g  # the case under test happened: both workspaces existed
        assert g["after_refusal"] == []
        assert "world size 2 is not divisible" in g["refused"] and "\n" not in g["refused"]
        assert g["corrected"] == (rank, 2, rank == 0)
        assert g["resume"] == f"Can't find a valid checkpoint at {tmp_path / 'out' / 'checkpoint-7'}"


class _Spy:
    """Records whether the Trainer's own constructor ran (where TRL would tokenize and pack)."""
    calls: list = []

    def __init__(self, *a: Any, **kw: Any) -> None:
        _Spy.calls.append(1)


def test_layout_and_batch_refusals_come_before_the_trainer_is_built(tmp_path: Any, monkeypatch: Any) -> None:
    """Heads by TP, world by TP × PP and an explicit ``train_batch_size`` other than micro × GA × DP are
    refused before the base Trainer's constructor runs (TRL tokenizes the dataset there)."""
    import transformers

    from ds_mp.config import ConfigError
    from ds_mp.hf import PipelineTrainerMixin
    from ds_mp.hf.args import deepspeed_dict

    class Spied(PipelineTrainerMixin, _Spy, transformers.Trainer):
        pass

    model_dir = str(tmp_path / "model")
    tiny_gpt2(n_head=4).save_pretrained(model_dir)
    def args(ds: dict) -> Any:  # built in this 1-process world: the launcher's WORLD_SIZE is set below
        return training_args(str(tmp_path), ds)

    cases = [("1", args(ds_json(tp=2)), "world size 1 is not divisible by tensor_parallel.size (2)"),
             ("3", args(ds_json(tp=3)), "n_head"),
             ("4", args({**ds_json(tp=2), "train_batch_size": 16}), "train_batch_size=16")]
    taken = [args({**ds_json(tp=2), "train_batch_size": given}) for given in (8, "auto")]
    for world, arguments, needle in cases:
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(ConfigError) as err:
            Spied(model=model_dir, args=arguments, train_dataset=rows(8))
        assert needle in str(err.value) and "\n" not in str(err.value), (needle, str(err.value))
    assert "= 8; set \"train_batch_size\": \"auto\" (or 8)" in str(err.value)  # 2 × 2 × DP 2
    assert _Spy.calls == []
    for arguments in taken:  # micro 2 × GA 2 × DP 2 (world 4, TP 2), and "auto", are taken
        assert "train_batch_size" not in deepspeed_dict(arguments, tiny_gpt2().config)


def _refused_under_torchrun(rank: str, stderr_path: str) -> None:
    """A torchrun rank (TORCHELASTIC_RUN_ID) whose script's trainer is refused, the ConfigError
    uncaught: Python hands it to ``sys.excepthook``, as here."""
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ.update(TORCHELASTIC_RUN_ID="t", RANK=rank)
    from ds_mp.hf import SFTTrainer, compat

    compat.REFUSAL_GRACE_S = 0.2  # rank 1 alone here: no launcher ends it while it waits for rank 0

    try:  # refused by the SFTTrainer's own constructor, before the mixin's
        SFTTrainer(model=None, args=None, quantization_config=object())
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        sys.excepthook(type(e), e, e.__traceback__)


def test_a_refusal_under_a_launcher_is_one_line_from_rank_0(monkeypatch: Any, tmp_path: Any) -> None:
    """Under torchrun / accelerate launch (TORCHELASTIC_RUN_ID) a ConfigError from a trainer's
    constructor (the SFTTrainer's own refusals, before the mixin's, included) ends the rank with exit
    code 2 and one line, no traceback: rank 0 at once, another rank only after a grace in which the
    launcher, seeing rank 0 exit, ends it (checked by hand under torchrun and deepspeed: one line per
    job); outside a launcher Python's own hook stays."""
    from dist_utils import _spawn_context

    from ds_mp.hf import compat

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    hook = sys.excepthook
    compat.one_line_refusals()
    assert sys.excepthook is hook  # not under a launcher: nothing changes
    procs = {r: _spawn_context().Process(target=_refused_under_torchrun, args=(r, str(tmp_path / r))) for r in "01"}
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join(120)
    err = {r: (tmp_path / r).read_text() for r in procs}
    said = {r: [line for line in e.splitlines() if line.startswith("ds_mp: error: ")] for r, e in err.items()}
    assert procs["0"].exitcode == 2 and len(said["0"]) == 1 and "Traceback" not in err["0"], err["0"]
    assert procs["1"].exitcode == 2 and "Traceback" not in err["1"], err["1"]
    assert said["1"] == [said["0"][0].replace("error: ", "error: rank 1: ", 1)]  # after its wait for rank 0


def test_adapter_config_has_the_keys_peft_writes(tmp_path: Any) -> None:
    """ds_mp's ``adapter_config.json`` has every key PEFT's own has that ds_mp sets, ``peft_version``
    included, with PEFT's value."""
    import peft

    from ds_mp.checkpoint.lora import adapter_config
    from ds_mp.config.schema import LoraConfig as DsMpLora

    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                             fan_in_fan_out=True))
    model.save_pretrained(str(tmp_path))
    with open(tmp_path / "adapter_config.json") as f:
        theirs = json.load(f)
    ours = adapter_config(DsMpLora(r=2, alpha=4.0, target_modules=["c_attn"]), None)
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    assert ours["peft_version"] == theirs["peft_version"] == peft.__version__
