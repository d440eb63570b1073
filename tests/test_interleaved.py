"""Interleaved 1F1B (Narayanan et al. 2021) in the simulator: the timetable and its dependencies.

ds_mp does not run interleaved 1F1B yet (``"schedule": "interleaved"`` is not registered: a rank
would hold v non-contiguous chunks of blocks, see docs/schedules.md); the simulator knows the
schedule so the benchmarks can project it.  Checked here: every chunk of every micro-batch is
forwarded and backwarded once per stage, the order is legal under :func:`interleaved_deps`
(no deadlock), and with unit costs the step is M(F+B) + (K−1)(F+B)/v — 1F1B's bubble divided by v
— for the shapes of the issue and the paper.
"""
from __future__ import annotations

import pytest

from ds_mp.schedules.simulate import (Op, interleaved_deps, interleaved_timetable, one_f_one_b_timetable,
                                      simulate)


@pytest.mark.parametrize("K, M, v", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 4), (8, 32, 2)])
def test_interleaved_bubble_is_1f1bs_over_v(K: int, M: int, v: int) -> None:
    table = interleaved_timetable(K, M, v)
    for ops in table:
        assert sorted(ops) == sorted(Op(k, m, c) for k in "FB" for m in range(M) for c in range(v))
    fb = lambda s, op: 2.0 if op.kind == "B" else 1.0  # noqa: E731
    step = simulate(table, lambda s, op: fb(s, op) / v, deps=interleaved_deps(v)).iteration_time
    assert step == pytest.approx(3 * M + 3 * (K - 1) / v)
    assert simulate(one_f_one_b_timetable(K, M), fb).iteration_time == 3 * (M + K - 1)


def test_interleaved_dependencies_cross_the_ring() -> None:
    deps = interleaved_deps(2)
    assert deps(0, Op("F", 3, 1), 4) == [(3, Op("F", 3, 0))]  # chunk 1 starts where chunk 0 ended
    assert deps(3, Op("B", 3, 0), 4) == [(3, Op("F", 3, 0)), (0, Op("B", 3, 1))]
    assert deps(0, Op("F", 0, 0), 4) == [] and deps(3, Op("B", 0, 1), 4) == [(3, Op("F", 0, 1))]
    with pytest.raises(ValueError, match="divisible"):
        interleaved_timetable(4, 6, 2)
