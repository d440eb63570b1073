"""Padding-free flattened micro-batches (TRL ``packing=True``, transformers' ``DataCollatorWithFlattening``)
re-formed into ds_mp's fixed rows: against the unmodified HF model run on each document alone (the
outside oracle), the re-formed rows train to the same per-token losses and weights (fp32, 1e-5), and
the target count is the flattened row's."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config, tiny_gpt2
from sft_data import documents, hf_per_document

V, SEQ, ROWS, GAS, LR, TOL = 203, 16, 2, 2, 0.1, 1e-5


def flattening_batches(steps: int, seed: int) -> tuple[list[list[dict]], list[list]]:
    """``steps`` × ``GAS`` micro-batches, each ``ROWS`` uneven documents with prompt masks flattened by
    transformers' ``DataCollatorWithFlattening`` (with its flash-attention and seq_idx keys), and each
    step's documents for the oracle."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    out, docs = [], []
    for s in range(steps):
        mbs, held = [], []
        for k in range(GAS):
            batch = documents(ROWS, V, seed * 100 + s * 10 + k, lengths=(3, SEQ))
            mbs.append(collate([{"input_ids": ids.tolist(), "labels": labels.tolist()} for ids, labels in batch]))
            held += batch
        out.append(mbs)
        docs.append(held)
    return out, docs


def trl_packed_batch() -> dict:
    """What TRL's padding-free collator emits for two best-fit packed sequences (``seq_lengths``) of
    ``max_length`` 12: five documents in one row, a prompt-only document among them, padded to a
    multiple of 8 (one-token documents)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=8)
    g = torch.Generator().manual_seed(5)
    seqs = [[5, 4, 3], [6, 5]]
    examples = []
    for lengths in seqs:
        ids = torch.randint(1, V, (sum(lengths),), generator=g)
        labels = ids.clone()
        labels[:2] = -100  # a prompt
        labels[lengths[0]:lengths[0] + lengths[1]] = -100  # a prompt-only document
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "seq_lengths": lengths})
    return collate(examples)


def test_trl_padding_free_batch_reforms_exactly() -> None:
    from ds_mp.data.flatten import unflatten

    flat = trl_packed_batch()
    assert flat["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in flat and "seq_idx" in flat
    rows = unflatten(flat, rows=2, seq_len=12)
    assert rows["input_ids"].shape == (2, 12)
    count = int((flat["labels"][..., 1:] != -100).sum())
    assert int((rows["labels"][..., 1:] != -100).sum()) == count > 0
    # every document with a target is kept whole, in order, its positions from 0
    pos = flat["position_ids"][0]
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    kept = [(flat["input_ids"][0, s:e], flat["labels"][0, s:e]) for s, e in zip(starts, starts[1:])
            if bool((flat["labels"][0, s + 1:e] != -100).any())]
    got = []
    for r in range(2):
        p = rows["position_ids"][r]
        rs = torch.nonzero(p == 0).flatten().tolist() + [12]
        got += [(rows["input_ids"][r, s:e], rows["labels"][r, s:e]) for s, e in zip(rs, rs[1:])
                if bool((rows["labels"][r, s + 1:e] != -100).any())]
    assert len(got) == len(kept) and all(torch.equal(a[0], b[0]) and torch.equal(a[1][1:], b[1][1:])
                                         for a, b in zip(got, kept))


@pytest.mark.parametrize("change, rows, seq, words", [
    (lambda b: b, 1, 12, "need 2 rows of seq_len 12, the run has 1"),
    (lambda b: b, 2, 5, "a document of 6 tokens exceeds ds_mp.data.seq_len = 5"),
    (lambda b: {**b, "cu_seq_lens_q": b["cu_seq_lens_q"][:-1]}, 2, 12, "cu_seq_lens_q disagrees"),
    (lambda b: {**b, "token_type_ids": b["input_ids"]}, 2, 12, "'token_type_ids' is not used"),
    (lambda b: {**b, "labels": b["input_ids"].clone()}, 2, 12, "a target at a document's first token"),
    (lambda b: {**b, "position_ids": b["position_ids"] + 1}, 2, 12, "must start at 0"),
])
def test_flattened_batches_ds_mp_cannot_run_exactly_are_refused(change, rows, seq, words) -> None:
    from ds_mp.data.flatten import unflatten

    with pytest.raises(ValueError, match=words) as err:
        unflatten(change(trl_packed_batch()), rows=rows, seq_len=seq)
    assert "\n" not in str(err.value)


def _rank(rank: int, steps: list[list[dict]]) -> tuple[float, list[float], dict, list[str]]:
    import ds_mp
    from ds_mp.data.flatten import unflatten_all
    from test_tensor_parallel import gather_weights

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=V), config=ds_config(micro=ROWS, gas=GAS, lr=LR, seq=SEQ))
    evaluated = float(engine.eval_batch(unflatten_all(iter(steps[0]), ROWS, SEQ)))
    losses = [float(engine.train_batch(unflatten_all(iter(step), ROWS, SEQ))) for step in steps]
    refusals = []
    for keep in (None, ("input_ids", "labels", "position_ids")):  # as the collator gives them, by default
        raw = [{k: v for k, v in mb.items() if keep is None or k in keep} for mb in steps[0]]
        try:
            engine.train_batch(iter(raw))
        except ValueError as err:
            refusals.append(str(err))
    return evaluated, losses, gather_weights(engine)[0], refusals


def test_flattened_batches_train_as_hf_per_document() -> None:
    """docs/batches.md's two lines: ``engine.train_batch(unflatten_all(loader, rows, seq_len))``."""
    from test_tensor_parallel import max_diff

    steps, docs = flattening_batches(3, seed=4)
    evaluated, losses, weights, refusals = run_ranks(_rank, 1, steps, timeout=300)[0]
    # given to train_batch as they are, flattened batches are refused with the line that says what fits them
    assert len(refusals) == 2 and all("unflatten_all" in r and "\n" not in r for r in refusals), refusals
    ref_losses, ref_weights = hf_per_document(tiny_gpt2(vocab=V), docs, LR)
    assert abs(evaluated - ref_losses[0]) <= TOL, (evaluated, ref_losses[0])
    assert all(abs(a - b) <= TOL for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert max_diff(weights, ref_weights) <= TOL
