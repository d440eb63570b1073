"""``"partition": "cost"``: the linear partition is optimal (against brute force), and measuring
touches neither weights nor random streams.  The 2-rank run (agreement, cache, bit-identical to
the same partition as a list, and equal to HF) is a case of test_pipeline's world-2 spawn."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import tiny_gpt2


def _brute_force(L: int, K: int, block: float, first: float, last: float, min_end: int) -> list[int]:
    """Every composition of L into K contiguous stages: least max stage cost, then least sum of
    squared stage costs, then lexicographically smallest."""
    low = [min_end if s in (0, K - 1) else 1 for s in range(K)]
    best = None
    for cuts in itertools.combinations_with_replacement(range(L + 1), K - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
        if any(c < lo for c, lo in zip(counts, low)):
            continue
        w = [c * block + (first if s == 0 else 0) + (last if s == K - 1 else 0) for s, c in enumerate(counts)]
        key = (max(w), sum(x * x for x in w), list(counts))
        best = key if best is None or key < best else best
    assert best is not None
    return best[2]


def test_balanced_blocks_is_optimal() -> None:
    """Integer costs (exact in floats: ties are real ties, the tie-breaks are checked too) and
    random real costs (the least max-cost is checked)."""
    from ds_mp.models.partition import balanced_blocks

    rng = random.Random(0)
    for _ in range(300):
        L = rng.randint(1, 8)
        K, m = rng.randint(1, min(L, 4)), rng.choice([0, 1])
        b, f, last = rng.randint(1, 4), rng.randint(0, 9), rng.randint(0, 9)
        assert balanced_blocks(L, K, b, f, last, m) == _brute_force(L, K, b, f, last, m), (L, K, b, f, last, m)
        b, f, last = rng.random(), 5 * rng.random(), 5 * rng.random()

        def worst(counts: list[int]) -> float:
            return max(c * b + (f if s == 0 else 0) + (last if s == K - 1 else 0) for s, c in enumerate(counts))

        got = balanced_blocks(L, K, b, f, last, m)
        assert sum(got) == L and worst(got) == pytest.approx(worst(_brute_force(L, K, b, f, last, m)), abs=1e-12)
    with pytest.raises(ValueError, match="cannot split 2 blocks over 3 stages"):
        balanced_blocks(2, 3, 1.0, 0.0, 0.0, 1)


def _v_key(chunks: list[int], block: float, first: float, last: float) -> tuple:
    """ZB-V's objective for 2P chunk block counts (rank r holds chunks r and 2P − 1 − r, rank 0 the
    embedding ``first`` and the head ``last``): the costliest rank, the sum of squared rank costs,
    then the costlier of rank 0's two chunks."""
    P = len(chunks) // 2
    w = [(chunks[r] + chunks[2 * P - 1 - r]) * block + (first + last if r == 0 else 0) for r in range(P)]
    return max(w), sum(x * x for x in w), max(chunks[0] * block + first, chunks[-1] * block + last)


def test_v_balanced_blocks_is_optimal() -> None:
    """Against every composition of L blocks into 2P chunks of ≥ 1: integer costs give the brute
    force's best key exactly (ties are real ties), random real costs its least max rank cost."""
    from ds_mp.models.partition import LayerCosts, v_balanced_blocks

    rng = random.Random(1)
    for _ in range(200):
        P = rng.randint(1, 3)
        L = rng.randint(2 * P, 2 * P + 5)
        every = [[b - a for a, b in zip((0, *cuts), (*cuts, L))]
                 for cuts in itertools.combinations(range(1, L), 2 * P - 1)]
        for b, f, last in ((rng.randint(1, 4), rng.randint(0, 9), rng.randint(0, 9)),
                           (rng.random(), 5 * rng.random(), 5 * rng.random())):
            got = v_balanced_blocks(L, P, b, f, last)
            assert len(got) == 2 * P and sum(got) == L and min(got) >= 1, (got, L, P)
            best = min(_v_key(c, b, f, last) for c in every)
            if isinstance(b, int):
                assert _v_key(got, b, f, last) == best, (L, P, b, f, last, got)
            else:
                assert _v_key(got, b, f, last)[0] == pytest.approx(best[0], abs=1e-12), (L, P, b, f, last, got)
    assert LayerCosts(embed=0.1, block=1.0, head=0.1).v_blocks(6, 2) == [1, 1, 2, 2]  # rank 0: 3 blocks + ends
    assert LayerCosts(embed=0.0, block=1.0, head=2.0).v_blocks(8, 2) == [2, 2, 3, 1]  # the head's chunk: fewer
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 2·2 chunks"):
        v_balanced_blocks(3, 2, 1.0, 0.0, 0.0)


def test_cost_partition_moves_blocks_off_the_heavy_end() -> None:
    """A heavy head takes blocks off the last stage (down to none), a heavy embedding off the
    first; "parameters" keeps its old answers; "cost" without costs says what it needs."""
    from ds_mp.models.partition import LayerCosts, stage_parts

    assert LayerCosts(embed=0.1, block=1.0, head=1.5).blocks(8, 2) == [5, 3]
    assert LayerCosts(embed=3.0, block=1.0, head=0.0).blocks(8, 2) == [2, 6]
    assert LayerCosts(embed=0.0, block=1.0, head=9.0).blocks(4, 2) == [4, 0]
    assert LayerCosts(embed=0.1, block=1.0, head=1.5).head_blocks == pytest.approx(1.6)
    assert stage_parts(8, 2, "cost", 48, 203, costs=LayerCosts(0.1, 1.0, 1.5)) == [0, 7, 12]
    assert stage_parts(6, 3, "parameters", 48, 50000) == [0, 3, 7, 10]
    with pytest.raises(ValueError, match="partition 'cost' needs the measured layer costs"):
        stage_parts(8, 2, "cost", 48, 203)


def test_measuring_leaves_weights_and_random_streams_alone() -> None:
    """One process, TP = 1: three positive costs; the weight source, the CPU generator and the
    model-parallel RNG tracker are as before (so a "cost" run draws the same dropout masks)."""
    from ds_mp.models.cost_profile import measure_layer_costs
    from ds_mp.models.weights import WeightSource
    from ds_mp.tensor_parallel.random import rng_state, seed_everything
    from ds_mp.topology import Topology

    model = tiny_gpt2(dropout=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seed_everything(7, tp_rank=0)
    rng = rng_state()
    costs = measure_layer_costs(WeightSource.from_model(model), Topology(tp=1, pp=1, dp=1, rank=0), rows=2, seq=16,
                                dtype=torch.float32, device=torch.device("cpu"), rounds=2, warmup=1)
    assert min(vars(costs).values()) > 0, costs
    after = rng_state()
    assert torch.equal(rng["torch"], after["torch"])
    assert rng["tracker"].keys() == after["tracker"].keys()
    assert all(torch.equal(rng["tracker"][k], after["tracker"][k]) for k in rng["tracker"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
