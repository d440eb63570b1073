"""SFT end to end (``launch/finetune.py``'s loop on 4 in-process ranks): a chat JSONL fine-tunes a tiny
GPT-2 and a tiny Qwen2-shaped checkpoint (full and LoRA) at TP=2 x PP=2 with the loss on assistant
tokens only, and a packed run resumed mid-epoch at another layout continues exactly.  In-process
(``train_in_process``): the launcher adds nothing these check; docs/sft.md's SFT commands run
through the real ``deepspeed`` launcher in test_docs.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from launcher_utils import REPO, read_log, train_in_process

from ds_mp.data import SftDataset, SftRows, SftSampler, TokenDataset, prepare_sft_data
from sft_utils import chat_tokenizer, conversations, write_jsonl

pytestmark = pytest.mark.timeout(900)
SEQ = 128
QWEN_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Tokenizer with ChatML, a chat dataset from a JSONL, and tiny GPT-2 / Qwen2 checkpoints using it."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    root = str(tmp_path_factory.mktemp("sft_launch"))
    tok = chat_tokenizer(os.path.join(root, "tok"))
    src = write_jsonl(os.path.join(root, "chats.jsonl"), [{"messages": m} for m in conversations(45, seed=7, words=6)])
    data = prepare_sft_data([src], os.path.join(root, "data"), os.path.join(root, "tok"), "chat",
                            val_fraction=0.1, show_progress=False).path
    torch.manual_seed(0)
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_layer=2, n_embd=32, n_head=4, n_positions=SEQ,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                              max_position_embeddings=SEQ, tie_word_embeddings=False,
                                              bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)),
    }
    for name, m in models.items():
        m.save_pretrained(os.path.join(root, name))
        tok.save_pretrained(os.path.join(root, name))
    return {"root": root, "data": data}


def sft_config(out: str, data: str, *, lora: bool, family: str, steps: int, tp: int = 2, pp: int = 2) -> dict:
    """A shipped SFT recipe (ds_configs/sft_*.json) shrunk to a tiny run."""
    with open(os.path.join(REPO, "ds_configs", "sft_lora_tp2_pp2.json" if lora else "sft_tp2_pp2.json")) as f:
        cfg = json.load(f)
    block = cfg["ds_mp"]
    block["tensor_parallel"]["size"], block["pipeline"]["stages"] = tp, pp
    if tp * pp == 2:  # the same global batch of 8 rows on 4 ranks: DP = 2
        cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 2
    block["data"].update(path=data, seq_len=SEQ)
    block["training"].update(steps=steps, log_interval=1, eval_interval=2, eval_batches=1, checkpoint_interval=2,
                             output_dir=os.path.join(out, "run"), export_hf=False)
    if lora and family == "qwen2":
        block["lora"]["target_modules"] = QWEN_LORA
    return cfg


def hf_first_step_loss(model_dir: str, data: str, cfg: dict) -> tuple[float, float]:
    """Outside oracle: the unmodified HF model on each document of step 1 alone, unpacked and unpadded.
    Returns (sum of target-token losses / targets, the same over every token: what a mask-blind loss is)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = SftRows(SftDataset(TokenDataset(data)), SEQ, packing=True, overlong="truncate", seed=1234)
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    dp = 4 // (cfg["ds_mp"]["tensor_parallel"]["size"] * cfg["ds_mp"]["pipeline"]["stages"])
    total = count = total_all = count_all = 0.0
    for rank in range(dp):
        for (ids, pos), labels in SftSampler(rows, micro, gas, rank, dp, seed=1234).next_step():
            for b in range(len(ids)):
                starts = [*torch.nonzero(pos[b] == 0).flatten().tolist(), SEQ]
                for s, e in zip(starts[:-1], starts[1:]):
                    if (labels[b, s:e] != -100).any():
                        with torch.no_grad():
                            logits = model(ids[b:b + 1, s:e]).logits[0, :-1]
                        total += float(F.cross_entropy(logits, labels[b, s + 1:e], ignore_index=-100, reduction="sum"))
                        count += int((labels[b, s + 1:e] != -100).sum())
                        total_all += float(F.cross_entropy(logits, ids[b, s + 1:e], reduction="sum"))
                        count_all += e - s - 1
    return total / count, total_all / count_all


@pytest.mark.parametrize("family,lora", [("gpt2", False), ("qwen2", True), ("gpt2", True), ("qwen2", False)])
def test_chat_finetune(world, tmp_path, family, lora):
    cfg = sft_config(str(tmp_path), world["data"], lora=lora, family=family, steps=2)
    model = os.path.join(world["root"], family)
    stdout = train_in_process(str(tmp_path), cfg, n=4, args=("--model", model), timeout=600)
    assert f"ds_mp: SFT data: {{'documents': {TokenDataset(world['data']).info.train_documents}," in stdout[0]
    rows = read_log(os.path.join(str(tmp_path), "run"))
    assert [int(r["step"]) for r in rows] == [1, 2] and rows[1]["val_loss"]
    want, mask_blind = hf_first_step_loss(model, world["data"], cfg)
    assert abs(float(rows[0]["loss"]) - want) < 2e-5 and abs(want - mask_blind) > 1e-2
    assert int(rows[0]["target_tokens"]) > 0 and int(rows[0]["padding_tokens"]) >= 0


def test_packed_sft_resumes_mid_epoch_at_another_layout(world, tmp_path):
    """TP=2 x PP=2 for 4 steps (the epoch of rows ends inside step 3) vs 2 steps there, then --resume at
    TP=1 x PP=2 x DP=2 with the same global batch: steps 3-4 repeat the uninterrupted losses."""
    model = os.path.join(world["root"], "gpt2")
    full, part = os.path.join(str(tmp_path), "full"), os.path.join(str(tmp_path), "part")
    os.makedirs(full)
    cfg = sft_config(full, world["data"], lora=False, family="gpt2", steps=4)
    cfg["ds_mp"]["training"]["eval_interval"] = 0
    train_in_process(full, cfg, n=4, args=("--model", model), timeout=600)
    want = [float(r["loss"]) for r in read_log(os.path.join(full, "run"))]
    os.makedirs(os.path.join(part, "run", "checkpoints"))
    shutil.copytree(os.path.join(full, "run", "checkpoints", "step2"), os.path.join(part, "run", "checkpoints", "step2"))
    with open(os.path.join(part, "run", "checkpoints", "latest"), "w") as f:
        f.write("step2")
    rows_per_epoch = SftRows(SftDataset(TokenDataset(world["data"])), SEQ, seed=1234).num_chunks(SEQ)
    assert 2 * 8 < rows_per_epoch < 3 * 8  # the resumed steps cross the epoch boundary
    cfg = sft_config(part, world["data"], lora=False, family="gpt2", steps=4, tp=1, pp=2)
    cfg["ds_mp"]["training"]["eval_interval"] = 0
    train_in_process(part, cfg, n=4, args=("--model", model, "--resume"), timeout=600)
    got = [float(r["loss"]) for r in read_log(os.path.join(part, "run"))]
    assert len(got) == 2 and all(abs(a - b) < 5e-5 for a, b in zip(got, want[2:])), (got, want)
