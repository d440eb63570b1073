"""The input check of the first stage: token ids inside the model's vocabulary.

An id outside ``[0, vocab_size)`` never reaches the embedding: the vocab-parallel lookup at
TP >= 2 would give it a zero row on every rank (a silent zero input), and at TP = 1
``F.embedding`` would fail with an index error that names no data.  The training loop refuses
such token files when it opens them (:mod:`ds_mp.data.checks`); this check covers every other
source of batches (a user's own iterator, generation, evaluation).

Cost: one ``aminmax`` over the (B, T) ids and one device-to-host copy of two integers per
micro-batch on the first stage (a host sync on an accelerator, where the ids have just been
copied to the device anyway).
"""
from __future__ import annotations

import torch



class TokenIdError(ValueError):
    """A batch holds a token id outside the model's vocabulary (one-line message)."""


def check_input_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise :class:`TokenIdError` (one line) if an id of ``ids`` lies outside
    ``[0, vocab_size)``; the same ids on every TP rank, so every TP rank raises alike."""
    if ids.numel() == 0 or ids.is_floating_point():
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise TokenIdError(f"input ids hold token id {bad}, outside the model's vocabulary [0, {vocab_size}): the "
                        "batch was encoded for another vocabulary; re-encode the data with the model's tokenizer "
                        "(ds-mp prepare-data --tokenizer MODEL_DIR) or raise ds_mp.model.vocab_size")
