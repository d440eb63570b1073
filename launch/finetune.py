"""Fine-tune a pretrained Hugging Face GPT-2 (a directory or a Hub id such as ``gpt2``) with ds_mp.

    ds-mp prepare-data my_corpus/ --tokenizer path/to/gpt2 --out data/mine
    deepspeed --num_gpus 2 launch/finetune.py --model path/to/gpt2 --data data/mine \
        --deepspeed_config ds_configs/finetune_tp2.json

Supervised fine-tuning on chat / prompt-completion data (loss on the answers, packed rows;
docs/sft.md) is the same command on an SFT dataset::

    ds-mp prepare-data chats.jsonl --format chat --tokenizer path/to/ckpt --out data/chat
    deepspeed --num_gpus 4 launch/finetune.py --model path/to/ckpt --data data/chat \
        --deepspeed_config ds_configs/sft_tp2_pp2.json

Loads the HF weights straight into the parallel layout (each rank reads only its own
shards), trains, evaluates, and writes an HF directory to <output_dir>/hf that
``GPT2LMHeadModel.from_pretrained`` and ``generate()`` accept.
"""
import sys

from ds_mp.engine.initialize import shutdown_distributed
from ds_mp.training.loop import main

if __name__ == "__main__":
    if "--model" not in sys.argv:
        sys.exit("launch/finetune.py: pass --model <HF GPT-2 directory or Hub id> (use launch/train.py to train from scratch)")
    code = main()
    shutdown_distributed(clean=code == 0)
    sys.exit(code)
