"""Pipeline sends are posted (``isend``), not a rendezvous with the receiver.

DeepSpeed's ``p2p.send`` blocks until the receiver posts its receive (gloo).  ds_mp's engine
posts activation and gradient sends and waits for them at the end of the schedule
(``DsMpPipelineEngine.post_sends``).  Here rank 1 holds its first receive until rank 0's first
send instruction has returned: posted, it returns at once; blocking (the control), it cannot
return before rank 1 receives, so rank 1 gives up waiting.  Both give the same step bit for bit.
Timetable schedules compile each send right after its value only where a send cannot wait behind
a receive on its link (gloo; not NCCL, which runs a rank pair's p2p in enqueue order on one stream).
"""
from __future__ import annotations

import os
import time

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2

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
        out[post] = (seen, loss, engine._posted == [],
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
