"""Plays compiled pipeline schedules against each other, without torch: every stage's step
``t`` instructions run in order; a send and the matching receive at the heads of two
neighbouring stages' queues meet (blocking rendezvous, as DeepSpeed's gloo p2p; or, with
:func:`posted`, sends that never wait, as ds_mp's engine posts them); a step in which
no stage can move is a deadlock and fails.  The caller's callbacks track what each buffer holds
and check the data flow (each schedule test has its own units and compute instructions)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from deepspeed.runtime.pipe import schedule as ds

P2P = (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad)


def rendezvous(streams: Sequence[Sequence[Sequence[Any]]], compute: Callable[[int, Any], None],
               transfer: Callable[[int, int, Any, Any], None], ring: bool = False, same_length: bool = True) -> None:
    """Run ``streams[s][t]`` (stage s's instructions of step t) for every step.

    ``compute(s, cmd)`` is called for each non-p2p instruction in order; ``transfer(src, dst,
    send, recv)`` when a ``SendActivation``/``SendGrad`` at the head of stage ``src`` meets the
    ``RecvActivation``/``RecvGrad`` at the head of its peer ``dst`` (activations go to s + 1,
    gradients to s - 1; ``ring``: modulo the stage count, the interleaved wrap).  A p2p
    instruction without a neighbour fails; ``same_length``: every stage runs as many steps."""
    K = len(streams)
    if same_length:
        assert len({len(x) for x in streams}) == 1, "every stage runs the same number of steps"
    for t in range(max(len(x) for x in streams)):
        queues = [list(x[t]) if t < len(x) else [] for x in streams]
        while any(queues):
            progressed = False
            for s, q in enumerate(queues):
                while q and not isinstance(q[0], P2P):
                    compute(s, q.pop(0))
                    progressed = True
                if not q:
                    continue
                c = q[0]
                peer = s + 1 if isinstance(c, (ds.SendActivation, ds.RecvGrad)) else s - 1
                if ring:
                    peer %= K
                assert 0 <= peer < K, f"stage {s} step {t}: {c} has no neighbour"
                other = queues[peer][0] if queues[peer] else None
                if not ((isinstance(c, ds.SendActivation) and isinstance(other, ds.RecvActivation))
                        or (isinstance(c, ds.SendGrad) and isinstance(other, ds.RecvGrad))):
                    continue
                transfer(s, peer, c, other)
                q.pop(0), queues[peer].pop(0)
                progressed = True
            assert progressed, f"step {t}: deadlock {[[repr(c) for c in q] for q in queues]}"


def posted(streams: Sequence[Sequence[Sequence[Any]]], compute: Callable[[int, Any], None],
           sent: Callable[[int, Any], Any], received: Callable[[int, Any, Any, Any], None], ring: bool = False,
           acks: Sequence[Sequence[int]] | None = None) -> None:
    """Run every stage's instructions (steps concatenated) with *posted* sends, as the engine does.

    A send never waits: ``sent(s, send)`` returns its payload (what the sender's buffer holds
    now) and the message joins the FIFO of its channel (one per ordered pair of stages: one tag,
    as gloo); a receive takes the oldest message on its channel, which must be of its kind
    (``received(dst, recv, send, payload)``), or waits.  No stage able to move is a deadlock.

    Acknowledgements: after a receive the engine waits for its first n sends to the sender, n =
    ``acks[s]``'s next entry (or, with ``acks`` None, every send to the sender so far: DeepSpeed's
    own schedules).  Each message carries how many messages its sender had received from the
    receiver when sending it; n must not exceed that, so the wait is for sends already received."""
    K = len(streams)
    queues = [[c for step in x for c in step] for x in streams]
    channels: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], int] = {}  # (receiver, sender) -> messages received
    sent_to: dict[tuple[int, int], int] = {}  # (sender, receiver) -> messages sent
    left = [list(a) for a in acks] if acks is not None else None
    while any(queues):
        progressed = False
        for s, q in enumerate(queues):
            while q:
                c = q[0]
                if not isinstance(c, P2P):
                    compute(s, q.pop(0))
                    progressed = True
                    continue
                peer = s + 1 if isinstance(c, (ds.SendActivation, ds.RecvGrad)) else s - 1
                peer = peer % K if ring else peer
                assert 0 <= peer < K, f"stage {s}: {c} has no neighbour"
                if isinstance(c, (ds.SendActivation, ds.SendGrad)):
                    channels.setdefault((s, peer), []).append((c, sent(s, c), got.get((s, peer), 0)))
                    sent_to[(s, peer)] = sent_to.get((s, peer), 0) + 1
                else:
                    fifo = channels.get((peer, s))
                    if not fifo:
                        break
                    send, payload, stamp = fifo.pop(0)
                    want = ds.SendActivation if isinstance(c, ds.RecvActivation) else ds.SendGrad
                    assert isinstance(send, want), f"stage {s}: {c} would receive {send} (channel order)"
                    n = left[s].pop(0) if left is not None else sent_to.get((s, peer), 0)
                    assert n <= stamp, f"stage {s}: {c} acknowledges {n} sends to stage {peer}, which had " \
                                       f"received {stamp} of them when it sent the message"
                    got[(s, peer)] = got.get((s, peer), 0) + 1
                    received(s, c, send, payload)
                q.pop(0)
                progressed = True
        assert progressed, f"deadlock {[[repr(c) for c in q[:3]] for q in queues]}"
    assert not any(channels.values()), f"messages never received: {channels}"
    assert left is None or not any(left), f"acknowledgements of receives never run: {left}"


def play_compiled(streams: Sequence[Sequence[Sequence[Any]]], compute: Callable[[int, Any], None],
                  sent: Callable[[int, Any], Any], received: Callable[[int, Any, Any, Any], None],
                  posted_sends: bool, ring: bool = False, acks: Sequence[Sequence[int]] | None = None) -> None:
    """Play streams compiled for posted sends with :func:`posted` (checking the schedules'
    ``acks``), else with :func:`rendezvous` (the payload leaves and arrives at the meeting); the
    callbacks are :func:`posted`'s."""
    if posted_sends:
        posted(streams, compute, sent, received, ring=ring, acks=acks)
    else:
        rendezvous(streams, compute, lambda s, peer, send, recv: received(peer, recv, send, sent(s, send)), ring=ring)
