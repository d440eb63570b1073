"""Pipeline sends are posted (``isend``), not a rendezvous with the receiver.

DeepSpeed's ``p2p.send`` blocks until the receiver posts its receive (gloo).  ds_mp's engine
posts activation and gradient sends (``DsMpPipelineEngine.post_sends``) and waits for each once a
message from its peer shows the peer has received it (``ds_mp/engine/p2p.py``), the
rest at the end of the schedule.  Here rank 1 holds its first receive until rank 0's first
send instruction has returned: posted, it returns at once; blocking (the control), it cannot
return before rank 1 receives, so rank 1 gives up waiting.  Both give the same step bit for bit.
Timetable schedules compile each send right after its value only where a send cannot wait behind
a receive on its link (gloo; not NCCL, which runs a rank pair's p2p in enqueue order on one stream).

The waits: in pure Python every acknowledged send was received before its acknowledging message
left (``p2p_play.posted``) and the sends in flight stay bounded as the micro-batches grow; on two
ranks the bytes pinned by posted sends stay the same from 4 to 16 micro-batches (they grew with M
when gloo's ``is_completed()``, False until ``wait()``, was the only release), every step equal
bit for bit to blocking sends.  A timetable is compiled once per set of inputs: a second step
compiles nothing, a new micro-batch count (a batch ramp) compiles once.
"""
from __future__ import annotations

import os
import time

import pytest
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2
from p2p_play import posted

pytestmark = pytest.mark.serial  # a rank waits a bounded time for its peer's flag
VOCAB = 203


def _rank(rank: int, flag_dir: str, patience: dict) -> dict:
    import ds_mp

    out = {}
    for post, wait_s in patience.items():
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=VOCAB), config=ds_config(pp=2, gas=3))
        engine.post_sends = post
        flag, seen = os.path.join(flag_dir, f"sent-{post}"), []
        if rank == 0:
            send = engine._exec_send_activations

            def send_then_flag(buffer_id: int) -> None:
                send(buffer_id)
                open(flag, "a").close()
            engine._exec_send_activations = send_then_flag  # the instruction map dispatches by name
        else:
            recv = engine._exec_recv_activations

            def flag_then_recv(buffer_id: int) -> None:
                if not seen:  # the first receive: wait for rank 0's first send to have returned
                    deadline = time.monotonic() + wait_s
                    while not os.path.exists(flag) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    seen.append(os.path.exists(flag))
                recv(buffer_id)
            engine._exec_recv_activations = flag_then_recv
        loss = float(engine.train_batch(iter(batches(3, 2, 16, VOCAB))))
        out[f"overtake-{post}"] = engine.sends_overtake_receives()
        out[post] = (seen, loss, len(engine.posted) == 0,
                     [p.detach().clone() for p in engine.module.parameters()])
    out["overtake-nccl"] = _on_nccl(engine)
    out["zb-h1 compiled posted"] = [_compiled_posted(post) for post in (True, False)]
    return out


def _compiled_posted(post: bool) -> bool:
    """Whether the schedule a zb-h1 engine ran was compiled for posted sends."""
    import ds_mp

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=VOCAB), config=ds_config(pp=2, gas=2, schedule="zb-h1"))
    engine.post_sends, ran = post, []
    execute = engine._exec_schedule
    engine._exec_schedule = lambda sched: (execute(sched), ran.append(sched.posted_sends))
    engine.train_batch(iter(batches(2, 2, 16, VOCAB)))
    return ran == [True]


def _on_nccl(engine) -> bool:
    import torch.distributed as dist

    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        return engine.sends_overtake_receives()
    finally:
        dist.get_backend = real


def test_a_sender_does_not_wait_for_its_receiver(tmp_path) -> None:
    # posted: rank 0's send returns while rank 1 waits (generous patience for a loaded machine);
    # blocking: it cannot, so 3 s of patience suffice to see rank 1 give up
    ranks = run_ranks(_rank, 2, str(tmp_path), {True: 120.0, False: 3.0}, timeout=400)
    assert ranks[1][True][0] == [True]
    assert ranks[1][False][0] == [False]
    for r in ranks:
        # timetables compile sends right after their value only where sends overtake receives (gloo)
        assert r["overtake-True"] and not r["overtake-False"] and not r["overtake-nccl"]
        assert r["zb-h1 compiled posted"] == [True, False]  # the engine tells the timetable
        assert r[True][2] and r[False][2]  # nothing left in flight after the step
        assert r[True][1] == r[False][1]
        assert all((a == b).all() for a, b in zip(r[True][3], r[False][3]))


# ------------------------------------------------------------------ waits for what the receiver took

def _schedules(name: str, K: int, M: int, posted_sends: bool) -> tuple[list, bool]:
    """Every stage's schedule of ``name`` (K stages, M micro-batches) and whether it is a ring."""
    from ds_mp.schedules.gpipe import GPipe, OneFOneB
    from ds_mp.schedules.interleaved import Interleaved1F1B
    from ds_mp.schedules.terapipe.schedule import TeraPipe1F1B, TeraPipeSchedule
    from ds_mp.schedules.zero_bubble import ZeroBubbleH1

    make = {"1f1b": lambda s: OneFOneB(micro_batches=M, stages=K, stage_id=s),
            "gpipe": lambda s: GPipe(micro_batches=M, stages=K, stage_id=s),
            "terapipe": lambda s: TeraPipeSchedule(M, K, s, [(1, [3, 5])]),
            "terapipe-1f1b": lambda s: TeraPipe1F1B(M, K, s, [(1, [3, 5])]),
            "zb-h1": lambda s: ZeroBubbleH1(micro_batches=M, stages=K, stage_id=s),
            "interleaved": lambda s: Interleaved1F1B(M, K, s, 2)}[name]
    scheds = [make(s) for s in range(K)]
    for x in scheds:
        if hasattr(x, "posted_sends"):
            x.posted_sends = posted_sends
    return scheds, name == "interleaved"


def _most_in_flight(name: str, K: int, M: int, posted_sends: bool) -> int:
    """Plays the stages with posted sends, each send waited for once acknowledged (the timetable's
    ``acknowledged()``, else every send to the peer so far): the most sends any stage holds."""
    scheds, ring = _schedules(name, K, M, posted_sends)
    acks = [list(x.acknowledged()) for x in scheds] if hasattr(scheds[0], "acknowledged") else None
    sends: list[dict[int, int]] = [dict() for _ in range(K)]  # per stage and peer: sends so far
    waited: list[dict[int, int]] = [dict() for _ in range(K)]  # ... of which waited for
    most = [0]

    def peer(s: int, c) -> int:
        p = s + 1 if isinstance(c, (ds.SendActivation, ds.RecvGrad)) else s - 1
        return p % K if ring else p

    def sent(s: int, c) -> None:
        sends[s][peer(s, c)] = sends[s].get(peer(s, c), 0) + 1
        most[0] = max(most[0], sum(sends[s].values()) - sum(waited[s].values()))

    def received(s: int, c, send, payload) -> None:
        p = peer(s, c)
        waited[s][p] = max(waited[s].get(p, 0), acks[s].pop(0) if acks else sends[s].get(p, 0))

    posted([list(x.steps()) for x in scheds], lambda s, c: None, sent, received, ring=ring,
           acks=[list(a) for a in acks] if acks else None)
    return most[0]


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "terapipe", "terapipe-1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("posted_sends", [True, False])
def test_acknowledged_sends_were_received_and_stay_few(name: str, posted_sends: bool) -> None:
    """Every wait is for sends the peer had received before sending the acknowledging message
    (``p2p_play.posted`` checks each); the sends held stay as many at M = 36 as at M = 12, except in
    the all-forwards-first orders (GPipe, TeraPipe), whose stages hold every micro-batch's
    activations anyway."""
    if name in ("1f1b", "gpipe", "terapipe") and not posted_sends:
        return  # one stream for both
    for K in (2, 3, 4):
        few, many = (_most_in_flight(name, K, M, posted_sends) for M in (12, 36))
        if name not in ("gpipe", "terapipe"):
            assert many == few <= 3 * K, (name, K, few, many)  # a warm-up's worth (interleaved: v + 1 rounds)


def _bounded_rank(rank: int) -> dict:
    import ds_mp
    from ds_mp.schedules import timetable

    compiles, compile_stream = [0], timetable.rounds

    def counted(*args, **kwargs):
        compiles[0] += 1
        return compile_stream(*args, **kwargs)

    timetable.rounds = counted
    out = {}
    for schedule in ("1f1b", "zb-h1", "interleaved"):
        extra = {"pipeline": {"virtual_stages": 2}} if schedule == "interleaved" else {}
        for post in (True, False):
            cfg = ds_config(pp=2, micro=1, gas=4, lr=0.1, schedule=schedule, **extra)
            engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=VOCAB), config=cfg)
            engine.post_sends = post
            losses, peaks, compiled = [], [], []
            for step, gas in enumerate((4, 16, 16)):  # a batch ramp's step to 16 micro-batches
                engine.set_train_batch_size(gas)
                before = compiles[0]
                losses.append(float(engine.train_batch(iter(batches(gas, 1, 16, VOCAB, seed=step)))))
                peaks.append(engine.posted.peak_bytes)
                compiled.append(compiles[0] - before)
            out[(schedule, post)] = (losses, peaks, compiled, [p.detach().clone() for p in engine.module.parameters()])
    return out


@pytest.fixture(scope="module")
def bounded() -> list[dict]:
    return run_ranks(_bounded_rank, 2, timeout=400)


def test_posted_bytes_stay_bounded_as_micro_batches_grow(bounded) -> None:
    """PP = 2, 1F1B, ZB-H1 and interleaved: the most bytes pinned by posted sends at once is the
    same at 16 micro-batches as at 4, and every step equals blocking sends bit for bit."""
    for r in bounded:
        for schedule in ("1f1b", "zb-h1", "interleaved"):
            (losses, peaks, _, w), (b_losses, b_peaks, _, b_w) = r[(schedule, True)], r[(schedule, False)]
            assert 0 < peaks[0] and peaks[1] == peaks[2] <= peaks[0], (schedule, peaks)
            assert b_peaks == [0, 0, 0]
            assert losses == b_losses and all((a == b).all() for a, b in zip(w, b_w)), schedule


def test_timetable_compiled_once_per_micro_batch_count(bounded) -> None:
    """A timetable schedule (ZB-H1, interleaved) is compiled on its first step, not again on a
    second step with the same inputs, and again when a batch ramp changes the micro-batch count."""
    for r in bounded:
        for post in (True, False):
            assert r[("1f1b", post)][2] == [0, 0, 0]  # DeepSpeed's own TrainSchedule
            for schedule in ("zb-h1", "interleaved"):
                assert r[(schedule, post)][2] == [1, 1, 0], (schedule, post, r[(schedule, post)][2])
