"""TeraPipe's cost models (TeraPipe, ICML 2021, §3.4): t(i, j), the time of a slice of i tokens
after j tokens of context on one stage, fitted from profiled samples, analytic
(:class:`CostModel`) or as measured tables (:class:`TableCostModel`, per batch-slice size
:class:`BatchTableCostModel`); JSON round trip, profiling and the batch-cost adapters the
planner (:mod:`ds_mp.schedules.terapipe.planner`) takes.  Pure functions of their arguments."""
from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

Cost = Callable[[int, int], float]              # t(i, j): slice length i, context j -> seconds
BatchCost = Callable[[int, int, int], float]    # t(b, i, j): same for a batch-slice of b sequences


@dataclass(frozen=True)
class CostModel:
    """t(i, j) = t_fwd_bwd(i) + t_ctx(i, j): one stage's forward+backward of i tokens after j.

    t_fwd_bwd(i) = c0 + c1·i + c2·i²              (the slice alone; c2 is its causal attention)
    t_ctx(i, j)  = [j > 0]·(a0 + a1·i) + a2·j + a3·i·j   (so t_ctx(i, 0) = 0, i.e. t(i, 0) = t_fwd_bwd(i))

    The indicator makes a0, a1 (the fixed/per-token price of having a key/value context at all)
    identifiable next to c0, c1; a2·j is reading the cached context, a3·i·j the attention to it.
    """

    c0: float = 0.0  # per-slice overhead (kernel launches, p2p latency)
    c1: float = 0.0  # per-token cost (the 24·h² dense FLOPs)
    c2: float = 0.0  # per-token² cost (causal self-attention inside the slice)
    a0: float = 0.0  # fixed cost of a non-empty context
    a1: float = 0.0  # per-token cost of a non-empty context
    a2: float = 0.0  # per-context-token cost
    a3: float = 0.0  # per (token × context-token) cost: attention to the context

    def __call__(self, i: int, j: int) -> float:
        has_ctx = 1.0 if j > 0 else 0.0
        return (self.c0 + self.c1 * i + self.c2 * i * i
                + has_ctx * (self.a0 + self.a1 * i) + self.a2 * j + self.a3 * i * j)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "CostModel":
        return cls(**{k: float(v) for k, v in d.items()})

    @property
    def overhead(self) -> float:
        """The per-slice cost that does not grow with the batch-slice's rows."""
        return self.c0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs ascending), extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    k = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # the segment [xs[k-1], xs[k]] (or an end one)
    return ys[k - 1] + (ys[k] - ys[k - 1]) * (x - xs[k - 1]) / (xs[k] - xs[k - 1])


@dataclass(frozen=True)
class TableCostModel:
    """The paper's cost model (TeraPipe §3.3): stage latency of a slice of i tokens after j,

        t(i, j) = t_c(i, 0) + t_p2p(i) + [j > 0]·(a0 + a1·i + a2·j + a3·i·j)

    t_c(i, 0) is a *measured table* of the stage's forward+backward over slice lengths (linear
    interpolation between the measured lengths, linear extrapolation past the ends), so it can
    be flat over a range of i and then rise, or step — what accelerators do and a smooth
    polynomial cannot express; only the context term is fitted.  t_p2p(i) is the measured
    point-to-point time the bottleneck stage spends per slice moving its activations forward
    and their gradients back (``transfer``, at the same lengths; empty = not measured, 0).
    """

    lengths: tuple[int, ...]   # measured slice lengths, ascending
    times: tuple[float, ...]   # t_c(i, 0) at those lengths, seconds (compute)
    a0: float = 0.0            # fixed cost of a non-empty context
    a1: float = 0.0            # per-token cost of a non-empty context
    a2: float = 0.0            # per-context-token cost
    a3: float = 0.0            # per (token × context-token) cost: attention to the context
    transfer: tuple[float, ...] = ()  # t_p2p(i) at ``lengths``, seconds per slice (sends + receives)

    def compute(self, i: int) -> float:
        """t_c(i, 0) from the table."""
        return _interp(self.lengths, self.times, i)

    def p2p(self, i: int) -> float:
        """t_p2p(i): the slice's sends and receives on the bottleneck stage (0 if not measured)."""
        return _interp(self.lengths, self.transfer, i) if self.transfer else 0.0

    def alone(self, i: int) -> float:
        """t(i, 0) = t_c(i, 0) + t_p2p(i)."""
        return self.compute(i) + self.p2p(i)

    def __call__(self, i: int, j: int) -> float:
        extra = (self.a0 + self.a1 * i + self.a2 * j + self.a3 * i * j) if j > 0 else 0.0
        return self.alone(i) + extra

    @property
    def overhead(self) -> float:
        """The intercept of t(i, 0) at i = 0 (the per-slice cost independent of the rows), ≥ 0."""
        return max(0.0, self.alone(0))

    def with_transfer(self, transfer: Sequence[float]) -> "TableCostModel":
        """This model with t_p2p measured at ``self.lengths``."""
        if len(transfer) != len(self.lengths):
            raise ValueError(f"transfer times for {len(transfer)} lengths, the table has {len(self.lengths)}")
        return replace(self, transfer=tuple(float(t) for t in transfer))

    def to_dict(self) -> dict:
        return {"kind": "table", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TableCostModel":
        d = {k: v for k, v in d.items() if k not in ("kind", "meta")}
        return cls(tuple(int(i) for i in d.pop("lengths")), tuple(float(t) for t in d.pop("times")),
                   transfer=tuple(float(t) for t in d.pop("transfer", ())), **{k: float(v) for k, v in d.items()})

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        """JSON of the model; ``meta`` (what was profiled, how long it took) is kept beside it."""
        Path(path).write_text(json.dumps({**self.to_dict(), **({"meta": meta} if meta else {})}, indent=2) + "\n")


def cost_model_meta(path: str | Path) -> dict:
    """The ``meta`` block saved with a cost model ({} when none)."""
    return json.loads(Path(path).read_text()).get("meta", {})


@dataclass(frozen=True)
class BatchTableCostModel:
    """t(b, i, j) measured per batch-slice size (TeraPipe §3.3 runs its token DP for every
    batch-slice size b with that size's own costs): one :class:`TableCostModel` per profiled b.
    Per-row cost is not linear in b on real hardware (a one-row slice runs narrower matmuls), so
    the joint planner is offered only the profiled sizes, each at its measured cost."""

    models: dict[int, TableCostModel]  # rows b -> t(i, j) of a b-row batch-slice

    def __call__(self, b: int, i: int, j: int) -> float:
        return self.models[b](i, j)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.models)

    def to_dict(self) -> dict:
        return {"kind": "batch_table", "models": {str(b): m.to_dict() for b, m in sorted(self.models.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "BatchTableCostModel":
        return cls({int(b): TableCostModel.from_dict(m) for b, m in d["models"].items()})

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        """JSON of the per-size models; ``meta`` (what was profiled, how long it took) beside them."""
        Path(path).write_text(json.dumps({**self.to_dict(), **({"meta": meta} if meta else {})}, indent=2) + "\n")


AnyCostModel = CostModel | TableCostModel | BatchTableCostModel


def cost_model_from_dict(d: dict) -> AnyCostModel:
    """A cost model of any form from its ``to_dict()`` (a ``meta`` entry is ignored)."""
    d = {k: v for k, v in d.items() if k != "meta"}
    kind = d.get("kind")
    if kind == "batch_table":
        return BatchTableCostModel.from_dict(d)
    return TableCostModel.from_dict(d) if kind == "table" else CostModel.from_dict(d)


def load_cost_model(path: str | Path) -> AnyCostModel:
    """A saved cost model of any form."""
    return cost_model_from_dict(json.loads(Path(path).read_text()))


def as_batch_cost(cost: AnyCostModel, B: int) -> tuple[BatchCost, list[int] | None]:
    """(t(b, i, j), the batch-slice sizes it knows) for a micro-batch of B rows: a
    :class:`BatchTableCostModel` gives its measured sizes; a one-size model (profiled at B) is
    scaled linearly (:func:`batch_cost`) and allows every size (None)."""
    if isinstance(cost, BatchTableCostModel):
        return cost, cost.sizes
    return batch_cost(cost, b_ref=B, overhead=cost.overhead), None


def fit_table_cost_model(samples: Sequence[tuple[int, int, float]]) -> tuple[TableCostModel, float]:
    """The paper's fit: t(i, 0) = the measured times at j = 0 (a table), then least squares of the
    rest, t(i, j) − t(i, 0), on [1, i, j, i·j] over the j > 0 samples (relative error, as
    :func:`fit_cost_model`).  Returns (model, mean relative error over all samples)."""
    alone: dict[int, list[float]] = {}
    for i, j, t in samples:
        if j == 0:
            alone.setdefault(i, []).append(t)
    if not alone:
        raise ValueError("a table cost model needs samples with context 0")
    lengths = tuple(sorted(alone))
    table = TableCostModel(lengths, tuple(statistics.median(alone[i]) for i in lengths))
    ctx = [(i, j, t) for i, j, t in samples if j > 0]
    if ctx:
        X = np.array([[1.0, i, j, i * j] for i, j, _ in ctx])
        y = np.array([t - table.compute(i) for i, _, t in ctx])
        w = 1.0 / np.maximum(np.array([t for *_, t in ctx]), 1e-12)
        theta, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
        table = TableCostModel(lengths, table.times, *(float(v) for v in theta))
    err = float(np.mean([abs(table(i, j) - t) / max(t, 1e-12) for i, j, t in samples]))
    return table, err


def _features(i: int, j: int) -> list[float]:
    """Row x(i, j) with t(i, j) = x · [c0, c1, c2, a0, a1, a2, a3]."""
    h = 1.0 if j > 0 else 0.0
    return [1.0, i, i * i, h, h * i, j, i * j]


def fit_cost_model(samples: Sequence[tuple[int, int, float]]) -> tuple[CostModel, float]:
    """Least squares fit of CostModel to (i, j, seconds); returns (model, mean relative error).

    Minimises Σ ((x(i,j)·θ − y) / y)², i.e. relative error, so short slices (small y) weigh as
    much as long ones. Unidentified coefficients (e.g. no j > 0 samples) come out 0 (lstsq
    minimum-norm solution).
    """
    X = np.array([_features(i, j) for i, j, _ in samples], dtype=np.float64)
    y = np.array([s for _, _, s in samples], dtype=np.float64)
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    theta, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    err = float(np.mean(np.abs(X @ theta - y) * w))
    return CostModel(*(float(v) for v in theta)), err


def profile_stage(fn: Callable[[int, int], object], lengths: Sequence[int],
                  contexts: Sequence[int], repeats: int = 3,
                  warmup: int = 1) -> list[tuple[int, int, float]]:
    """Time fn(i, j) (one forward+backward of i tokens after j) for every i × j; the fastest of
    ``repeats`` (on a shared machine other processes only ever add time).

    The accelerator is synchronised before each clock read, so asynchronous GPU kernels
    are inside the interval they belong to (a no-op on the CPU)."""
    from ds_mp.models.cost_profile import synced_seconds

    out: list[tuple[int, int, float]] = []
    for i in lengths:
        for j in contexts:
            for _ in range(warmup):
                fn(i, j)
            times = [synced_seconds(lambda: fn(i, j)) for _ in range(repeats)]
            out.append((i, j, min(times)))
    return out


def batch_cost(model: Cost, b_ref: int = 1, overhead: float = 0.0) -> BatchCost:
    """t(b, i, j) = overhead + (b / b_ref) · (t(i, j) − overhead), t profiled at batch b_ref.

    The joint planner takes costs as a callable cost(b, i, j); this is the simplest one: work
    scales linearly with the batch-slice size, a fixed per-slice overhead (e.g. CostModel.c0)
    does not. Pass a measured cost(b, i, j) instead when the device is far from linear.
    """
    return lambda b, i, j: overhead + (b / b_ref) * (model(i, j) - overhead)
