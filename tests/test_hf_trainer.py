"""``ds_mp.hf.Trainer`` against the outside oracle: the same script on one process with the plain
``transformers.Trainer`` (no ds_mp, no DeepSpeed; fp32, dropout 0) logs the same losses, grad norms
and LRs, gives the same eval loss and saves the same weights, at TP = 2, PP = 2 (every schedule, zb-v too),
TP2 × PP2 and DP = 2 with accumulation, on data with uneven lengths, padding and masked prompts.

The oracle model gets ``loss_type = "ForCausalLM"``: transformers 5.24 leaves ``GPT2LMHeadModel``'s
``loss_type`` None (its class name has no ``ForCausalLM``), and the plain Trainer then counts
``labels != -100`` without the causal shift for ``num_items_in_batch`` — its logged loss is the
token-loss sum over a count that includes each row's first label, not the per-token mean.

AdamW runs with ``adam_epsilon=1e-6``: the attention's key bias has an exactly zero true gradient
(softmax is shift-invariant per query), so its computed gradient is rounding noise (~1e-10) whose
order of summation differs between layouts; with eps 1e-8 Adam turns that noise into updates of
~lr, which no two summation orders agree on (1.5e-5 apart after 5 steps at PP = 2).

The last test launches an ordinary Trainer script whose only ds_mp line is the import for real, three
ways (``deepspeed --num_gpus 2``, ``torchrun --nproc_per_node 2``, ``accelerate launch --use_deepspeed``): each
trains the same model.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from dist_utils import free_port, run_ranks
from helpers import tiny_gpt2
from launcher_utils import REPO, clean_env

SEQ = 16


def rows(n: int, vocab: int = 203, seed: int = 3) -> list[dict]:
    """Uneven lengths (5-16 tokens), some prompts masked (labels -100), as a tokenised dataset looks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, 4, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding to the longest row, attention_mask 0 and labels -100 on the padding."""
    T = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_args(out: str, deepspeed: Any = None, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
                learning_rate=1e-2, optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=1, logging_steps=1,
                save_strategy="no", report_to="none", seed=0, max_grad_norm=1.0, weight_decay=0.01, use_cpu=True,
                disable_tqdm=True, adam_epsilon=1e-6)  # see below
    base.update(kw)
    return TrainingArguments(deepspeed=deepspeed, **base)


def ds_json(tp: int = 1, pp: int = 1, schedule: str = "1f1b", **ds_mp: Any) -> dict:
    block = {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp, "schedule": schedule},
             "data": {"seq_len": SEQ}, **ds_mp}
    if schedule == "interleaved":
        block["pipeline"]["virtual_stages"] = 2
    if schedule == "terapipe":
        block["terapipe"] = {"slices": [8, 8]}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 0}, "ds_mp": block}


def _logs(state: Any) -> list[dict]:
    return [{k: h[k] for k in ("loss", "grad_norm", "learning_rate", "step")} for h in state.log_history if "loss" in h]


def plain_run(model_dir: str, out: str, gas: int, steps: int = 5, n_train: int = 24) -> dict:
    """The oracle: the plain Trainer on one process, with ``gas`` micro-batches per step."""
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.loss_type = "ForCausalLM"  # see the module docstring
    eval_rows = rows(8, seed=9)
    trainer = Trainer(model=model, args=training_args(out, gradient_accumulation_steps=gas, max_steps=steps,
                                                      per_device_eval_batch_size=len(eval_rows)),
                      train_dataset=rows(n_train), eval_dataset=eval_rows, data_collator=collate)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]  # one eval batch: the per-token loss of the eval set
    trainer.save_model(os.path.join(out, "final"))
    return {"logs": _logs(trainer.state), "eval_loss": eval_loss, "dir": os.path.join(out, "final")}


def _ds_mp_rank(rank: int, model_dir: str, out: str, ds: dict, steps: int, extra: dict | None = None,
                as_object: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    from ds_mp.hf import Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir) if as_object else model_dir
    trainer = Trainer(model=model, args=training_args(out, ds, max_steps=steps, **(extra or {})), train_dataset=rows(24),
                      eval_dataset=rows(8, seed=9), data_collator=collate)
    trainer.train()
    model = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}  # written back by train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))
    return {"logs": _logs(trainer.state), "eval_loss": eval_loss, "dir": os.path.join(out, "final"), "model": model}


def assert_same_run(got: dict, ref: dict, rel: float = 1e-5) -> None:
    """The logs, eval loss and saved weights of ``got`` are ``ref``'s; so is ``trainer.model`` after
    ``train()`` (``got["model"]``, where given: every rank's)."""
    from transformers import AutoModelForCausalLM

    assert [h["step"] for h in got["logs"]] == [h["step"] for h in ref["logs"]]
    for g, r in zip(got["logs"], ref["logs"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=rel), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (g, r)
        assert g["learning_rate"] == pytest.approx(r["learning_rate"], rel=1e-9, abs=1e-12), (g, r)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=rel)
    a = AutoModelForCausalLM.from_pretrained(got["dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(ref["dir"]).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    if "model" in got:
        assert got["model"].keys() >= b.keys()
        for k in b:
            torch.testing.assert_close(got["model"][k], b[k], rtol=1e-5, atol=1e-5, msg=f"trainer.model: {k}")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: Any) -> str:
    """A Qwen2-shaped checkpoint: grouped KV heads, q/k/v biases, RMSNorm, untied head, rotary positions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=203, max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0)
    path = str(tmp_path_factory.mktemp("qwen2"))
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: Any) -> Any:
    """The plain Trainer's runs, one per (checkpoint, accumulation count), computed once."""
    cache: dict[tuple[str, int], dict] = {}

    def get(model_dir: str, gas: int) -> dict:
        if (model_dir, gas) not in cache:
            cache[model_dir, gas] = plain_run(model_dir, str(tmp_path_factory.mktemp(f"plain{gas}")), gas)
        return cache[model_dir, gas]
    return get


LAYOUTS = [  # (id, world, tp, pp, schedule, dp-scaled accumulation of the oracle)
    pytest.param(2, 2, 1, "1f1b", id="tp2"),
    pytest.param(2, 1, 2, "1f1b", id="pp2-1f1b"),
    pytest.param(2, 1, 2, "zb-h1", id="pp2-zb-h1", marks=pytest.mark.slow),
    pytest.param(2, 1, 2, "interleaved", id="pp2-interleaved", marks=pytest.mark.slow),
    pytest.param(2, 1, 2, "terapipe", id="pp2-terapipe", marks=pytest.mark.slow),
    pytest.param(2, 1, 2, "zb-v", id="pp2-zb-v", marks=pytest.mark.slow),  # the V: loss and embedding on rank 0
    pytest.param(4, 2, 2, "1f1b", id="tp2xpp2", marks=pytest.mark.slow),
    pytest.param(2, 1, 1, "1f1b", id="dp2"),
]


@pytest.mark.parametrize("world,tp,pp,schedule", LAYOUTS)
def test_trainer_equals_plain_trainer(world: int, tp: int, pp: int, schedule: str, gpt2_dir: str, oracle: Any,
                                      tmp_path: Any) -> None:
    """Losses, grad norms, LRs, eval loss and saved weights over 5 AdamW steps (warm-up, linear decay,
    clipping, weight decay) equal the plain Trainer's; DP = 2 equals one process with twice the
    accumulation (the same global batch: in step t, rank d's k-th micro-batch is batch t·GA·DP + k·DP + d)."""
    dp = world // (tp * pp)
    got = run_ranks(_ds_mp_rank, world, gpt2_dir, str(tmp_path), ds_json(tp, pp, schedule), 5, timeout=600)
    assert all(r["logs"] == got[0]["logs"] and r["eval_loss"] == got[0]["eval_loss"] for r in got)
    for r in got:  # trainer.model after train(): the trained weights on every rank
        assert_same_run(r, oracle(gpt2_dir, 2 * dp))


def test_gradient_checkpointing_is_activation_checkpointing(gpt2_dir: str, oracle: Any, tmp_path: Any) -> None:
    """``gradient_checkpointing=True`` (TRL's default) runs ds_mp's activation checkpointing at PP = 2:
    the same numbers as the plain Trainer without it."""
    got = run_ranks(_ds_mp_rank, 2, gpt2_dir, str(tmp_path), ds_json(pp=2), 5, {"gradient_checkpointing": True},
                    timeout=600)
    assert_same_run(got[0], oracle(gpt2_dir, 2))


def test_a_loaded_model_object_trains_the_same(gpt2_dir: str, oracle: Any, tmp_path: Any) -> None:
    """``Trainer(model=AutoModelForCausalLM.from_pretrained(dir))`` (weights in memory on every rank)
    at TP = 2: the plain Trainer's numbers."""
    got = run_ranks(_ds_mp_rank, 2, gpt2_dir, str(tmp_path), ds_json(tp=2), 5, None, True, timeout=600)
    assert_same_run(got[0], oracle(gpt2_dir, 2))


@pytest.mark.parametrize("world,tp,pp", [pytest.param(2, 2, 1, id="tp2"),
                                         pytest.param(4, 2, 2, id="tp2xpp2", marks=pytest.mark.slow)])
def test_qwen2_equals_plain_trainer(world: int, tp: int, pp: int, qwen2_dir: str, oracle: Any, tmp_path: Any) -> None:
    """The same on a Qwen2-shaped checkpoint (the Llama family's plan)."""
    got = run_ranks(_ds_mp_rank, world, qwen2_dir, str(tmp_path), ds_json(tp, pp), 5, timeout=600)
    assert_same_run(got[0], oracle(qwen2_dir, 2))


def test_refusals_name_the_argument(gpt2_dir: str, tmp_path: Any) -> None:
    """What cannot apply is refused before any collective, with one line naming the argument."""
    from ds_mp.config import ConfigError
    from ds_mp.hf.args import deepspeed_dict

    model = tiny_gpt2()
    ds = ds_json()
    cases = [
        (dict(torch_compile=True), ds, "torch_compile"),
        (dict(optim="adafactor"), ds, "optim='adafactor'"),
        (dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps"), ds, "reduce_lr_on_plateau"),
        (dict(label_smoothing_factor=0.1), ds, "label_smoothing_factor"),
        (dict(), {**ds, "zero_optimization": {"stage": 3}}, "stage=3"),
        (dict(), {**ds, "scheduler": {"type": "WarmupLR", "params": {}}}, "scheduler"),
        (dict(), {**ds, "train_micro_batch_size_per_gpu": 4}, "per_device_train_batch_size"),
        (dict(), None, "TrainingArguments.deepspeed"),
    ]
    for kw, d, needle in cases:
        with pytest.raises(ConfigError, match=None) as err:
            deepspeed_dict(training_args(str(tmp_path), d, **kw), model.config)
        assert needle in str(err.value) and "\n" not in str(err.value), (needle, str(err.value))


def test_argument_mapping(tmp_path: Any) -> None:
    """The Trainer's optimizer, clipping, precision, seed and checkpointing arguments in the JSON."""
    from ds_mp.hf.args import deepspeed_dict

    cfg = tiny_gpt2().config
    raw = deepspeed_dict(training_args(str(tmp_path), ds_json(), optim="sgd", optim_args="momentum=0.9",
                                       max_grad_norm=0.5, seed=7, gradient_checkpointing=True, weight_decay=0.1), cfg)
    assert raw["optimizer"] == {"type": "SGD", "params": {"lr": 1e-2, "weight_decay": 0.1, "momentum": 0.9}}
    assert raw["gradient_clipping"] == 0.5 and raw["train_micro_batch_size_per_gpu"] == 2
    assert raw["gradient_accumulation_steps"] == 2 and "train_batch_size" not in raw
    assert raw["ds_mp"]["training"]["seed"] == 7
    assert raw["ds_mp"]["pipeline"]["activation_checkpoint_interval"] == 1
    raw = deepspeed_dict(training_args(str(tmp_path), ds_json(), adam_beta2=0.95), cfg)
    assert raw["optimizer"]["type"] == "AdamW" and raw["optimizer"]["params"]["betas"] == [0.9, 0.95]
    no_len = ds_json()
    del no_len["ds_mp"]["data"]
    assert deepspeed_dict(training_args(str(tmp_path), no_len), cfg)["ds_mp"]["data"]["seq_len"] == cfg.n_positions
    assert deepspeed_dict(training_args(str(tmp_path), ds_json(), bf16=True), cfg)["bf16"] == {"enabled": True}


def test_model_without_a_plan_is_refused(tmp_path: Any) -> None:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from ds_mp.config import ConfigError
    from ds_mp.hf.model_sync import model_and_source

    model = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ConfigError, match="not a causal LM"):
        model_and_source(model)


def test_fixed_rows_keep_the_targets() -> None:
    """Padding to (rows, seq_len) adds no target and keeps every token's place."""
    from ds_mp.hf.rows import step_rows
    from ds_mp.models.batch import parse_micro_batch

    batch = collate(rows(3))
    fixed = step_rows([batch], 2, 4, SEQ)
    assert len(fixed) == 2 and all(f["input_ids"].shape == (4, SEQ) for f in fixed)
    T = batch["input_ids"].shape[1]
    assert torch.equal(fixed[0]["labels"][:3, :T], batch["labels"])
    assert (fixed[0]["labels"][3:] == -100).all() and (fixed[1]["labels"] == -100).all()
    count = int((parse_micro_batch(fixed[0]).targets() != -100).sum())
    assert count == int((batch["labels"][:, 1:] != -100).sum())


def _resume_rank(rank: int, model_dir: str, out: str, ds: dict, stop_at: int | None, resume: bool) -> dict:
    from transformers import TrainerCallback

    from ds_mp.hf import Trainer

    class Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True
            return control

    args = training_args(out, ds, save_strategy="steps", save_steps=3, save_total_limit=1)
    trainer = Trainer(model=model_dir, args=args, train_dataset=rows(24), data_collator=collate, callbacks=[Stop()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(os.path.join(out, "final"))
    return {"logs": _logs(trainer.state), "dir": os.path.join(out, "final"),
            "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))}


@pytest.mark.slow
def test_resume_at_another_layout_equals_the_uninterrupted_run(gpt2_dir: str, tmp_path: Any) -> None:
    """3 steps at TP = 2 (checkpoint-3 written, save_total_limit rotates), then steps 4-5 resumed at
    PP = 2 from ``resume_from_checkpoint=True``: the logs and the final weights are the uninterrupted
    TP = 2 run's."""
    from transformers import AutoModelForCausalLM

    full = run_ranks(_resume_rank, 2, gpt2_dir, str(tmp_path / "full"), ds_json(tp=2), None, False, timeout=600)[0]
    out = str(tmp_path / "cut")
    first = run_ranks(_resume_rank, 2, gpt2_dir, out, ds_json(tp=2), 3, False, timeout=600)[0]
    assert first["checkpoints"] == ["checkpoint-3"] and os.path.isdir(os.path.join(out, "checkpoint-3", "ds_mp"))
    second = run_ranks(_resume_rank, 2, gpt2_dir, out, ds_json(pp=2), None, True, timeout=600)[0]
    assert [h["step"] for h in second["logs"]] == [1, 2, 3, 4, 5]  # the trainer state carries steps 1-3
    for g, r in zip(second["logs"], full["logs"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5) and g["learning_rate"] == r["learning_rate"]
    a = AutoModelForCausalLM.from_pretrained(second["dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(full["dir"]).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    with open(os.path.join(out, "checkpoint-5", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 5


SCRIPT = '''
import json, os, sys
import torch
from transformers import TrainingArguments
from ds_mp.hf import Trainer  # the only ds_mp line

SEQ = {seq}
{rows}
{collate}
model_dir, out, config = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # deepspeed adds it
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                         learning_rate=1e-2, optim="adamw_torch", adam_epsilon=1e-6, warmup_steps=1, logging_steps=1,
                         save_strategy="no", report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
                         deepspeed=config)
trainer = Trainer(model=model_dir, args=args, train_dataset=rows(24), data_collator=collate)
trainer.train()
trainer.save_model(os.path.join(out, "final"))
if trainer.is_world_process_zero():
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump([h["loss"] for h in trainer.state.log_history if "loss" in h], f)
'''


def _launch(kind: str, script: str, argv: list[str]) -> subprocess.CompletedProcess:
    bin_dir, port = os.path.dirname(sys.executable), str(free_port())
    cmd = {"deepspeed": [os.path.join(bin_dir, "deepspeed"), "--num_gpus", "2", "--master_port", port],
           "torchrun": [os.path.join(bin_dir, "torchrun"), "--nproc_per_node", "2", "--master_port", port],
           "accelerate": [os.path.join(bin_dir, "accelerate"), "launch", "--use_deepspeed", "--num_processes", "2",
                          "--deepspeed_config_file", argv[2], "--main_process_port", port]}[kind]
    env = clean_env(OMP_NUM_THREADS="1", DS_MP_TIMEOUT="120", PYTHONPATH=REPO)
    return subprocess.run(cmd + [script, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_three_launchers_train_the_same_model(tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, config = str(tmp_path / "model"), str(tmp_path / "ds.json")
    tiny_gpt2().save_pretrained(model_dir)
    with open(config, "w") as f:
        json.dump(ds_json(tp=2), f)
    script = str(tmp_path / "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT.format(seq=SEQ, rows=inspect.getsource(rows), collate=inspect.getsource(collate)))
    results = {}
    for kind in ("deepspeed", "torchrun", "accelerate"):
        out = str(tmp_path / kind)
        proc = _launch(kind, script, [model_dir, out, config])
        assert proc.returncode == 0, f"{kind}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        with open(os.path.join(out, "losses.json")) as f:
            results[kind] = (json.load(f), AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).state_dict())
    losses, weights = results["deepspeed"]
    assert len(losses) == 3
    for kind, (other_losses, other_weights) in results.items():
        assert other_losses == pytest.approx(losses, rel=1e-6), kind
        for k in weights:
            torch.testing.assert_close(other_weights[k], weights[k], rtol=1e-6, atol=1e-6, msg=f"{kind}: {k}")


def _early_stopping_run(model_dir: str, out: str, ds: dict | None) -> dict:
    """Eval and save every step, early stopping (patience 1) on eval_loss, the best model loaded at
    the end; ``ds`` None: the plain Trainer on one process (one eval batch: the per-token loss)."""
    from transformers import AutoModelForCausalLM, EarlyStoppingCallback, Trainer as PlainTrainer

    from ds_mp.hf import Trainer as DsMpTrainer

    args = training_args(out, ds, learning_rate=0.1, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                         save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                         per_device_eval_batch_size=8, max_steps=6)
    model, Trainer = model_dir, DsMpTrainer
    if ds is None:
        model, Trainer = AutoModelForCausalLM.from_pretrained(model_dir), PlainTrainer
        model.loss_type = "ForCausalLM"
    trainer = Trainer(model=model, args=args, train_dataset=rows(24), eval_dataset=rows(8, seed=9),
                      data_collator=collate, callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"evals": [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h],
            "best": os.path.basename(trainer.state.best_model_checkpoint), "dir": os.path.join(out, "final"),
            "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def _early_stopping_rank(rank: int, model_dir: str, out: str, ds: dict) -> dict:
    return _early_stopping_run(model_dir, out, ds)


@pytest.mark.slow
def test_eval_during_training_early_stopping_and_best_model(gpt2_dir: str, tmp_path: Any) -> None:
    """``eval_strategy``, ``EarlyStoppingCallback`` and ``load_best_model_at_end`` at TP = 2: the same
    eval losses, the same stopping step and best checkpoint, and the best weights saved, as the plain Trainer."""
    from transformers import AutoModelForCausalLM

    ref = _early_stopping_run(gpt2_dir, str(tmp_path / "plain"), None)
    ranks = run_ranks(_early_stopping_rank, 2, gpt2_dir, str(tmp_path / "ds_mp"), ds_json(tp=2), timeout=900)
    got = ranks[0]
    assert [s for s, _ in got["evals"]] == [s for s, _ in ref["evals"]] and got["best"] == ref["best"]
    for (_, g), (_, r) in zip(got["evals"], ref["evals"]):
        assert g == pytest.approx(r, rel=1e-5)
    a = AutoModelForCausalLM.from_pretrained(got["dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(ref["dir"]).state_dict()
    best = AutoModelForCausalLM.from_pretrained(os.path.join(ref["dir"], "..", ref["best"])).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    for rank in ranks:  # trainer.model on every rank: the best checkpoint's weights
        for k in best:
            torch.testing.assert_close(rank["model"][k], best[k], rtol=1e-5, atol=1e-5, msg=f"trainer.model: {k}")
