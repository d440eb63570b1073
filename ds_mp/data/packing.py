"""Packing documents into rows of a fixed length: best-fit decreasing, deterministic.

Pure functions over document lengths (no tokens), so the plan is cheap and testable alone.

Best-fit decreasing (BFD): documents are taken longest first (equal lengths in a seeded
random order) and each goes into the open row whose free space is the smallest that still
holds it, or into a new row when none does. A document is never split and every row holds
at most ``capacity`` tokens. BFD's worst case is about 11/9 of the fewest rows possible
(Johnson 1973); on SFT length distributions (many short documents) rows come out nearly full. The number of rows depends
only on the multiset of lengths, not on the seed.
"""
from __future__ import annotations

import numpy as np


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int = 0) -> list[np.ndarray]:
    """Rows (arrays of document indices, in the order placed) packing ``lengths`` into ``capacity``.

    Contract: every index appears in exactly one row; a row's lengths sum to <= ``capacity``;
    each document went to the fullest row that could take it at its turn; the result is a
    function of (lengths, capacity, seed). Raises ValueError for a length outside [1, capacity].
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"document lengths must be in [1, {capacity}]; got [{lengths.min()}, {lengths.max()}]")
    shuffled = np.random.default_rng(seed).permutation(len(lengths))
    order = shuffled[np.argsort(-lengths[shuffled], kind="stable")]
    rows: list[list[int]] = []
    free = np.zeros(capacity + 1, dtype=np.int64)  # free[r] = number of open rows with r free tokens
    by_free: list[list[int]] = [[] for _ in range(capacity + 1)]  # row ids with that much free space
    for doc in order.tolist():
        n = int(lengths[doc])
        fits = np.flatnonzero(free[n:])
        if len(fits):
            r = n + int(fits[0])
            row = by_free[r].pop()
            free[r] -= 1
        else:
            r, row = capacity, len(rows)
            rows.append([])
        rows[row].append(doc)
        left = r - n
        if left:
            by_free[left].append(row)
            free[left] += 1
    return [np.asarray(r, dtype=np.int64) for r in rows]


def one_per_row(num_documents: int) -> list[np.ndarray]:
    """Packing off: document d alone in row d (padded by the reader)."""
    return [np.array([d], dtype=np.int64) for d in range(num_documents)]
