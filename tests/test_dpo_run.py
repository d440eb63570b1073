"""Preference data and the launcher's DPO run against TRL 1.16: the records tokenized as TRL's own
``DPOTrainer._prepare_dataset`` tokenizes them (plain and conversational, an over-long prompt
dropped) and rowed as its ``DataCollatorForPreference`` rows them (a pair truncated at max_length);
and a preference JSONL trained through the launcher's loop (``train_in_process``: 2 steps at DP 2,
each replica its own pairs, reference log-probs precomputed on the engine; then ``--resume`` at
PP 2 for the third, reading the stored references) equal to plain ``trl.DPOTrainer`` on one
process: the logged loss and reward / log-prob metrics of every step and the exported weights."""
from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from helpers import tiny_gpt2
from sft_utils import chat_tokenizer, sentence

SEQ, STEPS, PAIRS_PER_MICRO, GAS, LR = 48, 3, 2, 2, 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dpo_model"))
    tok = chat_tokenizer(path)
    tiny_gpt2(n_layer=4, n_embd=32, vocab=len(tok), n_positions=64, seed=4).save_pretrained(path)
    return path


def records(n: int, chat: bool, seed: int = 0) -> list[dict]:
    """``n`` preference records of very uneven lengths, one with a chosen completion longer than SEQ."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c, r = (sentence(rng, rng.randint(1, 8)), sentence(rng, rng.randint(1, 15)),
                   sentence(rng, rng.randint(1, 15)))
        if i == 1:
            c = sentence(rng, 60)  # cut at max_length
        if chat:
            out.append({"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                        "rejected": [{"role": "assistant", "content": r}]})
        else:
            out.append({"prompt": p, "chosen": " " + c, "rejected": " " + r})
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "conversational"])
def test_pairs_are_tokenized_and_rowed_as_trl_does(model_dir: str, chat: bool) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    from ds_mp.data.preference import pair_rows, tokenize_pairs

    tok = AutoTokenizer.from_pretrained(model_dir)
    recs = records(6, chat)
    recs.append({**recs[0], "prompt": [{"role": "user", "content": sentence(random.Random(1), 80)}] if chat
                 else sentence(random.Random(1), 80)})  # its prompt alone fills max_length: dropped
    args = SimpleNamespace(dataset_num_proc=None, max_length=SEQ, truncation_mode="keep_start")
    want = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(recs), tok, args, "train")
    got, dropped = tokenize_pairs(tok, recs, SEQ)
    assert dropped == 1 and len(want) == len(got) == 6
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    assert [{k: p[k] for k in keys} for p in want] == got
    coll = DataCollatorForPreference(pad_token_id=0, max_length=SEQ)([{k: p[k] for k in keys} for p in want])
    rows = pair_rows(got, SEQ, SEQ, pad_id=0)
    width = coll["input_ids"].shape[1]
    assert torch.equal(rows["input_ids"][:, :width], coll["input_ids"])
    assert torch.equal(rows["labels"][:, :width], coll["input_ids"].masked_fill(coll["completion_mask"] == 0, -100))
    assert (rows["labels"][:, width:] == -100).all()
    assert int(coll["attention_mask"][1].sum()) == SEQ  # the long pair was cut at max_length


def trl_run(model_dir: str, recs: list[dict], out: str) -> tuple[list[dict], torch.nn.Module]:
    """Plain TRL 1.16 DPOTrainer on one process, reading the pairs in the given order."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the run's order (the test reorders the records)
            return SequentialSampler(self.train_dataset)

    args = DPOConfig(output_dir=out, per_device_train_batch_size=PAIRS_PER_MICRO, gradient_accumulation_steps=GAS,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch", bf16=False, fp16=False, use_cpu=True,
                     logging_steps=1, save_strategy="no", report_to=[], max_length=SEQ, beta=0.1, seed=3,
                     dataloader_drop_last=True, disable_tqdm=True)
    trainer = InOrder(model=model_dir, args=args, train_dataset=Dataset.from_list(recs))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], trainer.model


def test_a_preference_file_trains_through_the_launcher_as_trl(model_dir: str, tmp_path: pytest.TempPathFactory) -> None:
    from launcher_utils import train_in_process
    from transformers import AutoModelForCausalLM

    from ds_mp.data.preference import pair_order

    recs = records(STEPS * GAS * PAIRS_PER_MICRO + 3, chat=False, seed=5)
    data = os.path.join(str(tmp_path), "prefs.jsonl")
    with open(data, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    out = os.path.join(str(tmp_path), "run")
    cfg = {"train_micro_batch_size_per_gpu": 2 * PAIRS_PER_MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
           "gradient_clipping": 0.0, "steps_per_print": 10**6,
           "ds_mp": {"model": model_dir, "pipeline": {"stages": 2}, "data": {"path": data, "seq_len": SEQ, "seed": 3},
                     "loss": {"type": "dpo", "beta": 0.1},
                     "training": {"steps": STEPS, "log_interval": 1, "output_dir": out}}}
    dp2 = {**cfg, "gradient_accumulation_steps": GAS // 2, "ds_mp": {**cfg["ds_mp"], "pipeline": {"stages": 1}}}
    printed = train_in_process(str(tmp_path), dp2, 2, args=("--steps", "2"))  # DP 2: the same pairs a step
    assert f"{len(recs)} pairs (0 dropped" in printed[0]
    train_in_process(str(tmp_path), cfg, 2, args=("--resume",))  # the third step at PP 2 (1F1B)
    assert {"step2", "step3"} <= set(os.listdir(os.path.join(out, "checkpoints")))
    with open(os.path.join(out, "dpo_log.jsonl")) as fh:
        got = [json.loads(line) for line in fh]
    order = [int(i) for s in range(STEPS) for i in pair_order(len(recs), s, PAIRS_PER_MICRO, GAS, 1, 3).ravel()]
    want, trl_model = trl_run(model_dir, [recs[i] for i in order], os.path.join(str(tmp_path), "trl"))
    assert len(got) == len(want) == STEPS
    assert got[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected"):
            assert g[key] == pytest.approx(w[key], abs=1e-5), key
    assert got[-1]["loss"] != pytest.approx(got[0]["loss"], abs=1e-4)  # it trained
    ours = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).state_dict()
    for name, value in trl_model.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-5, msg=name)
