"""Ouroboros placement and timetable: which rank holds which module, and what each rank does
at iteration t (the algebra is in ``ds_mp.schedules.ouroboros.algorithm``'s docstring).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from deepspeed.runtime.pipe.schedule import PipeSchedule



# ----------------------------------------------------------------------------- split and layout
def split_modules(n_layer: int, K: int) -> list[range]:
    """Block indices of G_0..G_{K-1}, contiguous and in order.

    Balanced per rank, since ranks are what run in parallel: the n_layer blocks are dealt to the
    K-1 ranks as evenly as possible, the remainder to the last ranks (rank 0 also carries the
    embedding and the head); rank 0's share b is split G_0 = b // 2, G_{K-1} = b - b // 2 blocks.
    G_0 may thus hold the embedding alone. Needs K >= 2 and n_layer >= K-1 (a block per rank).
    """
    if K < 2 or n_layer < K - 1:
        raise ValueError(f"Ouroboros needs K >= 2 modules and n_layer >= K-1 (one block per rank); "
                         f"got K={K}, n_layer={n_layer}")
    ranks = K - 1
    base, extra = divmod(n_layer, ranks)
    share = [base + (r >= ranks - extra) for r in range(ranks)]  # share[0] == base
    sizes = [share[0] // 2, *share[1:], share[0] - share[0] // 2]
    starts = [sum(sizes[:m]) for m in range(K)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def ring_layout(K: int) -> list[list[int]]:
    """rank -> module ids it holds: [[0, K-1], [1], ..., [K-2]] (K=2: one rank, [[0, 1]])."""
    if K < 2:
        raise ValueError(f"Ouroboros needs K >= 2 modules; got K={K}")
    return [[0, K - 1]] + [[m] for m in range(1, K - 1)]


def module_owner(K: int) -> dict[int, int]:
    """module id -> ring rank holding it (the inverse of ring_layout)."""
    return {m: r for r, mods in enumerate(ring_layout(K)) for m in mods}


# ----------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Forward:
    """h_{m+1}^s = G_m(h_m^s; w^t), input stashed; G_{K-1}'s forward runs inside its Backward."""
    module: int
    sample: int

    def __str__(self) -> str:
        return f"F{self.module}:{self.sample}"


@dataclass(frozen=True)
class Backward:
    """G_m backprops delta_m^s; m < K-1 replays on its stash with w^t, G_{K-1} computes f_s and df_s."""
    module: int
    sample: int

    def __str__(self) -> str:
        return f"B{self.module}:{self.sample}"


@dataclass(frozen=True)
class _Message:
    """A p2p message produced by G_module for `sample`; `peer` is the other rank."""
    module: int
    sample: int
    peer: int
    _fmt = ""

    def __str__(self) -> str:
        return self._fmt.format(m=self.module, s=self.sample, p=self.peer)


class SendAct(_Message):
    """Send h_{m+1}^s (output of G_m) to the rank of G_{m+1}."""
    _fmt = "a{m}:{s}>r{p}"


class RecvAct(_Message):
    """Receive h_{m+1}^s (output of G_m) from the rank of G_m; G_{m+1} forwards it now."""
    _fmt = "a{m}:{s}<r{p}"


class SendGrad(_Message):
    """Send delta_{m-1}^s (gradient w.r.t. G_m's input) to the rank of G_{m-1}."""
    _fmt = "g{m}:{s}>r{p}"


class RecvGrad(_Message):
    """Receive delta_{m-1}^s from the rank of G_m; G_{m-1} backprops it at the next iteration
    (delay) or later in this one (no delay)."""
    _fmt = "g{m}:{s}<r{p}"


@dataclass(frozen=True)
class OptimizerStep:
    """Every rank updates every module it holds (zero gradient in warm-up)."""

    def __str__(self) -> str:
        return "step"


Step = Union[Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad, OptimizerStep]


# ----------------------------------------------------------------------------- timetable
def rank_steps(K: int, t: int, rank: int, delay: bool = True) -> list[Step]:
    """Ordered actions of ring `rank` at iteration t (blocking p2p, posted in order).

    delay=True (Algorithm 1; G_m backprops sample t - d_m, d_m = K-1-m):
      rank 0:  F0:t  a0:t>r1  B0:t-K+1  a(K-2):t<r(K-2)  F(K-1):t  B(K-1):t  g1:t-K+2<r1  g(K-1):t>r(K-2)  step
      rank r:  a(r-1):t<  Fr:t  ar:t>  Br:t-d_r  gr:t-d_r>  g(r+1):t-d_r+1<  step
    The forward is sequential across ranks (DDG locks the forward); what runs in parallel is the
    backward (replay + backprop): rank r replays while the ranks after it forward, rank 0 replays
    G_0 while the chain runs. Rank 0 receives g1 before it sends g(K-1), which breaks the gradient
    ring (deadlock-free with blocking sends).
    delay=False (synchronous backprop, for testing): forward chain, then the backward chain
      rank 0:  F0:t  a0:t>r1  a(K-2):t<  F(K-1):t  B(K-1):t  g(K-1):t>  g1:t<r1  B0:t  step
      rank r:  a(r-1):t<  Fr:t  ar:t>  g(r+1):t<  Br:t  gr:t>  step
    Messages between modules on the same rank (K=2) are local handoffs and not listed.
    """
    owner, last = module_owner(K), K - 1

    def sample(m: int) -> int | None:  # sample G_m backprops at iteration t
        s = t - (K - 1 - m if delay else 0)
        return s if s >= 0 else None

    def msg(cls: type[_Message], m: int, s: int | None, peer: int) -> list[Step]:
        return [cls(m, s, peer)] if s is not None and peer != rank else []

    if rank == 0:
        fwd = [Forward(0, t), *msg(SendAct, 0, t, owner[1])]
        head = [*msg(RecvAct, K - 2, t, owner[K - 2]), Forward(last, t), Backward(last, t)]
        send_head = msg(SendGrad, last, t, owner[K - 2])
        if not delay:
            return fwd + head + send_head + msg(RecvGrad, 1, t, owner[1]) + [Backward(0, t), OptimizerStep()]
        s0 = sample(0)
        replay: list[Step] = [Backward(0, s0)] if s0 is not None else []
        return fwd + replay + head + msg(RecvGrad, 1, sample(1), owner[1]) + send_head + [OptimizerStep()]
    s, s_up = sample(rank), sample(rank + 1)
    row: list[Step] = [RecvAct(rank - 1, t, owner[rank - 1]), Forward(rank, t), SendAct(rank, t, owner[rank + 1])]
    backward: list[Step] = [Backward(rank, s), SendGrad(rank, s, owner[rank - 1])] if s is not None else []
    recv_up = msg(RecvGrad, rank + 1, s_up, owner[rank + 1])
    return row + (backward + recv_up if delay else recv_up + backward) + [OptimizerStep()]


def ouroboros_timetable(K: int, T: int, delay: bool = True) -> list[list[list[Step]]]:
    """table[t][rank] = rank_steps(K, t, rank, delay) for t < T and every ring rank."""
    return [[rank_steps(K, t, r, delay) for r in range(K - 1)] for t in range(T)]


def format_timetable(table: list[list[list[Step]]]) -> str:
    """One line per (iteration, rank), e.g. 't=3 r1 | a0:3<r0 F1:3 a1:3>r2 B1:1 g1:1>r0 g2:2<r2 step'."""
    return "\n".join(f"t={t} r{r} | " + " ".join(map(str, row))
                     for t, rows in enumerate(table) for r, row in enumerate(rows))


class OuroborosSchedule(PipeSchedule):
    """Ouroboros as a DeepSpeed ``PipeSchedule`` for one ring rank.

    ``stages`` = K-1 ring ranks, ``stage_id`` = ring rank, ``micro_batches`` = iterations; step i
    yields ``rank_steps(K, start + i, stage_id, delay)`` (Step value objects, executed by
    ``OuroborosEngine``, not by DeepSpeed's PipelineEngine). The engine builds a new one-iteration
    schedule per ``train_batch`` with ``start`` = its iteration t, as DeepSpeed does.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, start: int = 0, delay: bool = True) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.start, self.delay = start, delay

    @classmethod
    def from_engine(cls, engine) -> "OuroborosSchedule":
        return cls(micro_batches=1, stages=engine.ring_size, stage_id=engine.ring_rank,
                   start=engine.iteration, delay=engine.delay)

    def steps(self) -> Iterator[list[Step]]:
        for t in range(self.start, self.start + self.micro_batches):
            yield rank_steps(self.stages + 1, t, self.stage_id, self.delay)

    def num_pipe_buffers(self) -> int:
        """Most inputs this rank keeps stashed at once: d_m + 1 = K - m for its first module."""
        return self.stages + 1 - self.stage_id if self.delay else 1

