"""What outside tests of ``ds_mp.hf.Trainer`` found (issue 48), each against the plain
``transformers.Trainer`` on one process (the outside oracle; fp32, dropout 0, tests/test_hf_trainer.py's
data: uneven lengths, masked prompts):

* frozen weights (``requires_grad=False``) stay bit-identical at TP = 2 and PP = 2, the others train
  as the plain Trainer trains them, and ``trainer.model`` holds the trained weights after ``train()``;
* at DP = 2 the epoch's last, short batch trains exactly the plain Trainer's rows (Accelerate's
  ``even_batches`` repeats are dropped), over two epochs of an uneven row count;
* ``compute_loss_func`` is refused in one line, the constructor's arguments bound by name.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import tiny_gpt2
from test_hf_trainer import _logs, collate, ds_json, rows, training_args

FROZEN = ("transformer.h.1.attn.c_attn.weight", "transformer.wpe.weight")  # a TP-sharded matrix, a replicated one


def _frozen_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.loss_type = "ForCausalLM"  # test_hf_trainer's module docstring (the oracle's count)
    for name, p in model.named_parameters():
        p.requires_grad = name not in FROZEN
    return model


def _frozen_run(model_dir: str, out: str, ds: dict | None, gas: int = 2) -> dict:
    """3 AdamW steps of a model with :data:`FROZEN` weights; ``ds`` None: the plain Trainer."""
    from transformers import Trainer as PlainTrainer

    from ds_mp.hf import Trainer

    cls = PlainTrainer if ds is None else Trainer
    trainer = cls(model=_frozen_model(model_dir), args=training_args(out, ds, max_steps=3,
                                                                     gradient_accumulation_steps=gas),
                  train_dataset=rows(24), data_collator=collate)
    trainer.train()
    return {"logs": _logs(trainer.state), "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "requires_grad": {n: p.requires_grad for n, p in trainer.model.named_parameters()}}


def _frozen_rank(rank: int, model_dir: str, out: str, ds: dict) -> dict:
    return _frozen_run(model_dir, out, ds)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,pp,zero", [pytest.param(2, 1, 0, id="tp2"), pytest.param(1, 2, 0, id="pp2"),
                                        pytest.param(1, 1, 1, id="dp2-zero1")])
def test_frozen_weights_stay_and_trainer_model_is_trained(tp: int, pp: int, zero: int, gpt2_dir: str,
                                                          tmp_path: Any) -> None:
    """3 AdamW steps with a TP-sharded matrix and the replicated position embedding frozen (DP = 2
    with ZeRO-1 against one process with twice the accumulation)."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(gpt2_dir).state_dict()
    dp = 2 // (tp * pp)
    ref = _frozen_run(gpt2_dir, str(tmp_path / "plain"), None, 2 * dp)
    assert all(torch.equal(ref["model"][k], initial[k]) for k in FROZEN)  # the oracle's own contract
    cfg = ds_json(tp, pp)
    cfg["zero_optimization"] = {"stage": zero}
    got = run_ranks(_frozen_rank, 2, gpt2_dir, str(tmp_path / "ds_mp"), cfg, timeout=600)
    for g, r in zip(got[0]["logs"], ref["logs"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5) and g["grad_norm"] == pytest.approx(r["grad_norm"],
                                                                                                 rel=1e-4), (g, r)
    for rank, res in enumerate(got):  # trainer.model on every rank: the trained weights, frozen ones untouched
        assert res["requires_grad"] == ref["requires_grad"]
        for k in FROZEN:
            assert torch.equal(res["model"][k], initial[k]), (rank, k)
        for k, v in ref["model"].items():
            torch.testing.assert_close(res["model"][k], v, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {k}")
        assert not torch.equal(res["model"]["transformer.h.0.attn.c_attn.weight"],
                               initial["transformer.h.0.attn.c_attn.weight"])


def _epochs_run(model_dir: str, out: str, ds: dict | None, n_rows: int, per_device: int) -> dict:
    """Two epochs over ``n_rows`` rows, ``per_device`` rows per micro-batch, 2 micro-batches a step."""
    from transformers import AutoModelForCausalLM, Trainer as PlainTrainer

    from ds_mp.hf import Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.loss_type = "ForCausalLM"
    cls = PlainTrainer if ds is None else Trainer
    args = training_args(out, ds, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=per_device)
    trainer = cls(model=model, args=args, train_dataset=rows(n_rows), data_collator=collate)
    trainer.train()
    return {"logs": _logs(trainer.state)}


def _epochs_rank(rank: int, *args: Any) -> dict:
    return _epochs_run(*args)


@pytest.mark.timeout(900)
def test_dp2_short_last_batch_trains_the_plain_trainers_rows(gpt2_dir: str, tmp_path: Any) -> None:
    """13 rows, 2 rows per micro-batch and replica, 2 micro-batches a step, DP = 2: each epoch's second
    step has one real row on replica 0 (then repeats) and none on replica 1; the plain Trainer with
    4 rows per micro-batch trains rows 8-12 there.  Losses and grad norms of all 4 steps equal."""
    ref = _epochs_run(gpt2_dir, str(tmp_path / "plain"), None, 13, 4)
    got = run_ranks(_epochs_rank, 2, gpt2_dir, str(tmp_path / "ds_mp"), ds_json(), 13, 2, timeout=600)
    assert [h["step"] for h in got[0]["logs"]] == [h["step"] for h in ref["logs"]] == [1, 2, 3, 4]
    for g, r in zip(got[0]["logs"], ref["logs"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), (got[0]["logs"], ref["logs"])
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (got[0]["logs"], ref["logs"])


def test_real_rows_of_accelerates_even_batches() -> None:
    """The rows Accelerate's shard yields at DP = 2 for 13 rows in batches of 2, minus its repeats:
    every row once, in the one-process order."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from ds_mp.hf.rows import Repeats, keep_real_rows

    seen = []
    for d in range(2):
        shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(13)), 2, False), 2, d, even_batches=True)
        assert keep_real_rows(shard, 13)
        seen.append(list(shard))
    assert seen[0] == [[0, 1], [4, 5], [8, 9], [12]] and seen[1][:3] == [[2, 3], [6, 7], [10, 11]]
    assert len(seen[1]) == 4  # its last batch: repeats only (the mixin trains it without targets)
    repeats, epoch, resumed = Repeats(shard, 2), iter([]), iter([])  # replica 1, 2 batches a step
    assert repeats.real(epoch, 2, 0) == [True, True] and repeats.real(epoch, 2, 1) == [True, False]
    assert repeats.real(resumed, 2, 3) == [True, False]  # resumed in epoch 1's step 2: the position from the step


def test_compute_loss_func_is_refused_and_arguments_bind_by_name(tmp_path: Any) -> None:
    """``compute_loss_func`` (by keyword or in its place among the positional arguments) is refused
    in one line before anything is built, as are ``optimizers`` and ``compute_metrics`` wherever given."""
    from ds_mp.config import ConfigError
    from ds_mp.hf import Trainer

    args = training_args(str(tmp_path), ds_json())
    model = tiny_gpt2()

    def loss_fn(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        return outputs.loss * 10

    cases = [((model, args), {"compute_loss_func": loss_fn}, "compute_loss_func"),
             ((model, args, collate, rows(4), None, None, None, loss_fn), {}, "compute_loss_func"),
             ((), {"model": model, "args": args, "compute_metrics": lambda p: {}}, "compute_metrics"),
             ((model,), {"args": args, "optimizers": (torch.optim.SGD(model.parameters(), lr=0.1), None)},
              "optimizers")]
    for a, kw, needle in cases:
        with pytest.raises(ConfigError) as err:
            Trainer(*a, **kw)
        assert str(err.value).startswith(needle) and "\n" not in str(err.value), (needle, str(err.value))


def test_sft_trainer_refuses_compute_loss_func(tmp_path: Any) -> None:
    from trl import SFTConfig

    from ds_mp.config import ConfigError
    from ds_mp.hf import SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), deepspeed=ds_json(), use_cpu=True, report_to="none", bf16=False)
    with pytest.raises(ConfigError, match="^compute_loss_func"):
        SFTTrainer(model=tiny_gpt2(), args=args, train_dataset=[], compute_loss_func=lambda o, l, n=None: o.loss)


def test_frozen_weights_on_the_meta_device_are_refused(gpt2_dir: str) -> None:
    """A meta model is read from its path, which does not say what is frozen: refused, not trained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_mp.config import ConfigError
    from ds_mp.hf.model_sync import model_and_source

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gpt2_dir))
    model.config._name_or_path = gpt2_dir
    assert model_and_source(model)[1] == gpt2_dir
    model.transformer.wpe.weight.requires_grad = False
    with pytest.raises(ConfigError, match="^model: on the meta device with requires_grad=False"):
        model_and_source(model)
