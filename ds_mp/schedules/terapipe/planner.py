"""TeraPipe slicing planner (TeraPipe, ICML 2021, §3.3): the DP over a fitted cost model (cost_model.py).

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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ds_mp.config import ConfigError
from ds_mp.schedules.terapipe.cost_model import AnyCostModel, BatchCost, Cost, as_batch_cost

_CHUNK = 256                                    # caps evaluated together in one vectorised DP


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
