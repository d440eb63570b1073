"""Posted p2p sends (``isend``), each waited for once its receiver has taken it: the one place
where every schedule's sends are posted (DeepSpeed's pipe instructions, Ouroboros' ring).

DeepSpeed's pipeline ``p2p.send`` is blocking; on gloo that is a rendezvous with the receiver.
The engine posts its activation and gradient sends instead: ``deepspeed_compat`` lists the
messages DeepSpeed's send handler would send (``activation_messages`` / ``grad_messages``, the
shape announcement first when due, so DeepSpeed's own receive handlers read them unchanged) and
:class:`PostedSends` posts them with ``isend``, keeping every posted tensor referenced,
unmodified, until its send is done.  Nothing of DeepSpeed's is replaced.  On gloo a posted send's
``is_completed()`` stays False until ``wait()`` (DEEPSPEED_FACTS.md), so "done" must be known,
not polled: a send is known received when a message arrives from its peer that the peer sent
after receiving it.  Waiting for it then returns at once.

* A timetable schedule knows, for each receive, how many of this stage's sends to the sender
  the sender had received when it sent the message: read off the sender's own compiled program
  (``TimetableSchedule.acknowledged``; its sends may be compiled ahead of its receives).
* Any other schedule (DeepSpeed's 1F1B, GPipe, TeraPipe) runs one instruction stream with
  blocking or posted sends.  A stream that runs with blocking rendezvous sends cannot have a
  rank send X to a peer and later receive R from it while the peer sends R before receiving X
  (both would block in their sends), so every send to the peer before R was received before R
  left: all sends so far are acknowledged.

What is left in flight at the end of a schedule is waited for there.  With NCCL
``is_completed()`` works and completed sends are dropped as soon as they are seen.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist


class PostedSends:
    """The sends in flight per peer stage, in order, for the schedule being run."""

    def __init__(self) -> None:
        self.inflight: dict[int, list[tuple[int, list]]] = {}  # peer -> [(send number, [(work, tensor)])]
        self.sent: dict[int, int] = {}  # sends posted to each peer this schedule
        self.acks: Iterator[int] | None = None  # the timetable's acknowledgement per receive, in order
        self.peak_bytes = 0  # most bytes held by sends in flight at once, this schedule

    def start(self, schedule: Any) -> None:
        """A new schedule: its acknowledgements (``schedule.acknowledged()``) if it has them."""
        self.wait_all()
        self.sent.clear()
        self.peak_bytes = 0
        acknowledged = getattr(schedule, "acknowledged", None)
        self.acks = iter(acknowledged()) if acknowledged is not None else None

    def post(self, messages: list[torch.Tensor], peer: int, rank: int, group: Any = None) -> None:
        """Post ``messages`` to stage ``peer`` (global rank ``rank``) in order, as one send of
        this schedule (acknowledged as one)."""
        works = [(dist.isend(t, rank, group=group), t) for t in messages]
        n = self.sent.get(peer, 0)
        self.sent[peer] = n + 1
        queue = self.inflight.setdefault(peer, [])
        queue.append((n, works))
        queue[:] = [(i, ws) for i, ws in queue if not all(w.is_completed() for w, _ in ws)]  # NCCL: done
        self.peak_bytes = max(self.peak_bytes, self.bytes())

    def received_from(self, peer: int) -> None:
        """A receive from stage ``peer`` completed: wait for the sends to it that it acknowledges."""
        self._wait(peer, next(self.acks) if self.acks is not None else None)

    def wait_all(self) -> None:
        """Wait until every posted send has left (its tensor may then change or be freed)."""
        for peer in self.inflight:
            self._wait(peer, None)

    def bytes(self) -> int:
        """Bytes of the tensors held by sends in flight."""
        return sum(t.numel() * t.element_size() for q in self.inflight.values() for _, ws in q for _, t in ws)

    def _wait(self, peer: int, count: int | None) -> None:
        """Wait for this schedule's first ``count`` sends to ``peer`` (every one: None)."""
        queue = self.inflight.get(peer, [])
        done = [entry for entry in queue if count is None or entry[0] < count]  # a prefix: numbers ascend
        for _, works in done:
            for work, _ in works:
                work.wait()
        del queue[:len(done)]

    def __len__(self) -> int:
        return sum(len(q) for q in self.inflight.values())


__all__ = ["PostedSends"]
