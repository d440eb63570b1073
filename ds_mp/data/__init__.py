"""Data for ds_mp: tokenizer training, pre-encoded token files, samplers.

Typical use::

    path = prepare_data(["corpus/"], "data/ds").path        # or ensure_default_dataset(cache)
    train = ChunkSampler(TokenDataset(path), seq_len=1024, micro_batch=4, grad_accum=8,
                         dp_rank=dp_rank, dp_size=dp_size, seed=1234)
    engine.train_batch(data_iter=train)                      # next() once per micro-batch
    val = ValidationBatches(TokenDataset(path, "val"), 1024, 4, num_batches=8, dp_rank=dp_rank, dp_size=dp_size)

SFT (chat, prompt/completion, text records with a loss mask; docs/sft.md)::

    prepare_sft_data(["chats.jsonl"], "data/sft", tokenizer="ckpt/", fmt="chat")
    train, val, report = training_batches(cfg, TokenDataset(path), TokenDataset(path, "val"), ...)
"""
from .cli import prepare_data_cli
from .corpus import Corpus, find_files
from .dataset import Batch, ChunkSampler, TokenDataset, ValidationBatches
from .default_corpus import DEFAULT_CACHE_DIR, DEFAULT_MAX_BYTES, datasets_for, ensure_default_dataset, stdlib_files
from .errors import DataError
from .prepare import DatasetInfo, prepare_data
from .sft import SftDataset, SftRows, SftSampler, StepTokens, step_tokens
from .training_data import training_batches
from .sft_prepare import prepare_sft_data
from .tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer

__all__ = [
    "Batch", "ChunkSampler", "Corpus", "DataError", "DatasetInfo", "DEFAULT_CACHE_DIR", "DEFAULT_MAX_BYTES",
    "EOS_TOKEN", "TokenDataset", "ValidationBatches", "datasets_for", "ensure_default_dataset", "find_files", "load_tokenizer",
    "prepare_data", "prepare_data_cli", "prepare_sft_data", "SftDataset", "SftRows", "SftSampler", "StepTokens",
    "stdlib_files", "step_tokens", "train_tokenizer", "training_batches",
]
