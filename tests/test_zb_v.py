"""ZB-V trains (``"pipeline": {"schedule": "zb-v"}``): the runtime against HF's unmodified GPT-2.

* pure Python: the V placement (rank r holds chunks r and 2P − 1 − r; rank 0 both ends), the
  compiled instruction streams (one op per instruction, nothing sent across the turn);
* two ranks (PP=2, fp32, tied GPT-2) against HF on one process with torch SGD: padded rows of
  uneven lengths with an ``attention_mask`` (HF with the mask: losses, every weight after 3 steps,
  ``eval_batch``), and plain rows with clipping active (losses, pre-clip norms, weights), under the
  bounded and the paper deferral — each within 1e-5;
* refusals: one line naming the key and the fix.
"""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from ds_mp.models.partition import v_layout
from ds_mp.schedules.simulate import Op
from ds_mp.schedules.zb_v import VBackwardInput, VBackwardWeight, VForward, ZeroBubbleV
from helpers import ds_config, tiny_gpt2
from sft_data import hf_masked, padded
from test_tensor_parallel import gather_weights, hf_train, max_diff
from test_zero_bubble import _steps  # 2-row micro-batches of 16 tokens, a masked label in each step

V, SEQ, ROWS, LR, TOL = 203, 16, 2, 0.1, 1e-5


# ------------------------------------------------------------------ pure Python

def test_v_layout_puts_both_ends_on_rank_0() -> None:
    names = ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "ln_f", "lm_head"]
    out, parts = v_layout(names, [0, 3, 4, 5, 8], 2)  # chunks [wte wpe h.0] [h.1] [h.2] [h.3 ln_f lm_head]
    assert out[:parts[1]] == ["wte", "wpe", "h.0", "h.3", "ln_f", "lm_head"]
    assert out[parts[1]:parts[2]] == ["h.1", "h.2"]


@pytest.mark.parametrize("deferral", ["bounded", "paper"])
def test_compiled_streams_run_each_op_once_and_nothing_crosses_the_turn(deferral: str) -> None:
    import deepspeed.runtime.pipe.schedule as ds

    M = 4
    for r in range(2):
        sched = ZeroBubbleV(M, 2, r, deferral)
        cmds = [c for step in sched.steps() for c in step]
        ops = sorted((type(c).__name__, c.kwargs["micro"], c.kwargs["chunk"]) for c in cmds
                     if isinstance(c, (VForward, VBackwardInput, VBackwardWeight)))
        assert ops == sorted((k, m, c) for k in ("VForward", "VBackwardInput", "VBackwardWeight")
                             for m in range(M) for c in (0, 1))
        sends = [c for c in cmds if isinstance(c, (ds.SendActivation, ds.SendGrad))]
        # rank 0 sends chunk 0's activations and chunk 1's gradients; rank 1 (the turn) the others: 2M each
        assert len(sends) == 2 * M and not any(isinstance(c, ds.LoadMicroBatch) for c in cmds)
    fwd = ZeroBubbleV(M, 2, 1, forward_only=True).table()[1]
    assert fwd == [Op("F", m, c) for c in (0, 1) for m in range(M)]


# ------------------------------------------------------------------ two ranks against HF

def _padded_case(name: str, **pipeline) -> dict:
    steps = [padded(4, ROWS, SEQ, V, seed=7 + i, side="right") for i in range(3)]
    return {"name": name, "steps": steps, "clip": 0.0,
            "cfg": ds_config(pp=2, micro=ROWS, gas=4, lr=LR, schedule="zb-v", seq=SEQ, pipeline=pipeline)}


def _clip_case(name: str, gas: int = 4, **pipeline) -> dict:
    return {"name": name, "steps": _steps(3, gas, seed=11), "clip": 0.5,
            "cfg": ds_config(pp=2, micro=2, gas=gas, lr=LR, clip=0.5, schedule="zb-v", seq=SEQ, pipeline=pipeline)}


CASES = [_padded_case("masked"), _clip_case("clip"), _clip_case("clip_paper_m3", gas=3, zb_max_pending_w="paper")]


def _rank(rank: int) -> dict:
    import ds_mp

    out = {}
    for case in CASES:
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=case["cfg"])
        evaluated = float(engine.eval_batch(iter(case["steps"][0])))  # before any update
        losses, norms = [], []
        for step in case["steps"]:
            losses.append(float(engine.train_batch(iter(step))))
            norms.append(engine.last_grad_norm)
        out[case["name"]] = (losses, norms, gather_weights(engine)[0], evaluated)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_rank, 2, timeout=600)


def test_zb_v_trains_as_hf(results: list[dict]) -> None:
    model = tiny_gpt2()
    for case in CASES:
        if case["clip"]:
            want, want_norms, want_w = hf_train(model, case["steps"], LR, case["clip"])
            assert min(want_norms) > case["clip"], "clipping must be active to be tested"
        else:
            (want, want_w), want_norms = hf_masked(model, case["steps"], LR), None
        seen: set = set()
        for rank, res in enumerate(results):
            losses, norms, w, evaluated = res[case["name"]]
            where = f"{case['name']} rank {rank}: {losses} vs HF {want}"
            assert max(abs(a - b) for a, b in zip(losses, want)) <= TOL, where
            assert abs(evaluated - want[0]) <= TOL, f"{where}: eval_batch {evaluated}"
            if want_norms:
                assert all(abs(a - b) <= TOL * b for a, b in zip(norms, want_norms)), f"{where}: {norms} {want_norms}"
            assert max_diff(w, want_w) <= TOL, f"{where}: weights differ by {max_diff(w, want_w)}"
            assert ("transformer.wte.weight" in w) == (rank == 0), "the tied embedding lives on rank 0 only"
            seen |= set(w)
        assert seen == set(want_w), f"{case['name']}: {set(want_w) ^ seen} not covered"


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("ds_mp, extra, match", [
    ({"pipeline": {"stages": 3}}, {}, "ds_mp.pipeline.stages: 3; the zb-v schedule runs at 2 stages"),
    ({"model": {"n_layer": 3}}, {}, "zb-v cuts the 3 blocks into 2·stages = 4 chunks"),
    ({"pipeline": {"partition": [2, 2]}}, {}, "ds_mp.pipeline.partition: \\[2, 2\\] with zb-v"),
    ({"pipeline": {"zb_max_pending_w": 1}}, {}, "ds_mp.pipeline.zb_max_pending_w: 1; zb-v defers"),
    ({"tensor_parallel": {"size": 2}}, {}, "ds_mp.tensor_parallel.size: 2 is not supported by the zb-v"),
    ({"lora": {"r": 4}}, {}, "ds_mp.lora.r is not supported by the zb-v"),
    ({"pipeline": {"activation_checkpoint_interval": 1}}, {}, "activation_checkpoint_interval is not supported")])
def test_refused_combinations(ds_mp: dict, extra: dict, match: str) -> None:
    from ds_mp.config import ConfigError, load_config
    from ds_mp.models.family import inline_config

    cfg = ds_config(pp=2, schedule="zb-v", model={"n_layer": 4, "n_embd": 48, "n_head": 4, "vocab_size": 203})
    for k, v in ds_mp.items():
        cfg["ds_mp"].setdefault(k, {}).update(v)
    world = cfg["ds_mp"]["tensor_parallel"]["size"] * cfg["ds_mp"]["pipeline"]["stages"]
    with pytest.raises(ConfigError, match=match) as e:
        parsed, _ = load_config({**cfg, **extra}, world)
        ZeroBubbleV.pipeline_layout(parsed, inline_config(parsed.shape))
    assert "\n" not in str(e.value)
