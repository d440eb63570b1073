"""Token-sliced 1F1B (``"terapipe": {"order": "1f1b"}``): TeraPipe's slices in a 1F1B order.

* pure Python: the timetable (each sequence's slices backwarded in reverse, as soon as its last
  slice is forwarded on the last stage), the bound on units in flight, and the compiled
  instruction streams played with rendezvous p2p (no deadlock, every unit forwarded and
  backwarded once per stage, gradients consumed by the unit they belong to);
* :class:`~ds_mp.engine.memory.SavedActivations` against a hand count;
* multi-rank (gloo, CPU): losses and every weight equal HF's after SGD steps (PP=2×DP=2,
  TP=2×PP=2 with uneven batch-slices, activation checkpointing every 2 and 3 pipeline layers (GPT-2's
  token lookup then shares a segment), sequence parallelism, PP=3),
  and the measured peak of saved activations is below the GPipe order's on the same run.
"""
from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from ds_mp.engine.memory import SavedActivations
from ds_mp.schedules.simulate import Op, simulate, sliced_one_f_one_b_timetable
from ds_mp.schedules.terapipe.schedule import BackwardSlice, ForwardSlice, TeraPipe1F1B
from helpers import batches, ds_config, tiny_gpt2
from p2p_play import play_compiled
from test_terapipe import SLICES, _check, _ranks



def _seqs(micro: int, n: int) -> list[list[Op]]:
    return [[Op("F", m, i) for i in range(n)] for m in range(micro)]


def test_timetable_matches_docstring_and_bounds_memory() -> None:
    t = sliced_one_f_one_b_timetable(2, _seqs(2, 2))
    assert [" ".join(map(str, ops)) for ops in t] == [
        "F0 F0.1 F1 B0.1 F1.1 B0 B1.1 B1", "F0 F0.1 B0.1 F1 B0 F1.1 B1.1 B1"]
    for K, M, N in [(2, 4, 4), (3, 3, 2), (4, 2, 5)]:
        table = sliced_one_f_one_b_timetable(K, _seqs(M, N))
        simulate(table, lambda s, op: 1.0)  # legal: every dependency is met, no deadlock
        for s, ops in enumerate(table):
            live = peak = 0
            for op in ops:
                live += 1 if op.kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(M * N, N + K - 1 - s), (K, M, N, s, peak)
            for m in range(M):  # each sequence's slices backwarded in reverse
                assert [op.slice for op in ops if op.kind == "B" and op.micro == m] == list(reversed(range(N)))


def play(scheds: list) -> list[list[tuple]]:
    """Run every stage's steps with rendezvous p2p (with posted sends if the schedules are
    compiled for them); return per stage the compute events ``(kind, unit)`` where unit =
    (micro, batch_slice, slice), checking the data flow."""
    K = len(scheds)
    held = [dict() for _ in range(K)]  # buffer -> unit whose activation/labels it holds
    grad_layer: list = [None] * K
    done: list[list[tuple]] = [[] for _ in range(K)]
    sent_grad = [dict() for _ in range(K)]  # buffer -> unit backwarded there

    def compute(s: int, c) -> None:
        if isinstance(c, ForwardSlice):
            unit = (c.micro, c.batch_slice, c.slice)
            if s > 0:
                assert held[s].get(c.buffer_id) == unit, f"stage {s}: {c} holds {held[s].get(c.buffer_id)}"
            held[s][c.buffer_id] = unit
            done[s].append(("F", unit))
        elif isinstance(c, BackwardSlice):
            unit = (c.micro, c.batch_slice, c.slice)
            assert held[s].get(c.buffer_id) == unit
            if s < K - 1:
                assert grad_layer[s] == unit, f"stage {s}: {c} with the gradient of {grad_layer[s]}"
                grad_layer[s] = None
            sent_grad[s][c.buffer_id] = unit
            done[s].append(("B", unit))

    def sent(s: int, send) -> tuple:  # the unit whose activation / input gradient leaves
        return (held if isinstance(send, ds.SendActivation) else sent_grad)[s][send.buffer_id]

    def received(peer: int, recv, send, unit: tuple) -> None:
        if isinstance(send, ds.SendActivation):
            held[peer][recv.buffer_id] = unit
        else:
            assert grad_layer[peer] is None, f"stage {peer}: gradient overwritten before use"
            grad_layer[peer] = unit

    streams = [list(x.steps()) for x in scheds]
    play_compiled(streams, compute, sent, received, scheds[0].posted_sends, acks=[x.acknowledged() for x in scheds])
    return done


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("M, plan", [(1, [(2, SLICES)]), (2, [(1, [3, 1]), (1, [2, 2])]), (3, [(1, [4])])])
@pytest.mark.parametrize("posted_sends", [False, True])
def test_compiled_schedule_plays(K: int, M: int, plan: list, posted_sends: bool) -> None:
    scheds = [TeraPipe1F1B(M, K, s, plan) for s in range(K)]
    for x in scheds:
        x.posted_sends = posted_sends
    done = play(scheds)
    units = [(u.micro, u.batch_slice, u.slice) for u in scheds[0].units]
    for s in range(K):
        assert [u for k, u in done[s] if k == "F"] == units
        assert sorted(u for k, u in done[s] if k == "B") == sorted(units)
        order = [(op.kind, op.micro, op.slice) for op in scheds[s].ops()]
        per = scheds[s].per_micro
        assert [(k, u[0], scheds[s].units.index(next(x for x in scheds[s].units
                                                     if (x.micro, x.batch_slice, x.slice) == u)) % per)
                for k, u in done[s]] == order, f"stage {s} runs its timetable's order"
        # units in flight, plus one whose gradient is still to be sent
        assert scheds[s].num_pipe_buffers() <= min(len(units), max(len(sl) for _, sl in plan) + K - 1 - s) + 1


def test_saved_activations_counts_saved_tensors() -> None:
    """y = (x·w).sin().sum(): autograd saves x (for dw), w is a parameter (not counted) and the
    product (for sin's backward): 2 × 4·6 floats; freed by the backward."""
    w = torch.nn.Parameter(torch.randn(6, 6))
    x = torch.randn(4, 6)
    with SavedActivations([w]) as m:
        y = (x @ w).sin().sum()
        assert m.live == 2 * 4 * 6 * 4
        y.backward()
    assert m.live == 0 and m.peak == 2 * 4 * 6 * 4


# ------------------------------------------------------------------ multi-rank

def test_sliced_1f1b_equals_hf_on_4_ranks() -> None:
    """As test_terapipe's 4-rank cases, in the 1F1B order."""
    o = {"order": "1f1b"}
    cases = [dict(tp=1, pp=2, micro=2, gas=2, terapipe={"slices": SLICES, **o}),
             dict(tp=2, pp=2, micro=3, gas=1, terapipe={"slices": SLICES, "batch_slices": 2, **o}),
             dict(tp=1, pp=2, micro=2, gas=2, terapipe={"slices": SLICES, **o},
                  extra={"pipeline": {"activation_checkpoint_interval": 2}}),
             dict(tp=2, pp=2, micro=2, gas=1, terapipe={"slices": [6, 2, 8], **o},
                  extra={"tensor_parallel": {"sequence_parallel": True},
                         "pipeline": {"activation_checkpoint_interval": 3}})]
    _check(run_ranks(_ranks, 4, cases, timeout=400), cases)


def test_sliced_1f1b_equals_hf_pp3() -> None:
    cases = [dict(tp=1, pp=3, micro=3, gas=2, terapipe={"slices": SLICES, "batch_slices": 2, "order": "1f1b"})]
    _check(run_ranks(_ranks, 3, cases, timeout=300), cases)


def _memory_rank(rank: int, orders: list[str]) -> dict:
    import ds_mp

    out = {}
    for order in orders:
        cfg = ds_config(pp=2, micro=2, gas=4, lr=0.1, seq=32, schedule="terapipe",
                        terapipe={"slices": [8, 8, 8, 8], "order": order})
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
        data = batches(4, 2, 32, 203, seed=5)
        engine.train_batch(iter(data))  # warm: plans, shapes
        with SavedActivations(engine.module.parameters()) as m:
            loss = float(engine.train_batch(iter(data)))
        out[order] = (m.peak, loss)
    return out


def test_sliced_1f1b_holds_fewer_activations() -> None:
    """4 micro-batches × 4 slices on 2 stages: the GPipe order holds all 16 units' activations on
    each stage, the 1F1B order at most N + K − 1 − s = 5 (stage 0) and 4 (stage 1) units."""
    results = run_ranks(_memory_rank, 2, ["gpipe", "1f1b"], timeout=300)
    for stage, r in enumerate(results):
        (g, g_loss), (o, o_loss) = r["gpipe"], r["1f1b"]
        assert abs(g_loss - o_loss) <= 1e-6 * abs(g_loss), r
        assert o <= 0.4 * g, f"stage {stage}: 1f1b peak {o} bytes vs gpipe {g}"
