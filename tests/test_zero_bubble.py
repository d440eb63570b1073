"""ZB-H1 (``"schedule": "zb-h1"``): the backward split into B (input gradient) and W (weight gradient).

* pure Python: the timetable is the paper's (1F1B's F/B order, stage s defers W by s
  micro-batches; peak K micro-batches of activations on every stage, 1F1B's peak; with
  F = B = W the simulated step is M(F+B+W) + (K−1)(F+B−W)), the compiler runs any timetable
  (1F1B written as a timetable passes test_schedules' unroller), and the compiled ZB-H1 streams
  play with rendezvous p2p: no deadlock, each micro-batch's F, B, W once per stage in that order,
  every received gradient consumed by its own micro-batch's B;
* multi-rank against HF's unmodified GPT-2 trained with torch SGD and ``clip_grad_norm_``:
  fp32 losses, pre-clip norms and every weight within 1e-5 at PP=2 (clipping, activation
  checkpointing, ZeRO-1, LoRA-free tied embeddings), PP=3, TP=2×PP=2 and PP=2×DP=2 with ZeRO-1;
  bf16 (TP=2×PP=2 with ZeRO-1, PP=2) within a stated tolerance of HF's fp32 run and of the
  same bf16 config under 1F1B; at TP=2×PP=2 the column-parallel fused backward computes dX and dW
  as often as under 1F1B (B only dX, W only dW: no work done twice);
* ``"bf16": {"immediate_grad_update": true}`` (W moves its gradients into the fp32 masters itself):
  zb-h1 on tied GPT-2 and untied Qwen2, interleaved and token-sliced 1F1B equal the deferred update
  bit for bit and HF within the bf16 tolerance;
* config refusals (ZeRO-2, fp16) in one line.
"""
from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from ds_mp.schedules.timetable import modelled_peak
from ds_mp.schedules.simulate import (Op, one_f_one_b_timetable, simulate, zb_deferrals, zb_h1_timetable,
                                      zero_bubble_deps)
from ds_mp.schedules.timetable import TimetableSchedule
from ds_mp.schedules.zero_bubble import BackwardInput, BackwardWeight, ZeroBubbleH1, stage_weights
from helpers import batches, ds_config, tiny_gpt2
from p2p_play import play_compiled
from test_schedules import unroll
from test_tensor_parallel import gather_weights, hf_train, max_diff

VOCAB, SEQ, TOL = 203, 16, 1e-5
BF16_VS_HF = 0.01  # bf16 losses against HF's fp32 (relative)
BF16_NORM_VS_HF = 0.03  # step-1 pre-clip norm against HF's fp32
BF16_VS_1F1B = 0.01  # bf16 losses and norms against the same bf16 config under 1F1B


# ------------------------------------------------------------------ pure Python

def test_timetable_is_the_papers() -> None:
    assert [" ".join(map(str, ops)) for ops in zb_h1_timetable(2, 4, "paper")] == [
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
    unit = lambda s, op: 1.0  # noqa: E731
    for K, M in [(2, 4), (2, 8), (3, 6), (4, 8), (8, 32)]:
        table = zb_h1_timetable(K, M, "paper")
        for s, ops in enumerate(table):
            live = peak = 0
            for op in ops:
                live += (op.kind == "F") - (op.kind == "W")
                peak = max(peak, live)
            assert peak == min(K, M), (K, M, s)  # 1F1B's peak (its first stage), on every stage
            assert [op.kind for op in ops if op.micro == 0] == ["F", "B", "W"]
        zb = simulate(table, unit, deps=zero_bubble_deps).iteration_time
        one = simulate(one_f_one_b_timetable(K, M), lambda s, op: 2.0 if op.kind == "B" else 1.0).iteration_time
        assert zb == 3 * M + (K - 1) and one == 3 * (M + K - 1), (K, M, zb, one)


class OneFOneBTable(TimetableSchedule):
    """1F1B written as a timetable and compiled: must behave like DeepSpeed's TrainSchedule."""

    def table(self) -> list[list[Op]]:
        return one_f_one_b_timetable(self.stages, self.micro_batches)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 5])
def test_compiled_timetable_passes_the_schedule_unroller(K: int, M: int) -> None:
    stages, _ = unroll(OneFOneBTable, M, K)
    assert all(sorted(s.forwards) == sorted(s.backwards) == list(range(M)) for s in stages)


@pytest.mark.parametrize("K,M", [(2, 4), (2, 8), (3, 6), (4, 8), (8, 32)])
def test_auto_deferral_keeps_1f1b_peak(K: int, M: int) -> None:
    """The default (``zb_max_pending_w`` "auto") holds at most 1F1B's largest stage's peak on every
    stage when a pending W costs two forwards' worth (one on the first stage, whose B records
    nothing); the paper's deferral holds more as soon as a pending W costs more than one forward
    (its recorded gradients: 1.6 on GPT-2's last stage, measured); both are faster than 1F1B and
    the paper's is the fastest (unit costs)."""
    one = max(modelled_peak(ops) for ops in one_f_one_b_timetable(K, M))
    auto, paper = zb_h1_timetable(K, M), zb_h1_timetable(K, M, "paper")
    assert all(modelled_peak(ops, 1.0 if s == 0 else 2.0) <= one for s, ops in enumerate(auto))
    assert max(modelled_peak(ops, 1.0 if s == 0 else 1.6) for s, ops in enumerate(paper)) > 1.1 * one
    assert [sum(1 for op in ops if op.kind == "W") for ops in auto] == [M] * K
    unit = lambda s, op: 1.0  # noqa: E731
    t = {name: simulate(tab, unit, deps=zero_bubble_deps).iteration_time for name, tab in (("auto", auto),
                                                                                           ("paper", paper))}
    t_one = simulate(one_f_one_b_timetable(K, M), lambda s, op: 2.0 if op.kind == "B" else 1.0).iteration_time
    assert t["paper"] <= t["auto"] < t_one, t


def test_deferral_knob() -> None:
    assert zb_deferrals(6, "auto") == [0, 0, 0, 1, 1, 2] and zb_deferrals(4, "paper") == [0, 1, 2, 3]
    assert zb_deferrals(4, 1) == [0, 1, 1, 1] and zb_deferrals(4, 0) == [0] * 4
    with pytest.raises(ValueError, match="max_pending_w"):
        zb_deferrals(2, "most")


def play(K: int, M: int, posted_sends: bool = False, max_pending_w: int | str = "paper") -> list[list[tuple[str, int]]]:
    """Every stage's ZB-H1 steps with rendezvous p2p (or compiled for and played with posted
    sends), tracking which micro-batch each buffer and the shared gradient slot hold; returns per
    stage the compute events (kind, micro)."""
    scheds = [ZeroBubbleH1(micro_batches=M, stages=K, stage_id=s, max_pending_w=max_pending_w) for s in range(K)]
    for x in scheds:
        x.posted_sends = posted_sends
    streams = [list(x.steps()) for x in scheds]
    loaded, acts, labels = [0] * K, [dict() for _ in range(K)], [dict() for _ in range(K)]
    live: list[dict] = [dict() for _ in range(K)]  # buffer -> micro forwarded, W not yet run
    after_b: list[dict] = [dict() for _ in range(K)]  # buffer -> micro whose B ran
    grad: list = [None] * K
    events: list[list[tuple[str, int]]] = [[] for _ in range(K)]

    def compute(s: int, c) -> None:
        b = getattr(c, "buffer_id", None)
        if isinstance(c, ds.LoadMicroBatch):
            assert b not in live[s], f"stage {s}: buffer {b} reloaded while micro {live[s][b]} is live"
            labels[s][b] = loaded[s]
            if s == 0:
                acts[s][b] = loaded[s]
            loaded[s] += 1
        elif isinstance(c, ds.ForwardPass):
            m = acts[s][b]
            if s == K - 1:
                assert labels[s][b] == m, f"stage {s}: activations of {m}, labels of {labels[s][b]}"
            live[s][b] = m
            events[s].append(("F", m))
        elif isinstance(c, BackwardInput):
            m = live[s][b]
            if s < K - 1:
                assert grad[s] == m, f"stage {s}: B of micro {m} with the gradient of {grad[s]}"
                grad[s] = None
            after_b[s][b] = m
            events[s].append(("B", m))
        elif isinstance(c, BackwardWeight):
            m = live[s].pop(b)
            assert after_b[s][b] == m
            events[s].append(("W", m))

    def sent(s: int, send) -> int:  # the micro-batch whose activation / input gradient leaves
        return live[s][send.buffer_id] if isinstance(send, ds.SendActivation) else after_b[s][send.buffer_id]

    def received(peer: int, recv, send, micro: int) -> None:
        if isinstance(send, ds.SendActivation):
            assert recv.buffer_id not in live[peer], f"stage {peer}: buffer overwritten while live"
            acts[peer][recv.buffer_id] = micro
        else:
            assert grad[peer] is None, f"stage {peer}: gradient slot overwritten before its B"
            grad[peer] = micro

    play_compiled(streams, compute, sent, received, posted_sends, acks=[x.acknowledged() for x in scheds])
    for s, x in enumerate(streams):
        assert [type(c) for c in x[-1][-3:]] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]
        assert scheds[s].num_pipe_buffers() <= min(K, M) + 1
    return events


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("pending", ["paper", "auto", 1])
def test_compiled_zb_h1_plays(K: int, M: int, pending: int | str) -> None:
    table = zb_h1_timetable(K, M, pending)
    for posted_sends in (False, True):
        events = play(K, M, posted_sends, pending)
        for s in range(K):
            assert events[s] == [(op.kind, op.micro) for op in table[s]], f"stage {s}"


# ------------------------------------------------------------------ multi-rank against HF

def _steps(n: int, per_step: int, seed: int) -> list[list]:
    out = []
    for i in range(n):
        mbs = batches(per_step, 2, SEQ, VOCAB, seed=seed + i)
        mbs[0][1][0, :2] = -100
        out.append(mbs)
    return out


def _case(name: str, *, tp: int = 1, pp: int = 2, dp: int = 1, gas: int = 4, clip: float = 0.5, lr: float = 0.1,
          schedule: str = "zb-h1", bf16: bool = False, zero: int = 0, **ds_mp) -> dict:
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=gas, lr=lr, clip=clip, schedule=schedule, seq=SEQ, bf16=bf16, zero=zero,
                    **ds_mp)
    return {"name": name, "cfg": cfg, "tp": tp, "dp": dp, "gas": gas, "lr": lr, "clip": clip, "bf16": bf16,
            "steps": _steps(3, dp * gas, seed=len(name.removesuffix("_1f1b")))}  # a twin sees the same data


def cases(world: int) -> list[dict]:
    if world == 2:
        return [_case("pp2"), _case("pp2_paper", pipeline={"zb_max_pending_w": "paper"}), _case("pp2_ckpt", pipeline={"activation_checkpoint_interval": 1}),
                _case("pp2_zero1", zero=1), _case("pp2_m1", gas=1),
                _case("pp2_bf16", bf16=True), _case("pp2_bf16_1f1b", bf16=True, schedule="1f1b")]
    if world == 3:
        return [_case("pp3", pp=3, gas=5), _case("pp3_partition", pp=3, gas=3,
                                                          pipeline={"partition": [2, 1, 1], "zb_max_pending_w": "paper"})]
    return [_case("tp2pp2", tp=2), _case("pp2dp2_zero1", dp=2, gas=3, zero=1),
            _case("tp2pp2_bf16_zero1", tp=2, bf16=True, zero=1),
            _case("tp2pp2_bf16_zero1_1f1b", tp=2, bf16=True, zero=1, schedule="1f1b")]


def _rank(rank: int, world: int) -> dict:
    import ds_mp
    from ds_mp.tensor_parallel import mappings

    out, fused = {}, {}
    needed = mappings.needed_grads

    def counted(ctx):  # the column-parallel backward's work: (dX computed, dW computed) per call
        needs = needed(ctx)
        fused[needs[:2]] = fused.get(needs[:2], 0) + 1
        return needs

    mappings.needed_grads = counted
    try:
        for case in cases(world):
            d, gas = (rank // case["tp"]) % case["dp"], case["gas"]
            engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=case["cfg"])
            losses, norms = [], []
            fused.clear()
            for step in case["steps"]:
                losses.append(float(engine.train_batch(iter(step[d * gas:(d + 1) * gas]))))
                norms.append(float(engine.get_global_grad_norm()))
            out[case["name"]] = (losses, norms, gather_weights(engine)[0], len(engine.schedule_support.pending)
                                 if engine.schedule_name == "zb-h1" else 0, dict(fused))
            if case["name"] == "pp2":
                out["stage_weights"] = stage_weights(engine.module)
    finally:
        mappings.needed_grads = needed
    return out


def _check(world: int, results: list[dict]) -> None:
    model = tiny_gpt2()
    if world == 2:  # 2 + 2 blocks, the LM head (vocab 203 padded to 256, × 48, against a block's 12 · 48²) last
        assert [r["stage_weights"] for r in results] == [pytest.approx([2, 2 + 256 * 48 / (12 * 48 * 48)])] * 2
    for case in cases(world):
        hf_losses, hf_norms, hf_w = hf_train(model, case["steps"], case["lr"], case["clip"])
        assert min(hf_norms) > case["clip"], "clipping must be active to be tested"
        seen: set = set()
        for rank, res in enumerate(results):
            losses, norms, w, pending, fused = res[case["name"]]
            where = f"{case['name']} rank {rank}: {losses} {norms} vs HF {hf_losses} {hf_norms}"
            assert pending == 0, where
            seen |= set(w)
            if not case["bf16"]:
                assert max(abs(a - b) for a, b in zip(losses, hf_losses)) <= TOL, where
                assert all(abs(a - b) <= TOL * b for a, b in zip(norms, hf_norms)), where
                assert max_diff(w, hf_w) <= TOL, f"{where}: weights {max_diff(w, hf_w)}"
            elif case["cfg"]["ds_mp"]["pipeline"]["schedule"] == "zb-h1":
                one = res[case["name"] + "_1f1b"]
                assert all(abs(a - b) <= BF16_VS_HF * b for a, b in zip(losses, hf_losses)), where
                assert abs(norms[0] - hf_norms[0]) <= BF16_NORM_VS_HF * hf_norms[0], where
                assert all(abs(a - b) <= BF16_VS_1F1B * abs(b) for a, b in zip(losses + norms, one[0] + one[1])), \
                    f"{where}; 1f1b {one[:2]}"
                if case["tp"] > 1:  # B computes (and all-reduces) only dX, W only dW: 1F1B's work, once
                    dx, dw = (sum(n for (x, w), n in fused.items() if (x, w)[i]) for i in (0, 1))
                    want = one[4].get((True, True), 0)
                    assert want > 0 and dx == dw == want, f"{where}: fused backward calls {fused}, 1f1b {one[4]}"
        assert seen == set(hf_w), f"{case['name']}: {set(hf_w) ^ seen} not covered"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zb_h1_equals_hf(world: int) -> None:
    _check(world, run_ranks(_rank, world, world, timeout=600))


# ------------------------------------------------------------------ bf16.immediate_grad_update

IMMEDIATE = {"zb-h1": {}, "interleaved": {"pipeline": {"virtual_stages": 2}},
             "terapipe": {"terapipe": {"slices": [6, 10], "order": "1f1b"}}}  # token-sliced 1F1B
# tied GPT-2 (its tied-gradient all-reduce) under each; untied Qwen2 under the schedule with a W pass
IMMEDIATE_CASES = [("gpt2", "zb-h1"), ("gpt2", "interleaved"), ("gpt2", "terapipe"), ("qwen2", "zb-h1")]


def _immediate_model(name: str):
    from test_llama import tiny_llama

    return tiny_gpt2() if name == "gpt2" else tiny_llama("qwen2", 2, False, n_layer=4, inner=128, hidden=72,
                                                          vocab=VOCAB)


def _immediate_rank(rank: int) -> dict:
    import ds_mp

    out = {}
    for model, schedule in IMMEDIATE_CASES:
        for immediate in (False, True):
            cfg = ds_config(pp=2, micro=2, gas=4, lr=0.1, clip=0.5, schedule=schedule, seq=SEQ, bf16=True,
                            **IMMEDIATE[schedule])
            cfg["bf16"]["immediate_grad_update"] = immediate
            engine, *_ = ds_mp.initialize(model=_immediate_model(model), config=cfg)
            losses, norms = [], []
            for step in _steps(2, 4, seed=60):
                losses.append(float(engine.train_batch(iter(step))))
                norms.append(float(engine.get_global_grad_norm()))
            out[(model, schedule, immediate)] = (losses, norms, gather_weights(engine)[0])
    return out


def test_bf16_immediate_grad_update_trains_like_the_deferred_update() -> None:
    """``"bf16": {"immediate_grad_update": true}``: DeepSpeed's hooks move each gradient into its fp32
    master as autograd accumulates it, and ``update_hp_grads()`` is a no-op.  ZB-H1's W pass sets
    ``.grad`` by hand: it must move them itself (else stages >= 1 lose every weight gradient: tied
    GPT-2 hangs in the tied-gradient all-reduce, untied Qwen2 fails in the optimizer step).  With the
    setting, zb-h1, interleaved and token-sliced 1F1B give the very losses, norms and weights of the
    deferred update, within the bf16 tolerance of HF's fp32 run."""
    results = run_ranks(_immediate_rank, 2, timeout=500)
    for model, schedule in IMMEDIATE_CASES:
        hf_losses, hf_norms, _ = hf_train(_immediate_model(model), _steps(2, 4, seed=60), 0.1, 0.5)
        for rank, res in enumerate(results):
            (losses, norms, w), (d_losses, d_norms, d_w) = res[(model, schedule, True)], res[(model, schedule, False)]
            where = f"{model} {schedule} rank {rank}: {losses} {norms} vs HF {hf_losses} {hf_norms}"
            assert (losses, norms) == (d_losses, d_norms) and max_diff(w, d_w) == 0, f"{where}; deferred {d_losses}"
            assert all(abs(a - b) <= BF16_VS_HF * b for a, b in zip(losses, hf_losses)), where
            assert abs(norms[0] - hf_norms[0]) <= BF16_NORM_VS_HF * hf_norms[0], where


@pytest.mark.parametrize("extra, match", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage: the zb-h1 schedule"),
    ({"fp16": {"enabled": True}}, "fp16.enabled: the zb-h1 schedule")])
def test_refused_combinations(extra: dict, match: str, monkeypatch) -> None:
    from deepspeed.accelerator import get_accelerator

    from ds_mp.config import ConfigError, load_config

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    with pytest.raises(ConfigError, match=match) as e:
        load_config({**ds_config(pp=2, schedule="zb-h1"), **extra}, 2)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ LoRA against PEFT

def _lora_rank(rank: int) -> dict:
    import ds_mp
    from test_lora import LR, lora_block, peft_model, steps_data

    cfg = ds_config(pp=2, gas=2, lr=LR, seq=SEQ, schedule="zb-h1", lora=lora_block())
    engine, *_ = ds_mp.initialize(model=peft_model(), config=cfg)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps_data()]
    frozen_grads = [n for n, p in engine.module.named_parameters() if not p.requires_grad and p.grad is not None]
    return {"losses": losses, "frozen_grads": frozen_grads}


def test_zb_h1_lora_equals_peft() -> None:
    """LoRA: W computes only the trainable factors' gradients (the frozen base gets none); the
    losses equal PEFT's LoRA on the single-process HF model."""
    from helpers import hf_reference
    from test_lora import LR, peft_model, steps_data

    want, _ = hf_reference(peft_model(), steps_data(), lr=LR)
    for r in run_ranks(_lora_rank, 2, timeout=300):
        assert r["frozen_grads"] == []
        assert r["losses"] == pytest.approx(want, abs=2e-5), (r["losses"], want)


def test_timeline_labels_b_and_w_apart() -> None:
    from ds_mp.training.trace import chrome_trace, event_label

    assert event_label("BackwardInput", 2) == "B2" and event_label("BackwardWeight", 2) == "W2"
    events = chrome_trace({0: [("BackwardInput", 1, 0.0, 1.0), ("BackwardWeight", 1, 1.0, 2.0)]})["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["B1", "W1"]


# ------------------------------------------------------------------ resume across schedules and layouts

def resume_across_schedules(root: str, schedule: str, n_layer: int = 4, pipeline: dict | None = None,
                            bf16: bool = False, zero: int = 0) -> dict:
    """Adam + clipping: ``schedule`` at PP=2 for 2 steps, saved, resumed as 1F1B at TP=2 PP=1 for 2
    more ("<schedule>->1f1b"); 1F1B at PP=2 resumed as ``schedule`` ("1f1b-><schedule>"); and
    ``schedule``'s uninterrupted 4 steps ("uninterrupted"): per-step losses.  ``pipeline``: the
    schedule's extra pipeline keys (e.g. virtual stages); ``bf16``/``zero``: every run's precision
    and ZeRO stage."""
    import ds_mp

    def engine(name: str, tp: int, pp: int):
        cfg = ds_config(tp=tp, pp=pp, gas=2, lr=0.01, clip=1.0, optimizer="Adam", schedule=name, seq=SEQ,
                        bf16=bf16, zero=zero, pipeline=(pipeline or {}) if name == schedule else {})
        # eps comparable to the gradients: the layouts round differently, and with Adam's 1e-8 a
        # near-zero gradient's rounding becomes a ±lr step (test_ouroboros.ADAM_ATOL), which the
        # losses compared below would then carry at second order
        cfg["optimizer"]["params"]["eps"] = 1e-3
        return ds_mp.initialize(model=tiny_gpt2(n_layer=n_layer), config=cfg)[0]

    data = _steps(4, 2, seed=40)
    out = {}
    for first, second in (((schedule, 1, 2), ("1f1b", 2, 1)), (("1f1b", 1, 2), (schedule, 1, 2))):
        a = engine(*first)
        losses = [float(a.train_batch(iter(s))) for s in data[:2]]
        ds_mp.save_checkpoint(a, f"{root}/{first[0]}", "step2")
        b = engine(*second)
        ds_mp.load_checkpoint(b, f"{root}/{first[0]}")
        losses += [float(b.train_batch(iter(s))) for s in data[2:]]
        out[f"{first[0]}->{second[0]}"] = losses
    whole = engine(schedule, 1, 2)
    out["uninterrupted"] = [float(whole.train_batch(iter(s))) for s in data]
    return out


def _resume_rank(rank: int, root: str) -> dict:
    return resume_across_schedules(root, "zb-h1")


def test_zb_h1_resumes_across_schedules_and_layouts(tmp_path) -> None:
    """ZB-H1 keeps no work across steps: a zb-h1 run at PP=2 saved after 2 Adam steps resumes as
    1F1B at TP=2, and a 1F1B run resumes as zb-h1, each continuing the uninterrupted run's losses."""
    r = run_ranks(_resume_rank, 2, str(tmp_path), timeout=400)[0]
    want = r["uninterrupted"]
    for name in ("zb-h1->1f1b", "1f1b->zb-h1"):
        assert r[name] == pytest.approx(want, rel=1e-5), (name, r[name], want)


# ------------------------------------------------------------------ held memory against 1F1B

def _held_rank(rank: int, schedule: str, pipeline: dict) -> tuple[int, int]:
    import ds_mp
    from ds_mp.engine.held import held_during

    data = _steps(1, 4, seed=7)[0]
    cfg = ds_config(pp=2, micro=2, gas=4, seq=SEQ, schedule=schedule, pipeline=pipeline)
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
    engine.train_batch(iter(data))  # optimizer state and pipe buffers exist from here on
    return held_during(engine, lambda: engine.train_batch(iter(data)))


def test_zb_h1_holds_no_more_than_1f1b() -> None:
    """Every storage held between instructions (the census), largest rank: the default deferral
    stays within 1.10× of 1F1B's; the paper's (every pending W keeps its activations and its
    recorded gradients) holds more.  One engine per process group: the census counts everything
    a process holds, another engine's weights included."""
    runs = {"1f1b": ("1f1b", {}), "auto": ("zb-h1", {}), "paper": ("zb-h1", {"zb_max_pending_w": "paper"})}
    held = {k: run_ranks(_held_rank, 2, *v, timeout=300) for k, v in runs.items()}
    peak = {k: max(p for p, _ in ranks) for k, ranks in held.items()}
    assert peak["auto"] <= 1.10 * peak["1f1b"], held
    assert peak["paper"] > 1.10 * peak["1f1b"], held
