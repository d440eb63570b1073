"""Interleaved 1F1B (``"pipeline": {"schedule": "interleaved", "virtual_stages": v}``).

* pure Python: the layer layout (rank r holds chunks r, r + K, …), the compiled streams played
  with rendezvous p2p round the ring (no deadlock, every chunk of every micro-batch forwarded and
  backwarded once per stage, each received activation/gradient landing in the buffer of its own
  micro-batch and chunk); the simulated timetable (Megatron's order; every chunk of every
  micro-batch once per stage; with unit costs the step is M(F+B) + (K−1)(F+B)/v: 1F1B's bubble / v);
* multi-rank against HF's unmodified GPT-2 trained with torch SGD and ``clip_grad_norm_`` (tied
  embeddings, clipping active): fp32 losses, pre-clip norms and every weight within 1e-5 at PP=2
  with v = 2 and 3 over 5 and 6 blocks (one split leaving chunk 0 the embedding alone), ZeRO-1,
  activation checkpointing and evaluation; bf16 within a stated tolerance of HF's fp32 run;
  PP=2 × DP=2 with each replica on its own batches; TP=2 × PP=2 with and without sequence
  parallelism; LoRA against PEFT;
* layout-free checkpoints: interleaved v=2 -> 1F1B and PP=1, 1F1B -> interleaved, each equal to
  the uninterrupted run; config refusals in one line.
"""
from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from p2p_play import play_compiled
from ds_mp.models.partition import interleaved_layout
from ds_mp.schedules.interleaved import ChunkBackward, ChunkForward, Interleaved1F1B, chunk_weights
from ds_mp.schedules.simulate import Op, interleaved_deps, interleaved_timetable, one_f_one_b_timetable, simulate
from ds_mp.training.trace import event_label
from helpers import ds_config, step_loss, tiny_gpt2
from test_tensor_parallel import gather_weights, hf_train, max_diff
from test_zero_bubble import _steps, resume_across_schedules  # _steps: 2-row micro-batches of 16 tokens

SENDS = (ds.SendActivation, ds.SendGrad)

SEQ, TOL = 16, 1e-5  # SEQ: test_zero_bubble._steps' sequence length
BF16_VS_HF = 1e-3  # bf16 losses against HF's fp32 (relative; measured 2.6e-5)
BF16_NORM_VS_HF = 1e-2  # bf16 pre-clip norms against HF's fp32 (relative; measured 9.0e-4)
BF16_RESUME = 5e-4  # bf16 + ZeRO-1 resumed vs uninterrupted losses (test_lifecycle's HALF_RTOL; measured 2.8e-5)


# ------------------------------------------------------------------ pure Python

def test_layout_puts_chunk_c_on_rank_c_mod_k() -> None:
    names = ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "h.4", "ln_f", "lm_head"]
    # 4 chunks: [wte wpe] [h.0 h.1] [h.2 h.3] [h.4 ln_f lm_head]
    out, parts = interleaved_layout(names, [0, 2, 4, 6, 9], 2)
    assert out[:parts[1]] == ["wte", "wpe", "h.2", "h.3"]
    assert out[parts[1]:] == ["h.0", "h.1", "h.4", "ln_f", "lm_head"]


def play(K: int, M: int, v: int, forward_only: bool = False, weights: list[float] | None = None,
         posted_sends: bool = False) -> list[list]:
    """Every rank's steps round the ring (``weights``: modelled chunk costs), with rendezvous p2p,
    or, ``posted_sends``, compiled for and played with posted sends; returns the streams."""
    scheds = [Interleaved1F1B(M, K, s, v, forward_only=forward_only, chunk_weights=weights) for s in range(K)]
    for x in scheds:
        x.posted_sends = posted_sends
    held: list[dict] = [{} for _ in range(K)]  # buffer -> (micro, chunk) it holds
    grad: list = [None] * K  # the shared received-gradient slot: (micro, chunk) of the sender
    done: set = set()

    def compute(s: int, c) -> None:
        if isinstance(c, ChunkForward):
            if s == 0 and c.chunk == 0:
                held[s][c.buffer_id] = (c.micro, 0)
            assert held[s][c.buffer_id] == (c.micro, c.chunk), (s, c, held[s])
            done.add(("F", s, c.micro, c.chunk))
        elif isinstance(c, ChunkBackward):
            m, ch = held[s][c.buffer_id]
            assert ch == c.chunk and ("F", s, m, ch) in done
            if not (s == K - 1 and ch == v - 1):  # the last virtual stage starts from its loss
                want = (m, ch + 1) if s == K - 1 else (m, ch)
                assert grad[s] == want, f"rank {s}: B of {(m, ch)} with the gradient of {grad[s]}"
                grad[s] = None
            done.add(("B", s, m, ch))

    def sent(s: int, send) -> tuple[int, int]:
        unit = held[s][send.buffer_id]
        assert ("F" if isinstance(send, ds.SendActivation) else "B", s, *unit) in done, f"rank {s}: {send} before its value"
        if isinstance(send, ds.SendGrad):
            done.add(("G", s, *unit))  # its input gradient sent: the unit is through
        return unit

    def received(peer: int, recv, send, unit: tuple[int, int]) -> None:
        if isinstance(send, ds.SendActivation):
            m, ch = unit
            old = held[peer].get(recv.buffer_id)  # a buffer is reused only once its unit is through
            through = old is None or (("F" if forward_only else "B"), peer, *old) in done and (
                forward_only or (peer, old[1]) == (0, 0) or ("G", peer, *old) in done)
            assert through, f"rank {peer}: buffer {recv.buffer_id} of {old} overwritten while live"
            held[peer][recv.buffer_id] = (m, ch + 1 if peer == 0 else ch)
        else:
            assert grad[peer] is None, f"rank {peer}: gradient slot overwritten before its B"
            grad[peer] = unit

    streams = [list(x.steps()) for x in scheds]
    play_compiled(streams, compute, sent, received, posted_sends, ring=True,
                  acks=[x.acknowledged() for x in scheds])
    for kind in "FB"[:1 if forward_only else 2]:
        assert {(s, m, c) for k, s, m, c in done if k == kind} == \
            {(s, m, c) for s in range(K) for m in range(M) for c in range(v)}, kind
    return streams


@pytest.mark.parametrize("K, M, v", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 8, 3), (2, 4, 1)])
def test_compiled_streams_play_round_the_ring(K: int, M: int, v: int) -> None:
    heavy_last = [1.0] * (K * v - 1) + [4.0]  # the LM head's chunk: another compiled transfer order
    for posted_sends in (False, True):
        play(K, M, v, posted_sends=posted_sends)
        play(K, M, v, forward_only=True, posted_sends=posted_sends)
        play(K, M, v, weights=heavy_last, posted_sends=posted_sends)


@pytest.mark.parametrize("K, M, v", [(2, 4, 2), (4, 8, 3)])
def test_posted_sends_leave_right_after_their_value(K: int, M: int, v: int) -> None:
    """Compiled for posted sends, a send follows the compute of its value at once (the blocking
    compile holds it until its consumer's modelled start); receives keep their places."""
    for s, (late, early) in enumerate(zip(play(K, M, v), play(K, M, v, posted_sends=True))):
        late, early = [c for step in late for c in step], [c for step in early for c in step]
        same = lambda cmds: [(type(c).__name__, c.kwargs.get("micro"), c.kwargs.get("chunk"))  # noqa: E731
                             for c in cmds if not isinstance(c, SENDS)]  # buffers may be reused sooner
        assert same(late) == same(early)
        for i, c in enumerate(early):
            if isinstance(c, SENDS):  # right behind its chunk pass (or an earlier send)
                assert isinstance(early[i - 1], (ChunkForward, ChunkBackward) + SENDS), (s, i, early[i - 1])
        moved = sum(type(a) is not type(b) for a, b in zip(late, early))
        assert moved > 0, f"rank {s}: no send moved"


@pytest.mark.parametrize("K, M, v", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 4), (8, 32, 2)])
def test_interleaved_bubble_is_1f1bs_over_v(K: int, M: int, v: int) -> None:
    table = interleaved_timetable(K, M, v)
    for ops in table:
        assert sorted(ops) == sorted(Op(k, m, c) for k in "FB" for m in range(M) for c in range(v))
    fb = lambda s, op: 2.0 if op.kind == "B" else 1.0  # noqa: E731
    step = simulate(table, lambda s, op: fb(s, op) / v, deps=interleaved_deps(v)).iteration_time
    assert step == pytest.approx(3 * M + 3 * (K - 1) / v)
    assert simulate(one_f_one_b_timetable(K, M), fb).iteration_time == 3 * (M + K - 1)


def test_interleaved_dependencies_cross_the_ring() -> None:
    deps = interleaved_deps(2)
    assert deps(0, Op("F", 3, 1), 4) == [(3, Op("F", 3, 0))]  # chunk 1 starts where chunk 0 ended
    assert deps(3, Op("B", 3, 0), 4) == [(3, Op("F", 3, 0)), (0, Op("B", 3, 1))]
    assert deps(0, Op("F", 0, 0), 4) == [] and deps(3, Op("B", 0, 1), 4) == [(3, Op("F", 0, 1))]
    with pytest.raises(ValueError, match="divisible"):
        interleaved_timetable(4, 6, 2)


def test_timeline_labels_micro_batch_and_chunk(tmp_path) -> None:
    from ds_mp.tools.viz import timeline_png

    assert event_label("ChunkForward@3.1", 0) == "F3.1" and event_label("ChunkBackward@0.2", 4) == "B0.2"
    trace = {0: [("ChunkForward@0.0", 0, 0.0, 1.0), ("ChunkForward@0.1", 1, 1.0, 2.0)],
             1: [("ChunkBackward@0.1", 0, 2.0, 4.0)]}
    assert timeline_png(trace, str(tmp_path / "t.png"))["makespan_s"] == 4.0


# ------------------------------------------------------------------ multi-rank against HF

def _case(name: str, *, layers: int = 5, v: int = 2, tp: int = 1, dp: int = 1, gas: int = 4, clip: float = 0.5,
          lr: float = 0.1,
          schedule: str = "interleaved", bf16: bool = False, zero: int = 0, partition: object = "uniform",
          ckpt: int = 0, sp: bool = False) -> dict:
    pipeline = {"virtual_stages": v, "partition": partition, "activation_checkpoint_interval": ckpt}
    cfg = ds_config(tp=tp, pp=2, micro=2, gas=gas, lr=lr, clip=clip, schedule=schedule, seq=SEQ, bf16=bf16, zero=zero,
                    pipeline=pipeline, tensor_parallel={"sequence_parallel": sp})
    return {"name": name, "cfg": cfg, "layers": layers, "tp": tp, "dp": dp, "gas": gas, "lr": lr, "clip": clip,
            "bf16": bf16, "steps": _steps(2, dp * gas, seed=len(name))}


def cases(world: int) -> list[dict]:
    if world == 2:
        return [_case("v2", partition="cost"), _case("v3_l6", layers=6, v=3, gas=2, partition=[1, 1, 1, 1, 1, 1]),
                _case("v2_embed_chunk_ckpt", partition=[0, 2, 2, 1], zero=1, ckpt=1), _case("v2_bf16", bf16=True)]
    return [_case("v2_dp2", dp=2, gas=2), _case("tp2_v2", tp=2, gas=2), _case("tp2_sp_v2", tp=2, gas=2, sp=True)]


def _rank(rank: int, world: int, root: str) -> dict:
    import ds_mp

    out = {**resume_across_schedules(root, "interleaved", 5, {"virtual_stages": 2}), "lora": _lora(),
           "qwen2": _qwen2(),
           "bf16_zero1": resume_across_schedules(f"{root}/bf16", "interleaved", 5, {"virtual_stages": 2},
                                                 bf16=True, zero=1)} if world == 2 else {}
    for case in cases(world):
        d, gas = (rank // case["tp"]) % case["dp"], case["gas"]
        case["cfg"]["ds_mp"]["training"] = {"output_dir": root}  # "partition": "cost" caches its profile there
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(n_layer=case["layers"]), config=case["cfg"])
        losses, norms = [], []
        engine.trace_enabled = case["name"] == "v3_l6"  # timelines tell the chunks apart
        for step in case["steps"]:
            losses.append(float(engine.train_batch(iter(step[d * gas:(d + 1) * gas]))))
            norms.append(float(engine.get_global_grad_norm()))
        evaluated = float(engine.eval_batch(iter(case["steps"][0][d * gas:(d + 1) * gas]))) \
            if case["name"] == "v2" else None
        if case["cfg"]["ds_mp"]["pipeline"]["activation_checkpoint_interval"]:  # a chunk's blocks are checkpointed
            assert any(any(flags) for flags in engine.schedule_support.checkpointable)
        assert engine.module.ds_mp_ctx.sp == case["cfg"]["ds_mp"]["tensor_parallel"]["sequence_parallel"]
        chunks = len(engine.schedule_support.ranges) if engine.schedule_name == "interleaved" else 1
        assert chunks == case["cfg"]["ds_mp"]["pipeline"].get("virtual_stages", 1)
        out[case["name"]] = (losses, norms, gather_weights(engine)[0], evaluated)
        if engine.trace_enabled:  # v3_l6: 6 chunks of one block each, the LM head adds to the last
            weights = chunk_weights(engine.module)
            assert weights[:5] == [1.0] * 5 and weights[5] > 1.0, weights
            out["labels"] = sorted(event_label(n, b) for n, b, _, _ in engine.trace if "Chunk" in n)
    return out


def _check(world: int, results: list[dict]) -> None:
    for case in cases(world):
        model = tiny_gpt2(n_layer=case["layers"])
        hf_losses, hf_norms, hf_w = hf_train(model, case["steps"], case["lr"], case["clip"])
        assert min(hf_norms) > case["clip"], "clipping must be active to be tested"
        seen: set = set()
        for rank, res in enumerate(results):
            losses, norms, w, evaluated = res[case["name"]]
            where = f"{case['name']} rank {rank}: {losses} {norms} vs HF {hf_losses} {hf_norms}"
            seen |= set(w)
            if not case["bf16"]:
                assert max(abs(a - b) for a, b in zip(losses, hf_losses)) <= TOL, where
                assert all(abs(a - b) <= TOL * b for a, b in zip(norms, hf_norms)), where
                assert max_diff(w, hf_w) <= TOL, f"{where}: weights {max_diff(w, hf_w)}"
            else:
                assert all(abs(a - b) <= BF16_VS_HF * b for a, b in zip(losses, hf_losses)), where
                assert all(abs(a - b) <= BF16_NORM_VS_HF * b for a, b in zip(norms, hf_norms)), where
            if evaluated is not None:  # the trained HF model on the first step's micro-batches
                hf = model.__class__(model.config)
                hf.load_state_dict({**hf_w, "lm_head.weight": hf_w["transformer.wte.weight"]})
                want = step_loss(hf, case["steps"][0])
                assert abs(evaluated - want) <= TOL, (evaluated, want)
        assert seen == set(hf_w), f"{case['name']}: {set(hf_w) ^ seen} not covered"


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_equals_hf(world: int, tmp_path) -> None:
    """World 2 also runs the resumes across schedules and layouts (Adam, clipping, 5 blocks:
    interleaved v=2 -> 1F1B at TP=2 PP=1 and 1F1B PP=2 -> interleaved, against the uninterrupted
    interleaved run; in fp32 and in bf16 with ZeRO-1; one spawn of ranks for all)."""
    results = run_ranks(_rank, world, world, str(tmp_path), timeout=600)
    _check(world, results)
    if world == 2:
        steps, v = 2, 3  # v3_l6: every rank forwards and backwards each (micro-batch, chunk) once per step
        for res in results:
            assert res["labels"] == sorted([f"{k}{m}.{c}" for k in "FB" for m in range(2) for c in range(v)] * steps)
        from helpers import hf_reference
        from test_lora import LR, peft_model, steps_data

        from test_llama import CLIP, LR as QWEN_LR, _assert_trains_as_hf, steps_for, tiny_llama

        peft, _ = hf_reference(peft_model(), steps_data(), lr=LR)
        for res in results:
            assert res["lora"] == pytest.approx(peft, abs=2e-5), (res["lora"], peft)
        want_losses, _, want = hf_train(tiny_llama("qwen2", 2, True, n_layer=4), steps_for(), lr=QWEN_LR, clip=CLIP)
        _assert_trains_as_hf([res["qwen2"] for res in results], want_losses, want)
        r = results[0]
        for res, rel in ((r, 1e-5), (r["bf16_zero1"], BF16_RESUME)):
            want = res["uninterrupted"]
            for name in ("interleaved->1f1b", "1f1b->interleaved"):
                assert res[name] == pytest.approx(want, rel=rel), (name, res[name], want)


def _lora() -> list[float]:
    """LoRA at PP=2, v=2 (the frozen tied embedding gets no gradient): its losses, for PEFT's."""
    import ds_mp
    from test_lora import LR, SEQ as LORA_SEQ, lora_block, peft_model, steps_data

    cfg = ds_config(pp=2, gas=2, lr=LR, seq=LORA_SEQ, schedule="interleaved", lora=lora_block(),
                    pipeline={"virtual_stages": 2})
    engine, *_ = ds_mp.initialize(model=peft_model(), config=cfg)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps_data()]
    assert not [n for n, p in engine.module.named_parameters() if not p.requires_grad and p.grad is not None]
    return losses


def _qwen2() -> tuple[list[float], dict]:
    """A tied Qwen2 (GQA, q/k/v biases, 4 layers) at PP=2, v=2: its losses and weights, for HF's."""
    from test_llama import CLIP, LR as QWEN_LR, SEQ as QWEN_SEQ, _train, steps_for, tiny_llama

    cfg = ds_config(pp=2, micro=2, gas=2, lr=QWEN_LR, clip=CLIP, seq=QWEN_SEQ, schedule="interleaved",
                    pipeline={"virtual_stages": 2})
    return _train(0, tiny_llama("qwen2", 2, True, n_layer=4), steps_for(), cfg)


# ------------------------------------------------------------------ layout-free checkpoints

@pytest.mark.parametrize("pipeline, extra, match", [
    ({"virtual_stages": 0}, {}, "ds_mp.pipeline.virtual_stages: must be"),
    ({"virtual_stages": 3}, {}, "ds_mp.pipeline.virtual_stages: 2 stages × 3 chunks exceed n_layer=4"),
    ({"virtual_stages": 2}, {"gradient_accumulation_steps": 3}, "gradient_accumulation_steps: 3 micro-batches"),
    ({"virtual_stages": 2, "partition": [1, 1, 2]}, {}, "ds_mp.pipeline.partition: expected 4"),
    ({"virtual_stages": 2}, {"zero_optimization": {"stage": 2}}, "zero_optimization.stage: the interleaved"),
    ({"virtual_stages": 2}, {"fp16": {"enabled": True}}, "fp16.enabled: the interleaved"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, {}, "ds_mp.pipeline.virtual_stages: 2 chunks per stage need"),
    ({"virtual_stages": 2, "stages": 1}, {}, "ds_mp.pipeline.stages: 1; the interleaved schedule needs a ring")])
def test_refused_combinations(pipeline: dict, extra: dict, match: str, monkeypatch) -> None:
    from deepspeed.accelerator import get_accelerator

    from ds_mp.config import ConfigError, load_config

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)

    cfg = ds_config(pp=2, schedule="interleaved", model={"n_layer": 4, "n_embd": 48, "n_head": 4, "vocab_size": 203})
    cfg["ds_mp"]["pipeline"].update(pipeline)
    with pytest.raises(ConfigError, match=match) as e:
        load_config({**cfg, **extra}, 2)
    assert "\n" not in str(e.value)
