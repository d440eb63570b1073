"""Test data for supervised fine-tuning: documents with prompt masks, packed into rows the way
ds_mp's SFT sampler packs them (``((input_ids, position_ids), labels)``), a padding document in
each row's tail; and the HF oracle that runs every document on its own."""
from __future__ import annotations

import copy
from typing import Any

import torch

Doc = tuple[torch.Tensor, torch.Tensor]  # (ids (n,), labels (n,)): -100 on the prompt and the first token


def documents(n: int, vocab: int, seed: int, lengths: tuple[int, int] = (2, 11)) -> list[Doc]:
    """``n`` documents of random lengths; a random prompt prefix (and the first token) is not a target."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[:int(torch.randint(1, length + 1, (1,), generator=g))] = -100
        out.append((ids, labels))
    return out


def pack(docs: list[Doc], rows: int, seq: int) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor],
                                                         list[Doc]]:
    """``docs`` first-fit into ``rows`` rows of ``seq`` tokens (those that fit nowhere are left out),
    each row's tail a padding document (id 0, its own positions from 0, labels -100).  Returns the
    micro-batch ``((ids, position_ids), labels)`` and the documents it holds."""
    ids = torch.zeros(rows, seq, dtype=torch.long)
    pos = torch.zeros(rows, seq, dtype=torch.long)
    labels = torch.full((rows, seq), -100, dtype=torch.long)
    used, kept = [0] * rows, []
    for d_ids, d_labels in docs:
        n = len(d_ids)
        r = next((r for r in range(rows) if used[r] + n <= seq), None)
        if r is None:
            continue
        t = used[r]
        ids[r, t:t + n], labels[r, t:t + n], pos[r, t:t + n] = d_ids, d_labels, torch.arange(n)
        used[r] += n
        kept.append((d_ids, d_labels))
    for row, t in enumerate(used):  # the padding document of each tail restarts at 0
        pos[row, t:] = torch.arange(seq - t)
    return ((ids, pos), labels), kept


def micro_batches(n: int, rows: int, seq: int, vocab: int, seed: int) -> tuple[list, list[Doc]]:
    """``n`` packed micro-batches (different target counts each) and every document they hold."""
    out, docs = [], []
    for i in range(n):
        mb, kept = pack(documents(2 + 3 * i % 5, vocab, seed * 100 + i, lengths=(2, seq // 2)), rows, seq)
        out.append(mb)
        docs += kept
    return out, docs


def targets(docs: list[Doc]) -> int:
    return sum(int((labels[1:] != -100).sum()) for _, labels in docs)


def hf_per_document(model: Any, steps: list[list[Doc]], lr: float) -> tuple[list[float], dict]:
    """The oracle: one process, each document alone (unpacked, unpadded); a step's loss = the sum of
    HF's token losses over its documents / its target count; SGD.  Returns losses and weights."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for docs in steps:
        opt.zero_grad()
        n, total = targets(docs), 0.0
        for ids, labels in docs:
            k = int((labels[1:] != -100).sum())
            if k:
                loss = model(input_ids=ids[None], labels=labels[None]).loss * (k / n)
                loss.backward()
                total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def padded(n: int, rows: int, seq: int, vocab: int, seed: int, side: str) -> list[dict]:
    """``n`` dict micro-batches of one document per row, padded on ``side`` ("left"/"right") with an
    ``attention_mask``; labels -100 on the padding and a random prompt."""
    out = []
    for i in range(n):
        docs = documents(rows, vocab, seed * 100 + i, lengths=(2, seq))
        ids = torch.zeros(rows, seq, dtype=torch.long)
        labels = torch.full((rows, seq), -100, dtype=torch.long)
        mask = torch.zeros(rows, seq, dtype=torch.long)
        for r, (d_ids, d_labels) in enumerate(docs):
            cut = slice(0, len(d_ids)) if side == "right" else slice(seq - len(d_ids), seq)
            ids[r, cut], labels[r, cut], mask[r, cut] = d_ids, d_labels, 1
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def hf_masked(model: Any, steps: list[list[dict]], lr: float) -> tuple[list[float], dict]:
    """The oracle for padded batches: HF with each micro-batch's ``attention_mask``, per-token loss
    over the step (each micro-batch's HF mean × its target count / the step's), SGD."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for mbs in steps:
        opt.zero_grad()
        counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs]
        total = 0.0
        for mb, k in zip(mbs, counts):
            if k:
                loss = model(**mb).loss * (k / sum(counts))
                loss.backward()
                total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
