"""Ouroboros placement and timetable: which rank holds which module, and what each rank does
at iteration t (the algebra is in the docstring of the tests' single-process reference,
``tests/ouroboros_oracle.py``).
"""
from __future__ import annotations

from typing import Any, Iterator, Union

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from ds_mp.models.family import family_of



# ----------------------------------------------------------------------------- split and layout
def split_modules(n_layer: int, K: int, split: str | list[int] = "balanced", head_blocks: float = 0.0) -> list[range]:
    """Block indices of G_0..G_{K-1}, contiguous and in order.

    ``"balanced"`` (default): balanced per *rank*, since ranks are what run in parallel.  Ring
    rank 0 runs G_0 and G_{K-1} plus the embedding and the LM head + loss, which cost about
    ``head_blocks`` blocks (a block's matmuls are 12·C² MACs per token, the head's V·C, so
    ``head_blocks ≈ V / (12 C)``); the blocks are dealt so the most expensive rank is as cheap as
    possible (ties: the most even ranks, then fewer blocks on rank 0; remainders to the last
    ranks), and rank 0's share b
    is split G_0 = b // 2, G_{K-1} = b - b // 2.  G_0 may hold the embedding alone.
    ``"equal"``: the paper's K modules of equal block counts (remainder to the middle modules).
    A list: blocks per module (K non-negative counts summing to n_layer, ≥ 1 for 0 < m < K-1).
    Needs K >= 2 and n_layer >= K-1 (a block per rank).
    """
    if K < 2 or n_layer < K - 1:
        raise ValueError(f"Ouroboros needs K >= 2 modules and n_layer >= K-1 (one block per rank); "
                         f"got K={K}, n_layer={n_layer}")
    if isinstance(split, list):
        sizes = list(split)
        if len(sizes) != K or sum(sizes) != n_layer or any(n < 0 for n in sizes) or any(n < 1 for n in sizes[1:-1]):
            raise ValueError(f"Ouroboros split {sizes}: need {K} block counts summing to {n_layer}, "
                             "at least 1 for every middle module")
    elif split == "equal":
        base, extra = divmod(n_layer, K)
        order = [*range(1, K - 1), 0, K - 1]  # remainder to the middle modules first
        sizes = [base + (m in order[:extra]) for m in range(K)]
    elif split == "balanced":
        others = K - 2

        def shares(c0: int) -> list[int]:
            base, extra = divmod(n_layer - c0, others) if others else (0, 0)
            return [c0, *(base + (r >= others - extra) for r in range(others))]

        def costs(c: int) -> list[float]:
            return [c + head_blocks, *shares(c)[1:]]

        c0 = min(range(0 if others else n_layer, n_layer - others + 1),
                 key=lambda c: (max(costs(c)), max(costs(c)) - min(costs(c)), c))
        share = shares(c0)
        sizes = [share[0] // 2, *share[1:], share[0] - share[0] // 2]
    else:
        raise ValueError(f"Ouroboros split {split!r}: use 'balanced', 'equal' or a list of {K} block counts")
    starts = [sum(sizes[:m]) for m in range(K)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def config_split(cfg: Any, hf_config: Any) -> list[range]:
    """The module split of a validated ds_mp config (``ouroboros.split``, K = pipeline.stages + 1)
    for the model ``hf_config`` (its family's block cost weighs the head)."""
    shape = cfg.shape
    return split_modules(shape.n_layer, cfg.pp + 1, cfg.ouroboros.split,
                         head_blocks=head_cost_in_blocks(shape.vocab_size, shape.n_embd,
                                                         family_of(hf_config).block_parameters(hf_config)))


def head_cost_in_blocks(vocab: int, n_embd: int, block_params: int | None = None) -> float:
    """The LM head's matmul cost in blocks: V·C MACs per token over a block's ``block_params``
    (``Family.block_parameters``; GPT-2's 12·C² by default)."""
    return vocab * n_embd / (block_params or 12 * n_embd * n_embd)


def ring_layout(K: int) -> list[list[int]]:
    """rank -> module ids it holds: [[0, K-1], [1], ..., [K-2]] (K=2: one rank, [[0, 1]])."""
    if K < 2:
        raise ValueError(f"Ouroboros needs K >= 2 modules; got K={K}")
    return [[0, K - 1]] + [[m] for m in range(1, K - 1)]


def ring_pipeline_layout(mods: list[range], layers: list[str], lead: int, tail: int) -> tuple[list[str], list[int]]:
    """A family's pipeline layers (``layers`` = ``Family.pipeline_layers``: ``lead`` layers, the
    blocks, ``tail`` layers) reordered so each ring rank's modules are contiguous: rank 0 holds
    ``lead layers, G_0's blocks, G_{K-1}'s blocks, tail layers`` (GPT-2: ``wte, wpe, …, ln_f,
    lm_head``; a tied embedding is used by both of its modules), rank r holds G_r's blocks.
    Returns ``(names, parts)``: rank r builds ``names[parts[r]:parts[r+1]]``."""
    K, body = len(mods), layers[lead:len(layers) - tail]
    blocks = [[body[i] for i in mods[m]] for m in range(K)]
    first = [*layers[:lead], *blocks[0], *blocks[K - 1], *layers[len(layers) - tail:]]
    names, parts = list(first), [0, len(first)]
    for m in range(1, K - 1):
        names += blocks[m]
        parts.append(len(names))
    return names, parts


def module_owner(K: int) -> dict[int, int]:
    """module id -> ring rank holding it (the inverse of ring_layout)."""
    return {m: r for r, mods in enumerate(ring_layout(K)) for m in mods}


# ----------------------------------------------------------------------------- instructions
class _RingInstruction(PipeInstruction):
    """A DeepSpeed ``PipeInstruction`` naming module ``m``, sample ``s``, (messages) the ring
    ``peer`` and, when an iteration has several micro-batches, the ``micro``-batch j of x_s it
    carries; compared by value, printed in the timetable's short form (``s.j`` for a micro-batch)."""

    _fmt = ""

    def __init__(self, module: int, sample: int, peer: int | None = None, micro: int | None = None) -> None:
        kwargs = {"module": module, "sample": sample}
        if peer is not None:
            kwargs["peer"] = peer
        if micro is not None:
            kwargs["micro"] = micro
        super().__init__(**kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.kwargs.items()))))

    def __str__(self) -> str:
        j = self.kwargs.get("micro")
        return self._fmt.format(m=self.module, s=self.sample if j is None else f"{self.sample}.{j}",
                                p=self.kwargs.get("peer"))


class ModuleForward(_RingInstruction):
    """h_{m+1}^s = G_m(h_m^s; w^t) for micro-batch j of x_s, input stashed; G_{K-1}'s forward runs
    inside its backward."""
    _fmt = "F{m}:{s}"


class ModuleBackward(_RingInstruction):
    """G_m backprops delta_m^s: m < K-1 replays every micro-batch of its stash with w^t (no
    ``micro``); G_{K-1} computes micro-batch j's share of f_s and df_s (``micro`` = j)."""
    _fmt = "B{m}:{s}"


class SendHidden(_RingInstruction):
    """Send h_{m+1}^s (output of G_m; micro-batch j) to the rank of G_{m+1}, without waiting for
    it to arrive (the engine posts every send asynchronously and completes it at UpdateModules)."""
    _fmt = "a{m}:{s}>r{p}"


class RecvHidden(_RingInstruction):
    """Receive h_{m+1}^s (output of G_m) from the rank of G_m; G_{m+1} forwards it now."""
    _fmt = "a{m}:{s}<r{p}"


class SendDelta(_RingInstruction):
    """Send delta_{m-1}^s (gradient w.r.t. G_m's input; micro-batch j) to the rank of G_{m-1},
    asynchronously like SendHidden."""
    _fmt = "g{m}:{s}>r{p}"


class RecvDelta(_RingInstruction):
    """Receive delta_{m-1}^s from the rank of G_m; G_{m-1} backprops it at the next iteration
    (delay) or later in this one (no delay)."""
    _fmt = "g{m}:{s}<r{p}"


class UpdateModules(PipeInstruction):
    """p.grad = Σ of the module gradients of p (the tied V: tie_scale·(dV_o + dV_i)), then the
    engine's shared DP reduce (DeepSpeed's ReduceGrads) and optimizer step (clipping, NaN skip)."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)

    def __str__(self) -> str:
        return "step"


Step = Union[ModuleForward, ModuleBackward, SendHidden, RecvHidden, SendDelta, RecvDelta, UpdateModules]


# ----------------------------------------------------------------------------- timetable
def rank_steps(K: int, t: int, rank: int, delay: bool = True, micro_batches: int = 1) -> list[Step]:
    """Ordered actions of ring `rank` at iteration t (sends posted asynchronously, receives blocking).

    delay=True (Algorithm 1; G_m backprops sample t - d_m, d_m = K-1-m), one micro-batch:
      rank 0:  F0:t  a0:t>r1  B0:t-K+1  a(K-2):t<r(K-2)  F(K-1):t  B(K-1):t  g1:t-K+2<r1  g(K-1):t>r(K-2)  step
      rank r:  a(r-1):t<  Fr:t  ar:t>  Br:t-d_r  gr:t-d_r>  g(r+1):t-d_r+1<  step
    The forward is sequential across ranks (DDG locks the forward); what runs in parallel is the
    backward (replay + backprop): rank r replays while the ranks after it forward, rank 0 replays
    G_0 while the chain runs.

    ``micro_batches`` = M > 1 pipelines the locked forward over x_t's M micro-batches j (written
    ``t.j``): each G_m forwards and sends micro-batch j as soon as it has it, so G_{m+1} works on
    j while G_m works on j+1, and G_{K-1} computes f_t and df_t one micro-batch at a time (their
    sums are the whole batch's: the same update).  Replays stay per sample (B0:t-K+1 runs every
    micro-batch of its stash) and deltas travel per micro-batch:
      rank 0:  [F0:t.j a0:t.j>r1]_j  B0:t-K+1  [a(K-2):t.j< F(K-1):t.j B(K-1):t.j]_j  [g1:t-K+2.j<]_j  [g(K-1):t.j>]_j  step
      rank r:  [a(r-1):t.j< Fr:t.j ar:t.j>]_j  Br:t-d_r  [gr:t-d_r.j>]_j  [g(r+1):t-d_r+1.j<]_j  step
    Sends never wait for their receiver (the forward pipeline would otherwise deadlock: rank 0
    sends a0:t.1 while rank 1 sends a1:t.0); rank 0 receives g1 before it sends g(K-1), which also
    keeps M=1 deadlock-free with blocking sends.
    delay=False (synchronous backprop, for testing): forward chain, then the backward chain
      rank 0:  F0:t  a0:t>r1  a(K-2):t<  F(K-1):t  B(K-1):t  g(K-1):t>  g1:t<r1  B0:t  step
      rank r:  a(r-1):t<  Fr:t  ar:t>  g(r+1):t<  Br:t  gr:t>  step
    Messages between modules on the same rank (K=2) are local handoffs and not listed.
    """
    owner, last = module_owner(K), K - 1
    micros: list[int | None] = [None] if micro_batches == 1 else list(range(micro_batches))

    def sample(m: int) -> int | None:  # sample G_m backprops at iteration t
        s = t - (K - 1 - m if delay else 0)
        return s if s >= 0 else None

    def msg(cls: type[_RingInstruction], m: int, s: int | None, peer: int, j: int | None) -> list[Step]:
        return [cls(m, s, peer, j)] if s is not None and peer != rank else []

    def msgs(cls: type[_RingInstruction], m: int, s: int | None, peer: int) -> list[Step]:
        return [st for j in micros for st in msg(cls, m, s, peer, j)]

    if rank == 0:
        fwd = [st for j in micros for st in [ModuleForward(0, t, micro=j), *msg(SendHidden, 0, t, owner[1], j)]]
        head = [st for j in micros for st in [*msg(RecvHidden, K - 2, t, owner[K - 2], j),
                                              ModuleForward(last, t, micro=j), ModuleBackward(last, t, micro=j)]]
        send_head = msgs(SendDelta, last, t, owner[K - 2])
        if not delay:
            return fwd + head + send_head + msgs(RecvDelta, 1, t, owner[1]) + [ModuleBackward(0, t), UpdateModules()]
        s0 = sample(0)
        replay: list[Step] = [ModuleBackward(0, s0)] if s0 is not None else []
        return fwd + replay + head + msgs(RecvDelta, 1, sample(1), owner[1]) + send_head + [UpdateModules()]
    s, s_up = sample(rank), sample(rank + 1)
    row: list[Step] = [st for j in micros for st in [RecvHidden(rank - 1, t, owner[rank - 1], j),
                                                     ModuleForward(rank, t, micro=j),
                                                     SendHidden(rank, t, owner[rank + 1], j)]]
    backward: list[Step] = [ModuleBackward(rank, s), *msgs(SendDelta, rank, s, owner[rank - 1])] if s is not None else []
    recv_up = msgs(RecvDelta, rank + 1, s_up, owner[rank + 1])
    return row + (backward + recv_up if delay else recv_up + backward) + [UpdateModules()]


def ouroboros_timetable(K: int, T: int, delay: bool = True, micro_batches: int = 1) -> list[list[list[Step]]]:
    """table[t][rank] = rank_steps(K, t, rank, delay, micro_batches) for t < T and every ring rank."""
    return [[rank_steps(K, t, r, delay, micro_batches) for r in range(K - 1)] for t in range(T)]


def format_timetable(table: list[list[list[Step]]]) -> str:
    """One line per (iteration, rank), e.g. 't=3 r1 | a0:3<r0 F1:3 a1:3>r2 B1:1 g1:1>r0 g2:2<r2 step'."""
    return "\n".join(f"t={t} r{r} | " + " ".join(map(str, row))
                     for t, rows in enumerate(table) for r, row in enumerate(rows))


class OuroborosSchedule(PipeSchedule):
    """Ouroboros as a DeepSpeed ``PipeSchedule`` for one ring rank.

    ``stages`` = K-1 ring ranks, ``stage_id`` = ring rank, ``micro_batches`` = iterations, ``chunks``
    = micro-batches per iteration (DeepSpeed's gradient_accumulation_steps); step i yields
    ``rank_steps(K, start + i, stage_id, delay, chunks)``, run by ds_mp's pipeline engine like any
    schedule (handlers in ``ds_mp.engine.ouroboros``).  The engine builds a new one-iteration
    schedule per ``train_batch`` with ``start`` = its iteration t, as DeepSpeed does.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, start: int = 0, delay: bool = True,
                 chunks: int = 1) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.start, self.delay, self.chunks = start, delay, chunks

    @classmethod
    def from_engine(cls, engine) -> "OuroborosSchedule":
        state = engine.schedule_support
        return cls(micro_batches=1, stages=engine.num_stages, stage_id=engine.stage_id,
                   start=state.next_iteration(), delay=state.delay, chunks=engine.micro_batches)

    @staticmethod
    def pipeline_layout(cfg: Any, hf_config: Any) -> tuple[list[str], list[int]]:
        """The layer order and stage bounds the engine builds ``hf_config``'s model with (K = stages + 1),
        from its family's layer table."""
        family = family_of(hf_config)
        return ring_pipeline_layout(config_split(cfg, hf_config), family.pipeline_layers(hf_config),
                                    family.lead_layers, family.tail_layers)

    def steps(self) -> Iterator[list[Step]]:
        for t in range(self.start, self.start + self.micro_batches):
            yield rank_steps(self.stages + 1, t, self.stage_id, self.delay, self.chunks)

    def num_pipe_buffers(self) -> int:
        """Most inputs this rank keeps stashed at once: d_m + 1 = K - m for its first module."""
        return self.stages + 1 - self.stage_id if self.delay else 1

