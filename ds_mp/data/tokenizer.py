"""Byte-level BPE tokenizers: train one from text, or load one from an HF directory.

A trained tokenizer is GPT-2 style: byte-level pre-tokenizer and decoder (every byte
string is encodable, decoding is exact), a single special token ``<|endoftext|>`` with
id 0 that serves as eos, bos and unk. It is saved with ``save_pretrained`` so
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:  # transformers is imported lazily: it costs seconds and readers don't need it
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .errors import DataError

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # 256 byte symbols + <|endoftext|>


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | None = None,
    length: int | None = None,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (one string per document).

    Contract: the result has exactly ``vocab_size`` entries when the corpus has enough
    distinct merges (fewer otherwise), ``<|endoftext|>`` has id 0 and is the eos token,
    and ``decode(encode(s)) == s`` for every string. If ``out_dir`` is given the tokenizer
    is saved there with ``save_pretrained``. ``length`` (number of texts) only feeds the
    progress bar.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least {MIN_VOCAB_SIZE}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        hf.save_pretrained(out_dir)
    return hf


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of an HF checkpoint or tokenizer directory.

    Contract: the result is a fast tokenizer with an eos token; raises :class:`DataError`
    otherwise (missing directory, slow-only tokenizer, no eos token).
    """
    if not os.path.isdir(path):
        raise DataError(f"tokenizer directory {path!r} does not exist; pass an HF checkpoint directory")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot load a tokenizer from {path!r} ({first}); pass an HF checkpoint directory") from e
    if not getattr(tok, "is_fast", False):
        raise DataError(f"tokenizer in {path!r} is not a fast tokenizer; save it with tokenizer.json")
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer in {path!r} has no eos_token; set eos_token in its tokenizer_config.json")
    return tok


def data_encoder(tok: PreTrainedTokenizerBase) -> Tokenizer:
    """A copy of ``tok``'s backend for encoding corpus documents.

    Contract: no padding, no truncation, no added special tokens, and special-token text
    inside a document (e.g. a literal ``<|endoftext|>``) is encoded as ordinary text, so
    the only eos ids in a token file are the document separators written by ``prepare``.
    """
    enc = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    enc.no_padding()
    enc.no_truncation()
    enc.encode_special_tokens = True
    return enc
