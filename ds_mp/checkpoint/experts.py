"""The Hub's per-expert keys read as transformers 5's fused expert tensors, shard by shard.

A checkpoint on the Hub stores each expert's projections apart (Qwen's
``mlp.experts.<e>.{gate,up,down}_proj.weight``, Mixtral's ``experts.<e>.{w1,w3,w2}.weight``);
transformers 5 trains ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (expert e's rows ``[0, I)`` its gate,
``[I, 2I)`` its up projection) and ``mlp.experts.down_proj`` ``(E, H, I)``, and fuses them on load
(``conversion_mapping``).  :class:`FusedExperts` is that fusion as a reader: the fused tensor's
index range along any dim it is cut by (``experts``: dim 0, ``experts_gate_up``: dim 1,
``experts_down``: dim 2) is read straight from the per-expert tensors' rows or columns, so a rank
reads only its shard (whole experts, or its slice of every expert).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

#: read(source, key, dim, lo, hi, out): the stored tensor ``key``'s index range [lo, hi) along ``dim`` into ``out``
KeyReader = Callable[[Any, str, int, int, int, torch.Tensor], None]


class FusedExperts:
    """Fused expert tensors assembled from per-expert keys (module docstring)."""

    def __init__(self, read_key: KeyReader, dtype_of: Callable[[Any, str], torch.dtype]) -> None:
        self.read_key, self.key_dtype = read_key, dtype_of
        self.parts: dict[str, dict[tuple[int, str], tuple[Any, str, tuple[int, ...]]]] = {}

    def add(self, fused: str, expert: int, part: str, source: Any, key: str, shape: tuple[int, ...]) -> None:
        """Record that ``part`` ("gate"|"up"|"down") of ``expert`` of the fused tensor ``fused`` is ``key``."""
        self.parts.setdefault(fused, {})[(expert, part)] = (source, key, shape)

    def names(self) -> list[str]:
        return list(self.parts)

    def shape(self, fused: str) -> tuple[int, ...]:
        """The fused shape (E, 2I, H) or (E, H, I); the experts and halves must all be present and agree."""
        parts = self.parts[fused]
        experts = sorted({e for e, _ in parts})
        kinds = ("down",) if fused.endswith("down_proj") else ("gate", "up")
        if experts != list(range(len(experts))) or any((e, k) not in parts for e in experts for k in kinds):
            raise ValueError(f"{fused}: the per-expert keys are incomplete (experts {experts[:8]}…, parts {kinds})")
        shapes = {parts[(e, k)][2] for e in experts for k in kinds}
        if len(shapes) != 1:
            raise ValueError(f"{fused}: the per-expert tensors differ in shape: {sorted(shapes)}")
        rows, cols = shapes.pop()
        return (len(experts), rows, cols) if kinds == ("down",) else (len(experts), 2 * rows, cols)

    def read(self, fused: str, dim: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """The fused tensor's range [lo, hi) along ``dim`` into ``out``."""
        E, rows, cols = self.shape(fused)
        down = fused.endswith("down_proj")
        if dim == 0:
            for e in range(lo, hi):
                self._expert(fused, e, down, rows, 0, rows, out[e - lo])
            return
        for e in range(E):
            if dim == 1:
                self._expert(fused, e, down, rows, lo, hi, out[e])
            else:  # columns of every row of the expert
                for part in (("down",) if down else ("gate", "up")):
                    source, key, (r, _) = self.parts[fused][(e, part)]
                    at = 0 if part in ("down", "gate") else r
                    self.read_key(source, key, 1, lo, hi, out[e, at:at + r])

    def _expert(self, fused: str, e: int, down: bool, rows: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """Rows [lo, hi) of expert e's (2I, H) = [gate; up] (or (H, I) down) into ``out``."""
        if down:
            source, key, _ = self.parts[fused][(e, "down")]
            self.read_key(source, key, 0, lo, hi, out)
            return
        half = rows // 2
        for part, base in (("gate", 0), ("up", half)):
            a, b = max(lo, base), min(hi, base + half)
            if b > a:
                source, key, _ = self.parts[fused][(e, part)]
                self.read_key(source, key, 0, a - base, b - base, out[a - lo:b - lo])

    def full(self, fused: str) -> torch.Tensor:
        shape = self.shape(fused)
        out = torch.empty(shape, dtype=self.dtype_of(fused))
        self.read(fused, 0, 0, shape[0], out)
        return out

    def dtype_of(self, fused: str) -> torch.dtype:
        source, key, _ = next(iter(self.parts[fused].values()))
        return self.key_dtype(source, key)


__all__ = ["FusedExperts", "KeyReader"]
