"""TeraPipe slicing planner (TeraPipe, ICML 2021, §3.3–3.4): a fitted cost model and the DP.

A sequence of L tokens is cut into slices l_1 … l_M (Σ l_i = L, l_i ≥ 1). Slice i attends to
the c_i = l_1 + … + l_{i−1} earlier tokens (its *context*) and costs t_i = t(l_i, c_i) seconds
(forward + backward) on every one of the K pipeline stages. The iteration time is (paper eq. 5)

    T(l) = Σ_i t_i + (K − 1) · max_j t_j .

Planner (paper §3.3): for a cap τ let S*(τ) = min Σ t_i over slicings whose every t_i ≤ τ, an
O(L²) DP over prefix lengths:  S[0] = 0,  S[k] = min_{s<k, t(k−s, s) ≤ τ} S[s] + t(k−s, s).
Then  min_l T(l) = min_τ S*(τ) + (K − 1)·τ  over the candidate caps τ, taken in ascending order.
Everything here is a pure function of its arguments (no torch, no distributed state).
"""
from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ds_mp.config import ConfigError

Cost = Callable[[int, int], float]              # t(i, j): slice length i, context j -> seconds
BatchCost = Callable[[int, int, int], float]    # t(b, i, j): same for a batch-slice of b sequences
_CHUNK = 256                                    # caps evaluated together in one vectorised DP


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


@dataclass(frozen=True)
class SlicingPlan:
    slices: list[int]       # l_1 … l_M, Σ = L
    predicted_time: float   # Σ t_i + (K − 1)·max t_i under the cost model
    t_max: float            # max_i t_i


def uniform_slices(L: int, M: int) -> list[int]:
    """M slices of L tokens whose lengths differ by at most one (longer ones first)."""
    if not 1 <= M <= L:
        raise ValueError(f"need 1 <= M <= L, got M={M}, L={L}")
    return [L // M + (1 if k < L % M else 0) for k in range(M)]


def slice_costs(slices: Sequence[int], cost: Cost) -> list[float]:
    """t_i = t(l_i, l_1 + … + l_{i−1})."""
    out, ctx = [], 0
    for l in slices:
        out.append(float(cost(l, ctx)))
        ctx += l
    return out


def predicted_time(slices: Sequence[int], K: int, cost: Cost) -> float:
    """T = Σ_i t_i + (K − 1)·max_i t_i (paper eq. 5)."""
    t = slice_costs(slices, cost)
    return sum(t) + (K - 1) * max(t)


def best_uniform(L: int, K: int, cost: Cost, max_slices: int) -> SlicingPlan:
    """The best of uniform_slices(L, M) for M = 1 … max_slices (the baseline the DP must beat)."""
    plans = []
    for M in range(1, min(max_slices, L) + 1):
        s = uniform_slices(L, M)
        plans.append(SlicingPlan(s, predicted_time(s, K, cost), max(slice_costs(s, cost))))
    return min(plans, key=lambda p: p.predicted_time)


# ------------------------------------------------------------------ the dynamic program

def _positions(L: int, g: int) -> np.ndarray:
    """Allowed cut points 0, g, 2g, …, L (the last slice may take the remainder L mod g)."""
    if g < 1 or L < 1:
        raise ValueError(f"need L >= 1 and granularity >= 1, got L={L}, granularity={g}")
    return np.array(sorted(set(range(0, L, g)) | {L}), dtype=np.int64)


def _cost_matrix(cost: Cost, pos: np.ndarray) -> np.ndarray:
    """C[a, b] = t(pos[b] − pos[a], pos[a]) for a < b, +inf elsewhere. (n+1, n+1)."""
    n = len(pos) - 1
    C = np.full((n + 1, n + 1), np.inf)
    for a in range(n):
        for b in range(a + 1, n + 1):
            C[a, b] = cost(int(pos[b] - pos[a]), int(pos[a]))
    return C


def _min_sums(C: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """S*(τ) for every τ in caps, vectorised over caps. (T,)

    S[:, 0] = 0,  S[:, k] = min_{s<k, C[s,k] ≤ τ} S[:, s] + C[s, k];  returns S[:, n].
    """
    n = C.shape[0] - 1
    S = np.full((len(caps), n + 1), np.inf)
    S[:, 0] = 0.0
    top = caps.max()
    for k in range(1, n + 1):
        fits = np.flatnonzero(C[:k, k] <= top)
        if len(fits) == 0:
            continue
        s0 = fits[0]                          # only cuts s ≥ s0 can end a slice at k: skip the rest
        col = C[s0:k, k]                                              # (k − s0,)
        ok = col[None, :] <= caps[:, None]                            # (T, k − s0)
        S[:, k] = np.where(ok, S[:, s0:k] + col[None, :], np.inf).min(axis=1)
    return S[:, n]


def _best_path(C: np.ndarray, cap: float) -> list[int]:
    """The cut indices 0 = p_0 < … < p_M = n of a slicing attaining S*(cap)."""
    n = C.shape[0] - 1
    S, arg = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
    S[0] = 0.0
    for k in range(1, n + 1):
        v = np.where(C[:k, k] <= cap, S[:k] + C[:k, k], np.inf)
        arg[k] = int(np.argmin(v))
        S[k] = v[arg[k]]
    path = [n]
    while path[-1] > 0:
        path.append(int(arg[path[-1]]))
    return path[::-1]


def _bottleneck(C: np.ndarray) -> float:
    """min over slicings of max_i t_i (no cap below this is feasible): B[k] = min_s max(B[s], C[s,k])."""
    n = C.shape[0] - 1
    B = np.full(n + 1, np.inf)
    B[0] = -np.inf
    for k in range(1, n + 1):
        B[k] = np.maximum(B[:k], C[:k, k]).min()
    return float(B[n])


def _knapsack(S: dict[int, np.ndarray], B: int) -> tuple[np.ndarray, np.ndarray]:
    """G[n] = min_{b ≤ n} G[n − b] + S_b (vectorised over caps); returns (G[B], arg b per n)."""
    T = len(next(iter(S.values())))
    G = np.full((B + 1, T), np.inf)
    arg = np.zeros((B + 1, T), dtype=np.int64)
    G[0] = 0.0
    for n in range(1, B + 1):
        for b, s in S.items():
            if b <= n:
                v = G[n - b] + s
                better = v < G[n]
                G[n] = np.where(better, v, G[n])
                arg[n] = np.where(better, b, arg[n])
    return G[B], arg


def _plan(Cs: dict[int, np.ndarray], B: int, K: int, eps: float, M: int = 1) -> list[tuple[int, list[int]]]:
    """Joint DP: min_τ M·[min_{Σ b = B} Σ_b S*_b(τ)] + (K − 1)·τ; returns [(b, cut indices)].

    M micro-batches with the same plan run in one flush (gradient accumulation): every slice
    is paid M times, the pipeline fill (K − 1)·τ once — so a larger M favours fewer, longer
    slices.  Early stop: for every τ' ≥ τ, total(τ') ≥ M·G_∞ + (K − 1)·τ (G_∞: the knapsack
    without cap, a lower bound of every Σ_b S*_b(τ')), so once M·G_∞ + (K − 1)·τ ≥ best no
    larger cap can win.  This is tighter than the paper's (K − 1)·τ ≥ best, which it implies.
    """
    inf = np.array([np.inf])
    G_inf = float(_knapsack({b: _min_sums(C, inf) for b, C in Cs.items()}, B)[0][0])
    lo = min(_bottleneck(C) for C in Cs.values())
    if eps > 0:  # grid lo, lo + ε, …: some point lies in [τ*, τ* + ε) for the optimum's τ*
        hi = max(C[np.isfinite(C)].max() for C in Cs.values())
        caps = lo + eps * np.arange(int((hi - lo) // eps) + 2)
    else:        # exact: every distinct slice cost that can be a maximum
        caps = np.unique(np.concatenate([C[np.isfinite(C)] for C in Cs.values()]))
        caps = caps[caps >= lo]

    def realise(cap: float) -> tuple[float, list[tuple[int, list[int]]]]:
        _, arg = _knapsack({b: _min_sums(C, np.array([cap])) for b, C in Cs.items()}, B)
        plan, n = [], B
        while n > 0:
            b = int(arg[n, 0])
            if b == 0:
                raise ValueError(f"batch {B} is not a sum of batch-slice sizes {sorted(Cs)}")
            plan.append((b, _best_path(Cs[b], cap)))
            n -= b
        t = [Cs[b][p, q] for b, path in plan for p, q in zip(path[:-1], path[1:])]
        return float(M * sum(t) + (K - 1) * max(t)), plan

    best_total, best_plan = realise(np.inf)
    for start in range(0, len(caps), _CHUNK):
        chunk = caps[start:start + _CHUNK]
        if M * G_inf + (K - 1) * chunk[0] >= best_total:
            break
        G, _ = _knapsack({b: _min_sums(C, chunk) for b, C in Cs.items()}, B)
        totals = M * G + (K - 1) * chunk
        k = int(np.argmin(totals))
        if totals[k] < best_total:  # realised total ≤ totals[k]: its max is ≤ the cap
            best_total, best_plan = realise(float(chunk[k]))
    return best_plan


def _to_slices(pos: np.ndarray, path: list[int]) -> list[int]:
    return [int(pos[q] - pos[p]) for p, q in zip(path[:-1], path[1:])]


def plan_slices(L: int, K: int, cost: Cost, *, granularity: int = 1,
                eps: float = 0.0) -> SlicingPlan:
    """Optimal token slicing of one sequence of L tokens on K stages under cost t(i, j).

    Slice lengths are multiples of `granularity` g except the last (it takes L mod g).
    eps = 0 enumerates every distinct slice cost as a cap: the result is optimal (among
    g-slicings). eps > 0 uses caps lo, lo + ε, lo + 2ε, … instead; its plan satisfies
        T(plan_ε) ≤ T(plan_exact) + (K − 1)·ε,
    since the optimum's max τ* has a grid cap τ' ∈ [τ*, τ* + ε), S*(τ') ≤ S*(τ*), and the
    reported plan's max is ≤ its cap. Cost: O(#caps · (L/g)²), vectorised over caps.
    """
    if K < 1:
        raise ValueError(f"need K >= 1 stages, got {K}")
    pos = _positions(L, granularity)
    ((_, path),) = _plan({1: _cost_matrix(cost, pos)}, 1, K, eps)
    slices = _to_slices(pos, path)
    return SlicingPlan(slices, predicted_time(slices, K, cost), max(slice_costs(slices, cost)))


def plan_joint(B: int, L: int, K: int, cost: BatchCost, *, granularity: int = 1,
               eps: float = 0.0, batch_sizes: Sequence[int] | None = None, micro_batches: int = 1
               ) -> list[tuple[int, list[int]]]:
    """Joint batch + token slicing (paper §3.4): [(b_k, token slices of that batch-slice)].

    The batch of B sequences is split into batch-slices b_1 + … = B (sizes from batch_sizes,
    default 1 … B), each token-sliced on its own; all slices of the step's ``micro_batches``
    micro-batches flow through one pipeline flush, so T = M·Σ_plan t + (K − 1)·max t with
    t = cost(b, i, j). For each cap τ, S*_b(τ) is the token DP above and a knapsack over
    batch-slice sizes gives min Σ_k S*_{b_k}(τ). Same ε bound.
    """
    sizes = sorted(set(batch_sizes or range(1, B + 1)))
    if K < 1 or B < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"need K >= 1, B >= 1 and positive batch_sizes, got K={K}, B={B}, {sizes}")
    pos = _positions(L, granularity)
    Cs = {b: _cost_matrix(lambda i, j, b=b: cost(b, i, j), pos) for b in sizes if b <= B}
    plan = _plan(Cs, B, K, eps, micro_batches)
    return sorted(((b, _to_slices(pos, path)) for b, path in plan), key=lambda p: -p[0])


def predicted_time_joint(plan: Sequence[tuple[int, Sequence[int]]], K: int,
                         cost: BatchCost, micro_batches: int = 1) -> float:
    """T = M · Σ over every (batch-slice, token-slice) of t + (K − 1)·max t (one flush of M)."""
    t = [c for b, s in plan for c in slice_costs(s, lambda i, j, b=b: cost(b, i, j))]
    return micro_batches * sum(t) + (K - 1) * max(t)


# ------------------------------------------------------------------ plans the engine runs
Plan = list[tuple[int, list[int]]]  # [(batch-slice rows, token slice lengths)], as plan_joint


def explicit_plan(slices: Sequence[int], micro_batch: int, batch_slices: int) -> Plan:
    """``batch_slices`` near-equal batch-slices, each cut into the same token ``slices``."""
    if batch_slices > micro_batch:
        raise ConfigError(f"ds_mp.terapipe.batch_slices: {batch_slices} exceeds the micro-batch size "
                          f"{micro_batch}; use at most {micro_batch}")
    return [(rows, list(slices)) for rows in uniform_slices(micro_batch, batch_slices)]


def profile_sizes(B: int, batch_slices: int | str) -> list[int]:
    """Batch-slice sizes to profile for a micro-batch of B rows: ``"auto"`` the powers of two
    below B and B (the knapsack can build every split from them; profiling costs under ~2× that
    of B alone), n equal batch-slices B/n and B (B for the no-slicing baseline)."""
    if batch_slices == "auto":
        return sorted({2 ** k for k in range(max(B - 1, 1).bit_length()) if 2 ** k < B} | {B})
    return sorted({B // int(batch_slices), B})


def plan_for(cost: AnyCostModel, B: int, L: int, K: int, batch_slices: int | str, granularity: int,
             micro_batches: int = 1) -> Plan:
    """The planner's slicing of a micro-batch (B, L) on K stages for a step of ``micro_batches``
    micro-batches: into n equal batch-slices, or (``batch_slices="auto"``) the knapsack's best
    split over the batch-slice sizes the cost model knows (:func:`as_batch_cost`)."""
    bc, known = as_batch_cost(cost, B)
    if batch_slices == "auto":
        sizes = known
    elif B % batch_slices:
        raise ConfigError(f"ds_mp.terapipe.batch_slices: {batch_slices} does not divide the micro-batch "
                          f"size {B}; with slices='auto' use a divisor of {B} or 'auto'")
    else:
        sizes = [B // batch_slices]
        if known is not None and sizes[0] not in known:
            raise ConfigError(f"ds_mp.terapipe.profile: the cost model was profiled for batch-slices of "
                              f"{known} rows, not {sizes[0]}; profile again (delete it, or `ds-mp plan --profile`)")
    plan = plan_joint(B, L, K, bc, granularity=granularity, batch_sizes=sizes, micro_batches=micro_batches)
    return [(b, list(s)) for b, s in plan]
