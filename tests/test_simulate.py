"""Schedule simulator: closed forms, timetable shapes, deadlock detection, projection."""
from __future__ import annotations

import pytest

from ds_mp.schedules.simulate import (
    GPT3_SHAPES, ModelShape, Op, gpipe_timetable, one_f_one_b_timetable, project_gpt3,
    simulate, terapipe_op_cost, terapipe_timetable,
)
from ds_mp.schedules.terapipe.cost_model import CostModel
from ds_mp.schedules.terapipe.planner import plan_slices, predicted_time

F_COST, B_COST = 1.0, 2.0
SHAPES = [(1, 1), (2, 3), (4, 4), (4, 7), (5, 2)]


def uniform(stage: int, op: Op) -> float:
    return F_COST if op.kind == "F" else B_COST


BUILDERS = {
    "gpipe": gpipe_timetable,
    "1f1b": one_f_one_b_timetable,
    "terapipe": lambda K, M: terapipe_timetable(K, M),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("K,M", SHAPES)
def test_closed_form(name: str, K: int, M: int) -> None:
    r = simulate(BUILDERS[name](K, M), uniform)
    assert r.iteration_time == pytest.approx((M + K - 1) * (F_COST + B_COST))
    assert r.bubble_fraction == pytest.approx((K - 1) / (M + K - 1))
    assert r.busy == pytest.approx([M * (F_COST + B_COST)] * K)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("K,M", SHAPES)
def test_every_op_once_and_stages_serial(name: str, K: int, M: int) -> None:
    table = BUILDERS[name](K, M)
    r = simulate(table, uniform)
    for s, ops in enumerate(table):
        assert len(ops) == len(set(ops)) == 2 * M
        fwd = {(op.micro, op.slice) for op in ops if op.kind == "F"}
        assert fwd == {(op.micro, op.slice) for op in ops if op.kind == "B"} and len(fwd) == M
        spans = [r.times[(s, op)] for op in ops]
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert len(r.times) == 2 * M * K


def test_gpipe_latency() -> None:
    K, M, lat = 4, 3, 0.25
    r = simulate(gpipe_timetable(K, M), uniform, latency=lat)
    assert r.iteration_time == pytest.approx((M + K - 1) * (F_COST + B_COST) + 2 * (K - 1) * lat)


def test_one_f_one_b_reads_like_the_figure() -> None:
    F, B = (lambda m: Op("F", m)), (lambda m: Op("B", m))
    table = one_f_one_b_timetable(3, 4)
    assert table[0] == [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
    assert table[1] == [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]
    assert table[2] == [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]


def test_terapipe_order() -> None:
    (row,) = terapipe_timetable(1, 3, micro=2)
    assert [str(op) for op in row] == ["F0", "F0.1", "F0.2", "F1", "F1.1", "F1.2",
                                       "B1.2", "B1.1", "B1", "B0.2", "B0.1", "B0"]


@pytest.mark.parametrize("K", [2, 4, 8])
def test_terapipe_matches_slicing_formula(K: int) -> None:
    cost = CostModel(c0=1e-3, c1=1e-5, c2=1e-9, a0=1e-4, a1=1e-6, a2=1e-7, a3=2e-9)
    slices = plan_slices(256, K, cost, granularity=16).slices
    r = simulate(terapipe_timetable(K, len(slices)), terapipe_op_cost(slices, cost))
    assert r.iteration_time == pytest.approx(predicted_time(slices, K, cost), rel=1e-9)


def test_deadlock_detected() -> None:
    table = [[Op("F", 0), Op("B", 0)], [Op("B", 0), Op("F", 0)]]  # stage 1: B before F
    with pytest.raises(ValueError, match="deadlock.*stage 1 waits at B0"):
        simulate(table, uniform)


def test_missing_and_duplicate_ops_rejected() -> None:
    with pytest.raises(ValueError, match="never scheduled"):
        simulate([[Op("F", 0), Op("B", 0)], [Op("F", 0)]], uniform)
    with pytest.raises(ValueError, match="twice"):
        simulate([[Op("F", 0), Op("F", 0)]], uniform)
    with pytest.raises(ValueError, match="deps="):
        simulate([[Op("X", 0)]], uniform)


def test_custom_deps_for_new_kinds() -> None:
    deps = lambda s, op, K: [(s - 1, op)] if s > 0 else []
    r = simulate([[Op("X", 0)], [Op("X", 0)]], lambda s, op: 1.0, deps=deps, latency=0.5)
    assert r.iteration_time == pytest.approx(2.5)


def test_gantt_has_a_row_per_stage() -> None:
    r = simulate(gpipe_timetable(3, 2), uniform)
    assert len(r.gantt(40).splitlines()) == 3


def test_project_gpt3() -> None:
    cost = CostModel(c0=1e-3, c1=1e-5, c2=1e-9, a3=2e-9)
    shape = ModelShape(layers=12, hidden=768, seq_len=256)
    slices, same = project_gpt3(cost, shape, 4, shape, 4, slices=[128, 128])
    direct = simulate(terapipe_timetable(4, 2), terapipe_op_cost([128, 128], cost))
    assert same.iteration_time == pytest.approx(direct.iteration_time)
    t = {n: project_gpt3(cost, shape, 4, n, 8, granularity=128)[1].iteration_time
         for n in ("gpt3-1b", "gpt3-13b")}
    assert t["gpt3-1b"] < t["gpt3-13b"]
    assert set(GPT3_SHAPES) == {"gpt3-1b", "gpt3-13b", "gpt3-44b", "gpt3-175b"}


def test_simulate_plan_of_equal_units_is_the_papers_eq5() -> None:
    """A joint plan's units (batch-slices × token slices) flow like TeraPipe slices: with equal
    unit costs t, T = (U + K − 1)·t = Σ t + (K − 1)·max t (paper eq. 5)."""
    from ds_mp.schedules.simulate import simulate_plan

    plan = [(2, [4, 4]), (1, [3, 5])]
    res = simulate_plan(plan, 3, lambda b, i, j: 0.5)
    assert res.iteration_time == pytest.approx((4 + 2) * 0.5)
    gpipe = simulate_plan([(1, [8])] * 4, 2, lambda b, i, j: 1.0)  # no token slicing: GPipe's (M + K − 1)·t
    assert gpipe.iteration_time == pytest.approx(5.0)


@pytest.mark.parametrize("M", [2, 4, 8])
def test_zb_h1_deferrals_closed_form(M: int) -> None:
    """PP = 2, F = B = W = 1: 1F1B takes 3(M + 1); ZB-H1 with the paper's deferral 3M + 1 (the last
    stage's last W after its last B); with the memory-bounded default (no W deferred at K = 2,
    1F1B's memory) 3M + 2: only the last stage's sending its input gradient before its W remains."""
    from ds_mp.schedules.simulate import zb_h1_timetable, zero_bubble_deps

    unit = lambda s, op: 1.0  # noqa: E731
    one = simulate(one_f_one_b_timetable(2, M), lambda s, op: 2.0 if op.kind == "B" else 1.0).iteration_time
    auto = simulate(zb_h1_timetable(2, M), unit, deps=zero_bubble_deps).iteration_time
    paper = simulate(zb_h1_timetable(2, M, "paper"), unit, deps=zero_bubble_deps).iteration_time
    assert (one, paper, auto) == (3 * (M + 1), 3 * M + 1, 3 * M + 2)
