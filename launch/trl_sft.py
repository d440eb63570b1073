"""Supervised fine-tuning with TRL's SFTTrainer on chat data: an ordinary TRL script whose only ds_mp
line is the import (``from trl import SFTTrainer`` runs it without ds_mp).  The layout (TP × PP, the
schedule) comes from the ``"ds_mp"`` block of the DeepSpeed JSON; world = TP × PP × DP.

    deepspeed --num_gpus 4 launch/trl_sft.py --deepspeed ds_configs/trainer_tp2_pp2.json --output_dir runs/trl_sft
    accelerate launch --num_processes 4 --use_deepspeed --deepspeed_config_file ds_configs/trainer_tp2_pp2.json \\
        launch/trl_sft.py --deepspeed ds_configs/trainer_tp2_pp2.json --output_dir runs/trl_sft
    torchrun --nproc_per_node 4 launch/trl_sft.py --deepspeed ds_configs/trainer_tp2_pp2.json --output_dir runs/trl_sft

Add ``--bf16 false`` where the machine has no bf16 (CPU: TRL defaults it on).  Without
``--model_name_or_path`` / ``--dataset_path`` it builds, in memory and alike on every rank, a tiny
Qwen2-shaped model (``--tiny gpt2``: GPT-2), a byte-level BPE tokenizer with a ChatML template that
marks the assistant's turns with ``{% generation %}``, and chats of uneven length: the CI run.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig

from ds_mp.hf import SFTTrainer

CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{- '\\n' }}{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ["add", "the", "numbers", "def", "return", "x", "+", "y", "(", ")", ":", "why", "is", "sky", "blue",
         "print", "list", "sorted", "42", "?", "."]


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = None  # an HF checkpoint directory or Hub id; None: the tiny model
    dataset_path: str | None = None  # a JSONL of {"messages": [...]} records; None: the tiny chats
    tiny: str = "qwen2"  # the built-in model: "qwen2" or "gpt2"
    eval_fraction: float = 0.2  # the held-out share of the records
    lora_r: int = 0  # > 0: train a LoRA adapter of this rank (alpha = 2 r) on the attention and MLP


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tiny_chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chats: an optional system turn, 1-3 user/assistant exchanges of uneven length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 3)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": sentence(rng, rng.randint(2, 8))},
                     {"role": "assistant", "content": sentence(rng, rng.randint(1, 14))}]
        out.append({"messages": msgs})
    return out


def tiny_tokenizer(vocab: int = 320) -> Any:
    """A byte-level BPE over :data:`WORDS` with ChatML's tokens and template (eos ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([sentence(rng, 30) for _ in range(200)], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    return tok


def tiny_model(kind: str, vocab: int) -> Any:
    """A 4-layer model of ``kind`` with dropout 0, the same weights on every rank (seeded)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=vocab, n_positions=128,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=vocab,
                                        max_position_embeddings=128, tie_word_embeddings=False))


def main(argv: list[str] | None = None, trainer_class: Any = SFTTrainer) -> Any:
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses(argv)
    if script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    else:
        tokenizer = tiny_tokenizer()
        model = tiny_model(script.tiny, len(tokenizer))
    if script.dataset_path:
        records = load_dataset("json", data_files=script.dataset_path, split="train")
    else:
        records = Dataset.from_list(tiny_chats(60))
    split = records.train_test_split(test_size=script.eval_fraction, shuffle=False)
    peft_config = None
    if script.lora_r:
        from peft import LoraConfig

        targets = ["c_attn", "c_proj", "c_fc"] if model.config.model_type == "gpt2" else \
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, lora_dropout=0.0,
                                 target_modules=targets, task_type="CAUSAL_LM")
    trainer = trainer_class(model=model, args=args, train_dataset=split["train"], eval_dataset=split["test"],
                            processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_model()
    return trainer


if __name__ == "__main__":
    main()
