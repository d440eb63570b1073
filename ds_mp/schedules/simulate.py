"""Pipeline schedule simulator: a timetable + per-op costs -> iteration time, busy time, bubble.

A timetable lists, for every stage s = 0 … K−1, the ops that stage runs, in order. A stage runs
one op at a time; an op starts when the stage is free and every prerequisite has finished:

    start(s, op) = max( end(previous op of s),  max_{(s', d) ∈ deps(s, op)} end(s', d) + λ·[s' ≠ s] )

with λ the point-to-point latency. Costs come from a callable cost(stage, op) -> seconds (a
fitted cost model or measurements), dependencies from a callable, so new op kinds (Ouroboros)
only need a new deps function. bubble = 1 − Σ_s busy_s / (K · iteration_time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ds_mp.schedules.terapipe.cost_model import BatchCost, Cost
from ds_mp.schedules.terapipe.planner import Plan, plan_slices, slice_costs


@dataclass(frozen=True, order=True)
class Op:
    kind: str       # "F" forward, "B" backward; other kinds need their own deps function
    micro: int      # micro-batch index
    slice: int = 0  # token slice index inside the micro-batch (TeraPipe), 0 otherwise

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.slice}" if self.slice else "")


Timetable = list[list[Op]]                                  # timetable[stage] = ops in order
Deps = Callable[[int, Op, int], Iterable[tuple[int, Op]]]   # (stage, op, K) -> [(stage', op')]
OpCost = Callable[[int, Op], float]                         # (stage, op) -> seconds


def zero_bubble_deps(stage: int, op: Op, num_stages: int) -> list[tuple[int, Op]]:
    """Dependencies with the backward split in two (ZB-H1): B (input gradient) and W (weight gradient).

        F(s, m)  needs F(s−1, m)
        B(s, m)  needs F(s, m) and B(s+1, m) unless s = K − 1     (only B is on the critical path)
        W(s, m)  needs B(s, m)                                     (W is local: it never blocks a peer)
    """
    if op.kind == "W":
        return [(stage, Op("B", op.micro, op.slice))]
    return pipeline_deps(stage, op, num_stages)


def pipeline_deps(stage: int, op: Op, num_stages: int) -> list[tuple[int, Op]]:
    """Data dependencies of a pipeline schedule (GPipe, 1F1B, TeraPipe):

        F(s, m, i) needs F(s−1, m, i)                     (activations from the previous stage)
                   and   F(s, m, i−1)                     (slice i's key/value context, i > 0)
        B(s, m, i) needs F(s, m, i)                       (its own activations)
                   and   B(s+1, m, i)  unless s = K − 1   (the gradient from the next stage)

    B(s, m, i) also consumes the context gradient of B(s, m, i+1); TeraPipe's timetable supplies
    that order on each stage (backward slices in reverse), so it is not repeated here.
    """
    s, m, i = stage, op.micro, op.slice
    if op.kind == "F":
        return ([(s - 1, op)] if s > 0 else []) + ([(s, Op("F", m, i - 1))] if i > 0 else [])
    if op.kind == "B":
        return [(s, Op("F", m, i))] + ([(s + 1, op)] if s < num_stages - 1 else [])
    raise ValueError(f"pipeline_deps knows ops F and B, got {op.kind!r}: pass deps= for new kinds")


@dataclass(frozen=True)
class SimResult:
    iteration_time: float                                # max over ops of end time
    busy: list[float]                                    # per stage: Σ op durations
    bubble_fraction: float                               # 1 − Σ busy / (K · iteration_time)
    times: dict[tuple[int, Op], tuple[float, float]]     # (stage, op) -> (start, end)

    def gantt(self, width: int = 80) -> str:
        """One text row per stage; each op drawn as its label over its duration."""
        scale = width / self.iteration_time if self.iteration_time > 0 else 0.0
        rows = [[" "] * width for _ in self.busy]
        for (s, op), (a, b) in self.times.items():
            lo = min(int(a * scale), width - 1)
            hi = max(min(int(round(b * scale)), width), lo + 1)
            rows[s][lo:hi] = list((str(op) + "." * width)[: hi - lo])
        return "\n".join(f"{s:>3} |{''.join(r)}|" for s, r in enumerate(rows))


def simulate(timetable: Sequence[Sequence[Op]], cost: OpCost, *, latency: float = 0.0,
             deps: Deps = pipeline_deps) -> SimResult:
    """Run the timetable; raise ValueError on a duplicate op, a never-scheduled dependency or a
    deadlock (some stage's next op waits on an op that can never finish), naming the ops."""
    K = len(timetable)
    prereq: dict[tuple[int, Op], list[tuple[int, Op]]] = {}
    for s, ops in enumerate(timetable):
        for op in ops:
            if (s, op) in prereq:
                raise ValueError(f"stage {s} runs {op} twice")
            prereq[(s, op)] = list(deps(s, op, K))
    for (s, op), pre in prereq.items():
        for d in pre:
            if d not in prereq:
                raise ValueError(f"stage {s} {op} needs {d[1]} on stage {d[0]}, which is never scheduled")

    end: dict[tuple[int, Op], float] = {}
    times: dict[tuple[int, Op], tuple[float, float]] = {}
    nxt, free, busy = [0] * K, [0.0] * K, [0.0] * K
    progress = True
    while progress:
        progress = False
        for s in range(K):
            while nxt[s] < len(timetable[s]):
                key = (s, timetable[s][nxt[s]])
                if any(d not in end for d in prereq[key]):
                    break
                start = max([free[s]] + [end[d] + (latency if d[0] != s else 0.0) for d in prereq[key]])
                dur = float(cost(*key))
                if dur < 0:
                    raise ValueError(f"negative cost {dur} for stage {s} {key[1]}")
                times[key] = (start, start + dur)
                end[key] = free[s] = start + dur
                busy[s] += dur
                nxt[s] += 1
                progress = True
    stuck = [(s, timetable[s][nxt[s]]) for s in range(K) if nxt[s] < len(timetable[s])]
    if stuck:
        why = "; ".join(f"stage {s} waits at {op} for "
                        + ", ".join(f"{d[1]}@stage{d[0]}" for d in prereq[(s, op)] if d not in end)
                        for s, op in stuck)
        raise ValueError(f"deadlock: {why}")
    T = max(end.values(), default=0.0)
    bubble = 1.0 - sum(busy) / (K * T) if T > 0 else 0.0
    return SimResult(T, busy, bubble, times)


# ------------------------------------------------------------------ timetables

def _F(m: int, i: int = 0) -> Op:
    return Op("F", m, i)


def _B(m: int, i: int = 0) -> Op:
    return Op("B", m, i)


def gpipe_timetable(K: int, M: int) -> Timetable:
    """GPipe: every stage runs all forwards, then all backwards, last micro-batch first:

        F0 F1 … F(M−1)  B(M−1) … B1 B0
    """
    forward = [_F(m) for m in range(M)]
    backward = [_B(m) for m in reversed(range(M))]
    return [forward + backward for _ in range(K)]


def one_f_one_b_timetable(K: int, M: int) -> Timetable:
    """1F1B (PipeDream-flush, DeepSpeed's TrainSchedule). Stage s runs

        warm-up:   F0 … F(w−1)                      w = min(K − s − 1, M) forwards
        steady:    F(w) B0  F(w+1) B1 …             M − w pairs, one forward then one backward
        cool-down: B(M−w) … B(M−1)                  the w backwards still owed

    e.g. K = 3, M = 4:  stage 0: F0 F1 F2 B0 F3 B1 B2 B3;  stage 2: F0 B0 F1 B1 F2 B2 F3 B3.
    """
    table = []
    for s in range(K):
        w = min(K - s - 1, M)
        warmup = [_F(m) for m in range(w)]
        steady = [op for m in range(M - w) for op in (_F(w + m), _B(m))]
        cooldown = [_B(m) for m in range(M - w, M)]
        table.append(warmup + steady + cooldown)
    return table


def terapipe_timetable(K: int, slices_count: int, micro: int = 1) -> Timetable:
    """TeraPipe: every stage forwards all token slices of every micro-batch in order, then
    backwards them in reverse (slice i's backward needs slice i+1's context gradient):

        F0.0 F0.1 … F0.(N−1)  F1.0 …  |  … B1.0  B0.(N−1) … B0.1 B0.0
    """
    forward = [_F(m, i) for m in range(micro) for i in range(slices_count)]
    backward = [_B(m, i) for m in reversed(range(micro)) for i in reversed(range(slices_count))]
    return [forward + backward for _ in range(K)]


def sliced_one_f_one_b_timetable(K: int, sequences: Sequence[Sequence[Op]]) -> Timetable:
    """Token-sliced 1F1B (TeraPipe's slices scheduled like Seq1F1B): ``sequences`` lists each
    sequence's slice forwards ``F(m, i)`` in token order, sequences in forward order.

    Forward order f: every slice of every sequence in order.  Backward order b: sequence by
    sequence, each one's slices in reverse (slice i's backward needs the key/value gradients of
    slices > i).  The last stage runs ``lag = max_j (position of b_j in f − j)`` warm-up forwards
    (N − 1 for N equal slices: a sequence's last slice is backwarded right after its forward),
    stage s ``w_s = lag + K − 1 − s`` (1F1B's pipeline depth on top), then alternates one forward
    and one backward, then drains.  At most ``w_s + 1`` units are in flight on stage s
    (N + K − 1 − s slices): bounded by the stages and one sequence's slices, not by slices ×
    micro-batches as in the GPipe order::

        K=2, two sequences of 2 slices   stage 0: F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0
                                         stage 1: F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0
    """
    fwd = [op for seq in sequences for op in seq]
    bwd = [_B(op.micro, op.slice) for seq in sequences for op in reversed(seq)]
    pos = {(op.micro, op.slice): i for i, op in enumerate(fwd)}
    lag = max((pos[(b.micro, b.slice)] - j for j, b in enumerate(bwd)), default=0)
    table = []
    for s in range(K):
        w = min(len(fwd), lag + K - 1 - s)
        ops = fwd[:w]
        for j, b in enumerate(bwd):
            if w + j < len(fwd):
                ops.append(fwd[w + j])
            ops.append(b)
        table.append(ops)
    return table


def zb_deferrals(K: int, max_pending_w: int | str = "paper") -> list[int]:
    """How many W passes each stage defers (keeps pending between its B and its W).

    ``"paper"``: stage s defers s (the paper's ZB-H1: K micro-batches in flight on every stage, counted
    as if a pending W held what an in-flight forward holds).  ``"auto"``: max(0, ⌊(s − 1)/2⌋), within
    1F1B's peak (K forwards' worth, its first stage) when a pending W holds up to two forwards' worth
    (it keeps the forward's activations *and* the gradients B recorded for it: 1.6× on GPT-2's last
    stage, measured by :class:`~ds_mp.engine.memory.HeldMemory`): right after a B, stage s holds
    K − s − 1 forwards and d_s + 1 pending W, (K − s − 1) + 2(d_s + 1) ≤ K
    (:func:`~ds_mp.schedules.timetable.modelled_peak`).  The first stage's B records nothing (it has no
    input gradient to compute), so its pending W costs one forward.
    An int n: min(s, n) (0: every W right after its B, 1F1B's order with the dX sent before W)."""
    if max_pending_w == "paper":
        return list(range(K))
    if max_pending_w == "auto":
        return [max(0, (s - 1) // 2) for s in range(K)]
    if isinstance(max_pending_w, int) and max_pending_w >= 0:
        return [min(s, max_pending_w) for s in range(K)]
    raise ValueError(f"max_pending_w: expected 'auto', 'paper' or an int >= 0, got {max_pending_w!r}")


def zb_h1_timetable(K: int, M: int, max_pending_w: int | str = "auto") -> Timetable:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split
    into B (input gradient, on the critical path) and W (weight gradient, off it).

    Stage s keeps 1F1B's order of F and B and runs W(m) right after B(m + d_s) (the remaining W
    at the end), d_s = :func:`zb_deferrals` (the paper: d_s = s): the W of the last d_s micro-batches
    is deferred, so the gradient chain B(K−1) → … → B(0) carries no W, and the deferred W fill the
    bubbles 1F1B leaves at the start of the lower stages and at the end of the upper ones::

        K=2, M=4   stage 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
        (paper)    stage 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3

    Activations live from F to W: with d_s = s stage s holds at most (K − s) + s = K micro-batches,
    the peak of 1F1B (its first stage), each pending one with its recorded gradients on top.  With
    costs F = B = W and d_s = s the step is M(F+B+W) + (K−1)(F+B−W), against 1F1B's (M + K − 1)(F+B+W).
    """
    table = []
    for s, ops in enumerate(one_f_one_b_timetable(K, M)):
        d = zb_deferrals(K, max_pending_w)[s]
        out, done_b, done_w = [], 0, 0
        for op in ops:
            out.append(op)
            if op.kind == "B":
                done_b += 1
                while done_w < done_b - d:
                    out.append(Op("W", done_w))
                    done_w += 1
        table.append(out + [Op("W", m) for m in range(done_w, M)])
    return table


def interleaved_deps(num_virtual: int) -> Deps:
    """Dependencies of interleaved 1F1B with ``num_virtual`` chunks per stage; an op's ``slice`` is
    its chunk c (virtual stage c·K + s): the activation of chunk c leaves the last stage for chunk
    c+1 on the first stage, its gradient comes back the other way.

        F(s, m, c)  needs F(s−1, m, c), or F(K−1, m, c−1) when s = 0 < c
        B(s, m, c)  needs F(s, m, c) and B(s+1, m, c), or B(0, m, c+1) when s = K−1, c < v−1
    """
    v = num_virtual

    def deps(stage: int, op: Op, K: int) -> list[tuple[int, Op]]:
        s, m, c = stage, op.micro, op.slice
        if op.kind == "F":
            return [(s - 1, op)] if s > 0 else ([(K - 1, _F(m, c - 1))] if c > 0 else [])
        if op.kind == "B":
            nxt = [(s + 1, op)] if s < K - 1 else ([(0, _B(m, c + 1))] if c < v - 1 else [])
            return [(s, _F(m, c))] + nxt
        raise ValueError(f"interleaved_deps knows ops F and B, got {op.kind!r}")
    return deps


def interleaved_timetable(K: int, M: int, v: int) -> Timetable:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): stage s holds chunks c = 0 … v−1
    (virtual stages c·K + s).  Forwards go in groups of K micro-batches, chunk by chunk
    (F(0,c) … F(K−1,c) for c = 0 … v−1, then the next group); backwards likewise with the chunks
    reversed.  Stage s runs ``2(K − s − 1) + (v − 1)K`` warm-up forwards, then one forward and one
    backward alternately, then drains.  The bubble is 1F1B's divided by v; needs M % K == 0.
    ``Op.slice`` is the chunk (:func:`interleaved_deps`)."""
    if M % K:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({M}) divisible by stages ({K})")
    total = M * v

    def nth(i: int, kind: str) -> Op:
        group, r = divmod(i, K * v)
        c, k = divmod(r, K)
        return Op(kind, group * K + k, c if kind == "F" else v - 1 - c)

    table = []
    for s in range(K):
        w = min(total, 2 * (K - s - 1) + (v - 1) * K)
        ops = [nth(i, "F") for i in range(w)]
        for j in range(total - w):
            ops += [nth(w + j, "F"), nth(j, "B")]
        table.append(ops + [nth(j, "B") for j in range(total - w, total)])
    return table


def one_f_one_b_split_timetable(K: int, M: int) -> Timetable:
    """1F1B with every backward written as B then W right after it (what ZB-H1 reorders)."""
    return [[x for op in ops for x in ((op, Op("W", op.micro)) if op.kind == "B" else (op,))]
            for ops in one_f_one_b_timetable(K, M)]


def terapipe_op_cost(slices: Sequence[int], cost: Cost, fwd_fraction: float = 1 / 3) -> OpCost:
    """Per-op cost from a per-stage fwd+bwd slice cost t(l_i, c_i): F takes fwd_fraction of it,
    B the rest (backward ≈ 2 × forward FLOPs, hence 1/3). Same on every stage and micro-batch."""
    t = slice_costs(slices, cost)
    return lambda s, op: t[op.slice] * (fwd_fraction if op.kind == "F" else 1.0 - fwd_fraction)


def simulate_plan(plan: Plan, num_stages: int, cost: BatchCost, micro: int = 1, fwd_fraction: float = 1 / 3,
                  latency: float = 0.0) -> SimResult:
    """Simulate a joint TeraPipe plan [(rows b, token slices)] for a flush of ``micro`` micro-batches.

    Its units (every batch-slice's token slices, in order) are the ``terapipe_timetable``'s slices;
    unit (b, l_i after c_i) costs cost(b, l_i, c_i), F taking ``fwd_fraction`` of it.  A plan of
    one token slice per batch-slice is GPipe with those batch-slices as micro-batches.
    """
    t = [c for b, sl in plan for c in slice_costs(sl, lambda i, j, b=b: cost(b, i, j))]
    table = terapipe_timetable(num_stages, len(t), micro)
    return simulate(table, lambda s, op: t[op.slice] * (fwd_fraction if op.kind == "F" else 1.0 - fwd_fraction),
                    latency=latency)


# ------------------------------------------------------------------ projection to GPT-3 shapes

@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    seq_len: int = 2048

    def slice_flops(self, i: int, j: int, layers: float) -> float:
        """Forward FLOPs of i tokens after j context tokens through `layers` layers:
        per token 24·h² (QKV, proj, 4h MLP: 2·12h² MACs) plus 4·h per attended key
        (QKᵀ and AV); a causal slice attends to i·j + i(i+1)/2 (query, key) pairs."""
        h = self.hidden
        return layers * (24 * h * h * i + 4 * h * (i * j + i * (i + 1) / 2))


# GPT-3 shapes of the TeraPipe paper's Table 1 (params ≈ 12·layers·h²), sequence length 2048.
GPT3_SHAPES: dict[str, ModelShape] = {
    "gpt3-1b": ModelShape(layers=24, hidden=2048),
    "gpt3-13b": ModelShape(layers=40, hidden=5120),
    "gpt3-44b": ModelShape(layers=96, hidden=6144),
    "gpt3-175b": ModelShape(layers=96, hidden=12288),
}


def project_gpt3(cost: Cost, measured: ModelShape, measured_stages: int,
                 target: str | ModelShape, num_stages: int, *, slices: Sequence[int] | None = None,
                 micro: int = 1, granularity: int = 16,
                 latency: float = 0.0) -> tuple[list[int], SimResult]:
    """Predict a TeraPipe iteration of `target` on num_stages stages from a measured stage cost.

    t_target(i, j) = t_measured(i, j) · FLOPs_target(i, j) / FLOPs_measured(i, j), FLOPs per stage
    (layers / stages each): everything, overheads included, is assumed to scale with FLOPs (a
    compute-bound device of the same speed). Slices default to plan_slices on the target cost.
    Returns (slices, simulated result of terapipe_timetable).
    """
    tgt = GPT3_SHAPES[target] if isinstance(target, str) else target
    lm, lt = measured.layers / measured_stages, tgt.layers / num_stages

    def projected(i: int, j: int) -> float:
        return cost(i, j) * tgt.slice_flops(i, j, lt) / measured.slice_flops(i, j, lm)

    if slices is None:
        slices = plan_slices(tgt.seq_len, num_stages, projected, granularity=granularity).slices
    table = terapipe_timetable(num_stages, len(slices), micro)
    return list(slices), simulate(table, terapipe_op_cost(slices, projected), latency=latency)
