"""ZB-V's timetable (:mod:`ds_mp.schedules.zb_v`), pure Python.

* the timetable reads like the paper's figure (P = 2, M = 4, both deferrals);
* for P ∈ {2, 3, 4} and M ∈ {P, 2P, 8, odd}: every rank runs each (micro-batch, chunk) F, B and W
  exactly once, F before B before W, and the chunks in V order (checked op by op against the
  dependencies written out here, not the module's); compiled by the engine's timetable compiler
  (:func:`~ds_mp.schedules.timetable.rounds` with :func:`~ds_mp.schedules.zb_v.v_peer`) the streams
  play under blocking rendezvous message matching without deadlock, every compute op finding its
  input received; held activations per rank ≤ 1F1B's largest rank, and with the bounded deferral
  also when a pending W's recorded gradients are counted;
* projections (simulator, op costs, equal and traced): 1F1B's closed form exactly; ZB-V never
  under its lower bound and the paper's deferral within P chunk ops of it (bubble → 0 as M grows),
  faster than 1F1B at equal work; the PP=4 projection the docs quote (printed with ``-s``).
"""
from __future__ import annotations

import random

import pytest

from ds_mp.schedules.timetable import modelled_peak
from ds_mp.schedules.simulate import Op, one_f_one_b_timetable, simulate
from ds_mp.schedules.timetable import Transfer, rounds
from ds_mp.schedules.zb_v import (figure, held_peak, lower_bound, project, projection, unit_cost, v_deps, v_peer,
                                 zb_v_timetable)

CASES = [(P, M) for P in (2, 3, 4) for M in sorted({P, 2 * P, 8, 2 * P + 1})]


def test_figure_is_readable() -> None:
    assert figure(zb_v_timetable(2, 4, "paper")).splitlines() == [
        "rank 0: F0 F1 f0 b0 f1 b1 B0 w0 B1 w1 F2 W0 W1 f2 b2 F3 w2 B2 W2 f3 b3 w3 B3 W3",
        "rank 1: F0 f0 F1 f1 b0 B0 b1 B1 w0 W0 w1 F2 f2 W1 b2 B2 F3 f3 w2 W2 b3 B3 w3 W3"]
    assert figure(zb_v_timetable(2, 4)).splitlines()[0] == \
        "rank 0: F0 f0 b0 w0 F1 B0 W0 f1 b1 w1 F2 B1 W1 f2 b2 w2 F3 B2 W2 f3 b3 w3 B3 W3"


def expected_inputs(P: int, r: int, op: Op) -> list[tuple[int, Op]]:
    """The V's data flow written out independently: (rank, op) whose result ``op`` on rank r consumes."""
    m, c = op.micro, op.slice
    virtual = r if c == 0 else 2 * P - 1 - r           # this chunk's place along the V
    def where(v: int) -> tuple[int, int]:              # virtual stage -> (rank, local chunk)
        return (v, 0) if v < P else (2 * P - 1 - v, 1)
    if op.kind == "F":
        return [(where(virtual - 1)[0], Op("F", m, where(virtual - 1)[1]))] if virtual > 0 else []
    if op.kind == "B":
        own = [(r, Op("F", m, c))]
        if virtual == 2 * P - 1:
            return own
        nr, nc = where(virtual + 1)
        return own + [(nr, Op("B", m, nc))]
    return [(r, Op("B", m, c))]


@pytest.mark.parametrize("deferral", ["bounded", "paper"])
@pytest.mark.parametrize("P,M", CASES)
def test_each_op_once_in_legal_order(P: int, M: int, deferral: str) -> None:
    table = zb_v_timetable(P, M, deferral)
    done: set[tuple[int, Op]] = set()
    pos = [0] * P
    total = sum(len(ops) for ops in table)
    for r, ops in enumerate(table):
        want = {Op(k, m, c) for k in "FBW" for m in range(M) for c in (0, 1)}
        assert sorted(ops) == sorted(want) and len(ops) == len(want), f"rank {r}"
        for op in ops:
            if op.kind in "FB":
                kinds = [o.kind for o in ops if (o.micro, o.slice) == (op.micro, op.slice)]
                assert kinds == ["F", "B", "W"], (r, op, kinds)
    while len(done) < total:  # play the tables in any order that respects the data flow
        moved = False
        for r in range(P):
            while pos[r] < len(table[r]) and all(d in done for d in expected_inputs(P, r, table[r][pos[r]])):
                done.add((r, table[r][pos[r]]))
                pos[r] += 1
                moved = True
        assert moved, f"deadlock at {[(r, table[r][pos[r]]) for r in range(P) if pos[r] < len(table[r])]}"
    assert all(set(v_deps(P)(r, op, P)) == set(expected_inputs(P, r, op)) for r in range(P) for op in table[r])


def play_rendezvous(streams: list[list[tuple[str, object]]], P: int) -> list[list[Op]]:
    """Blocking send/recv message matching: a send and its receive complete together when both
    ranks reach them; a compute op needs each input computed locally or received.  Returns the
    compute order per rank; fails on a deadlock or an input not there."""
    pos, have = [0] * P, [set() for _ in range(P)]
    order: list[list[Op]] = [[] for _ in range(P)]
    while any(pos[r] < len(streams[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(streams[r]):
                kind, x = streams[r][pos[r]]
                if kind == "compute":
                    for src, dep in expected_inputs(P, r, x):
                        assert (src, dep) in have[r], f"rank {r}: {x} runs without {dep}@{src}"
                    have[r].add((r, x))
                    order[r].append(x)
                elif kind == "send":
                    peer = x.dst
                    if pos[peer] >= len(streams[peer]) or streams[peer][pos[peer]] != ("recv", x):
                        break
                    sent = [(s, d) for s, d in expected_inputs(P, peer, x.op) if s == r]
                    assert sent and all(d in have[r] for d in sent), f"rank {r} sends {x} before computing it"
                    have[peer] |= set(sent)
                    pos[peer] += 1
                else:
                    break  # a receive completes with its send
                pos[r] += 1
                moved = True
        assert moved, "deadlock: " + "; ".join(f"rank {r} at {streams[r][pos[r]]}" for r in range(P)
                                               if pos[r] < len(streams[r]))
    return order


@pytest.mark.parametrize("deferral", ["bounded", "paper"])
@pytest.mark.parametrize("P,M", CASES)
def test_compiled_streams_match_messages(P: int, M: int, deferral: str) -> None:
    table = zb_v_timetable(P, M, deferral)
    compiled = rounds(table, unit_cost, v_deps(P), v_peer(P))
    streams = [[item for rnd in stage for item in rnd] for stage in compiled]
    assert play_rendezvous(streams, P) == table
    sends = sum(kind == "send" for s in streams for kind, _ in s)
    assert sends == 2 * M * 2 * (P - 1)  # F and B messages of 2(P−1) boundaries, none at the turn
    # posted sends (the engine's default): each send right after its producer, the consumer's own
    # unit on the sender (TimetableSchedule's default ``sent_unit`` holds on the V)
    def producer(m: Transfer) -> Op:
        return Op("F" if m.kind == "act" else "B", m.op.micro, m.op.slice)
    for r, stage in enumerate(rounds(table, unit_cost, v_deps(P), v_peer(P), producer)):
        done: set = set()
        for kind, x in (item for rnd in stage for item in rnd):
            if kind == "compute":
                done.add(x)
            elif kind == "send":
                assert (r, producer(x)) in expected_inputs(P, x.dst, x.op) and producer(x) in done, (r, x)


def test_random_costs_legal_and_bounded() -> None:
    """Any op costs give a timetable the simulator plays, within 1F1B's held memory (P, M ≥ 2)."""
    rng = random.Random(0)
    for P in (2, 3, 5):
        for M in (2, 3, 7, 12):
            for deferral, pw in (("bounded", 1.6), ("bounded", 2.0), ("paper", 1.0)):
                c = {k: rng.uniform(0.2, 2.0) for k in "FBW"}
                table = zb_v_timetable(P, M, deferral, lambda r, op: c[op.kind], pw)
                simulate(table, lambda r, op: c[op.kind], deps=v_deps(P))
                one = max(modelled_peak(ops) for ops in one_f_one_b_timetable(P, M))
                assert max(held_peak(ops, pw) for ops in table) <= one, (P, M, deferral, pw, c)


@pytest.mark.parametrize("P,M", CASES)
def test_held_activations_within_1f1b(P: int, M: int) -> None:
    one = max(modelled_peak(ops) for ops in one_f_one_b_timetable(P, M))  # in stages
    assert one == min(P, M)
    for deferral in ("bounded", "paper"):
        assert max(held_peak(ops) for ops in zb_v_timetable(P, M, deferral)) <= one, deferral
    for pw in (1.5, 2.0):  # recorded gradients counted: only the bounded deferral stays within
        assert max(held_peak(ops, pw) for ops in zb_v_timetable(P, M, "bounded", pending_weight=pw)) <= one, pw


#: Traced op costs per stage (s), GPT-2 6×256 at PP=2 (docs/results.md, "Pipeline engine speed and ZB-H1").
TRACED = {"F": 0.062, "B": 0.039, "W": 0.080}


@pytest.mark.parametrize("costs", [{"F": 2.0, "B": 2.0, "W": 2.0}, TRACED], ids=["equal", "traced"])
def test_paper_deferral_near_lower_bound(costs: dict[str, float]) -> None:
    """Closed forms at the same work (1F1B's backward = B + W): 1F1B's step is (M + P − 1)(F + B + W)
    exactly; no ZB-V step beats ``lower_bound`` ((P − 1)f + 2M(f + b + w), chunk costs = half a
    stage's) and the paper's deferral stays within P chunk ops of it, so its bubble → 0 as M grows
    (the paper: ≈ 0 at M ≥ 2P; the ramp (P − 1)f at the turn rank is unavoidable) and it beats 1F1B."""
    f, b, w = (costs[k] / 2 for k in "FBW")
    for P in (2, 3, 4):
        bubbles = []
        for M in (2 * P, 4 * P, 8 * P, 2 * P + 1):
            table = projection(P, M, costs["F"], costs["B"], costs["W"])
            assert table["1f1b"] == pytest.approx((M + P - 1) * sum(costs.values()))
            lb = lower_bound(P, M, f, b, w)
            for deferral in ("bounded", "paper"):
                assert table[f"zb-v {deferral}"] >= lb - 1e-9
            assert table["zb-v paper"] <= lb + P * max(f, b, w) + 1e-9, (P, M, table["zb-v paper"], lb)
            assert table["zb-v paper"] < table["1f1b"]
            bubbles.append(project(P, M, lambda r, op: {"F": f, "B": b, "W": w}[op.kind], deferral="paper")
                           .bubble_fraction)
        assert bubbles[:3] == sorted(bubbles[:3], reverse=True) and bubbles[2] < 0.05, (P, bubbles)


def test_pp4_projection() -> None:
    """PP=4 with the traced op costs: the rows docs/results.md quotes (run with ``-s`` to print)."""
    for M in (4, 8, 16):
        t = projection(4, M, **TRACED)
        print(f"PP=4 M={M:>2}: " + ", ".join(f"{k} {t['1f1b'] / v:.2f}x" for k, v in t.items() if k != "1f1b")
              + " over 1F1B")
        assert t["zb-v paper"] < min(v for k, v in t.items() if k != "zb-v paper")
