"""ZeRO-2 (gradient partitioning) on ds_mp's pipeline engine, against the unmodified HF model.

Oracle: the single-process HF ``GPT2LMHeadModel`` with ``torch.optim.AdamW`` and
``torch.nn.utils.clip_grad_norm_`` (clipping active every step), fed the concatenation of every
DP replica's micro-batches.  The engines run DeepSpeed's stage-2 optimizer with a small
``reduce_bucket_size`` (several buckets per backward, and parameters larger than a bucket), two
micro-batches per step (gradient accumulation) and each DP replica its own batches:

* fp32 at TP = 2 × DP = 2 and at PP = 2 × DP = 2 (1F1B; TeraPipe with activation checkpointing,
  several backward calls per micro-batch): every step's loss within ``FP32_TOL`` of HF, and
  DeepSpeed's ``get_global_grad_norm()`` (each TP shard once, the partitions' squares summed
  over DP) within ``FP32_TOL`` of torch's pre-clip norm;
* bf16 at TP = 2 × DP = 2: within the measured tolerances below;
* DP replicas hold identical weights after the steps.

Without ds_mp's ZeRO-2 driver (engine/zero2.py) the config is refused; with the constructor's
assert merely bypassed, the second micro-batch of a step fails ("already been reduced"); without
the tied-gradient sum of ``zero2.close_step`` PP = 2 drifts (norm 40 % low by step 2, measured).
"""
from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2, train_one_process

VOCAB, SEQ, LR, CLIP, STEPS = 203, 16, 0.01, 0.5, 3
FP32_TOL = 1e-5
# bf16 ZeRO-2 at TP2 x DP2 against HF fp32, measured 2026-11-25: losses 2.9e-4, norms 5.5e-3 relative.
BF16_LOSS_TOL, BF16_NORM_TOL = 1e-3, 2e-2

CASES = {  # name: (tp, pp, dp, schedule, bf16)
    "fp32_tp2dp2": (2, 1, 2, "1f1b", False),
    "bf16_tp2dp2": (2, 1, 2, "1f1b", True),
    "fp32_pp2dp2": (1, 2, 2, "1f1b", False),
    "fp32_pp2dp2_terapipe": (1, 2, 2, "terapipe", False),
}


def zero2_config(tp: int, pp: int, schedule: str = "1f1b", bf16: bool = False) -> dict:
    extra: dict = {}
    if schedule == "terapipe":  # token slices: two backward calls per micro-batch, recomputed forwards
        extra = {"terapipe": {"slices": [6, 10]}, "pipeline": {"activation_checkpoint_interval": 1}}
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, clip=CLIP, optimizer="AdamW", seq=SEQ, schedule=schedule,
                    **extra)
    cfg["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 3000}  # several buckets, some params larger
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def steps_for(dp: int, n: int = STEPS) -> list[list]:
    """``n`` steps of 2·DP micro-batches; replica d takes micro-batches 2d, 2d+1 of each."""
    out = []
    for s in range(n):
        mbs = batches(2 * dp, 2, SEQ, VOCAB, seed=100 + s)
        mbs[0][1][0, :2] = -100  # some ignored labels
        out.append(mbs)
    return out


def hf_adamw(model: torch.nn.Module, steps: list[list]) -> tuple[list[float], list[float]]:
    """HF on one process: AdamW (no weight decay, as ds_mp's groups with weight_decay 0) with
    torch's clipping; per step the mean loss and the pre-clip global norm."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    return train_one_process(model, steps, opt, CLIP)


def weights_digest(engine) -> str:
    h = hashlib.sha1()
    for _, p in sorted(engine.module.named_parameters()):
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _rank(rank: int, world: int) -> dict:
    import ds_mp

    out = {}
    for name, (tp, pp, dp, schedule, bf16) in CASES.items():
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=zero2_config(tp, pp, schedule, bf16))
        assert engine.optimizer.partition_gradients and engine.zero_optimization_stage() == 2
        d = engine.topology.dp_rank
        losses, norms = [], []
        for step in steps_for(dp):
            losses.append(float(engine.train_batch(iter(step[2 * d:2 * d + 2]))))
            norms.append(float(engine.get_global_grad_norm()))
        t = engine.topology
        out[name] = {"losses": losses, "norms": norms, "coord": (t.tp_rank, t.pp_rank), "digest": weights_digest(engine)}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_rank, 4, 4, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_zero2_equals_hf(name: str, runs: list[dict]) -> None:
    tp, pp, dp, schedule, bf16 = CASES[name]
    hf_losses, hf_norms = hf_adamw(tiny_gpt2(), steps_for(dp))
    assert min(hf_norms) > CLIP, f"clipping must be active to test it ({hf_norms})"
    loss_tol, norm_tol = (BF16_LOSS_TOL, BF16_NORM_TOL) if bf16 else (FP32_TOL, FP32_TOL)
    for rank, res in enumerate(runs):
        losses, norms = res[name]["losses"], res[name]["norms"]
        where = f"{name} rank {rank}: losses {losses} norms {norms} vs HF {hf_losses} {hf_norms}"
        assert all(abs(a - b) <= loss_tol * abs(b) for a, b in zip(losses, hf_losses)), where
        assert all(abs(a - b) <= norm_tol * b for a, b in zip(norms, hf_norms)), where
    by_coord: dict = {}
    for res in runs:  # DP replicas (same TP and PP coordinate) hold the same weights
        by_coord.setdefault(res[name]["coord"], set()).add(res[name]["digest"])
    assert all(len(d) == 1 for d in by_coord.values()), f"{name}: DP replicas differ: {by_coord}"
    assert len(by_coord) == 4 // dp


def test_zero2_refused_with_ouroboros() -> None:
    """Ouroboros assembles its gradients by hand, outside ZeRO's reduction hooks: refused."""
    from ds_mp.config import ConfigError, load_config

    cfg = {**ds_config(pp=1, schedule="ouroboros"), "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match="zero_optimization.stage: the ouroboros schedule supports ZeRO stage 0"):
        load_config(cfg, 2)


def test_zero3_refused() -> None:
    from ds_mp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"zero_optimization.stage: 3, .*set it to 2") as e:
        load_config({**ds_config(tp=2), "zero_optimization": {"stage": 3}}, 2)
    assert "\n" not in str(e.value)


# --- layout-free checkpoints under ZeRO-2 -------------------------------------------------------
RESUME_STAGES = (2, 1, 0)  # the wrapper the run resumes under, at TP = 1 × DP = 2


def _save_rank(rank: int, root: str) -> list[float]:
    """TP = 2 × DP = 2, ZeRO-2: the first two steps, then a layout-free checkpoint."""
    import ds_mp
    from ds_mp.checkpoint import save_checkpoint

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=zero2_config(2, 1))
    d = engine.topology.dp_rank
    losses = [float(engine.train_batch(iter(step[2 * d:2 * d + 2]))) for step in steps_for(2, 4)[:2]]
    save_checkpoint(engine, root, "step2")
    return losses


def _resume_rank(rank: int, root: str) -> dict:
    """TP = 1 × DP = 2 under ZeRO-2, -1 and -0: load, then the remaining steps."""
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint

    out = {}
    for stage in RESUME_STAGES:
        cfg = zero2_config(1, 1)
        cfg["zero_optimization"]["stage"] = stage
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(seed=5), config=cfg)  # other weights: the load must set them
        load_checkpoint(engine, root)
        d = engine.topology.dp_rank
        out[stage] = ([float(engine.train_batch(iter(step[2 * d:2 * d + 2]))) for step in steps_for(2, 4)[2:]],
                      weights_digest(engine))
    return out


def test_zero2_checkpoint_resumes_at_another_layout_and_wrapper(tmp_path) -> None:
    """Saved at TP2 × DP2 under ZeRO-2 (fp32 masters and AdamW moments gathered from the DP
    partitions), resumed at TP1 × DP2 under ZeRO-2, ZeRO-1 and no ZeRO: every step equals the
    uninterrupted HF run (fp32, ``FP32_TOL``), and the DP replicas agree."""
    hf_losses, _ = hf_adamw(tiny_gpt2(), steps_for(2, 4))
    saved = run_ranks(_save_rank, 4, str(tmp_path), timeout=600)
    resumed = run_ranks(_resume_rank, 2, str(tmp_path), timeout=600)
    for losses in saved:
        assert all(abs(a - b) <= FP32_TOL * abs(b) for a, b in zip(losses, hf_losses[:2])), (losses, hf_losses)
    for stage in RESUME_STAGES:
        (losses, digest), (_, other) = resumed[0][stage], resumed[1][stage]
        where = f"resumed under ZeRO-{stage}: {losses} vs HF {hf_losses[2:]}"
        assert all(abs(a - b) <= FP32_TOL * abs(b) for a, b in zip(losses, hf_losses[2:])), where
        assert digest == other, f"ZeRO-{stage}: DP replicas differ after the resume"


# --- a non-finite step is skipped; the constructor's stage is the only one hidden ---------------
def _nan_rank(rank: int) -> dict:
    import ds_mp

    cfg = ds_config(lr=1e30, seq=SEQ)  # SGD: the first step blows the weights up, the next gradients are not finite
    cfg["zero_optimization"] = {"stage": 2}
    cfg["zero_allow_untested_optimizer"] = True  # DeepSpeed's rule for SGD under ZeRO
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
    for _ in range(3):
        engine.train_batch(iter(batches(2, 2, SEQ, VOCAB)))
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    return {"nonfinite": engine.nonfinite_steps, "finite": finite}


def test_zero2_skips_a_nonfinite_step() -> None:
    """ZeRO-2 keeps no ``.grad`` after its reduction: ds_mp's NaN check (what ``training.on_nan``
    acts on) reads the DP partitions' gradients, so the step is counted and skipped and the
    weights stay finite.  Reading ``.grad`` it counted nothing (measured: nonfinite_steps 0)."""
    for r in run_ranks(_nan_rank, 2, timeout=300):
        assert r["nonfinite"] >= 1 and r["finite"], r


def _stage_rank(rank: int) -> dict:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import ds_mp

    engine, *_ = ds_mp.initialize(model=tiny_gpt2(vocab=VOCAB), config=zero2_config(1, 1))
    return {"stage": engine.zero_optimization_stage(), "armed": "_ds_mp_stage_for_pipeline_assert" in engine.__dict__,
            "optimizer": isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and engine.optimizer.partition_gradients}


def test_zero2_stage_hidden_only_from_the_pipeline_constructor_assert() -> None:
    """The stage gate (deepspeed_compat/stage_gate.py) hands ``min(stage, 1)`` to exactly one read,
    the one armed when ``DeepSpeedEngine.__init__`` returns (PipelineEngine's assert); the optimizer
    was built at stage 2 and every read after construction sees 2."""
    from types import SimpleNamespace

    from ds_mp import deepspeed_compat as compat
    from ds_mp.deepspeed_compat.stage_gate import PipelineStageGate, disarm

    compat.check_zero2()
    gate = PipelineStageGate.__new__(PipelineStageGate)
    gate.__dict__["_config"] = SimpleNamespace(zero_optimization_stage=2)
    assert gate.zero_optimization_stage() == 2  # not armed: the real stage (the optimizer's construction)
    gate.__dict__["_ds_mp_stage_for_pipeline_assert"] = True  # as DeepSpeedEngine.__init__ returns
    assert gate.zero_optimization_stage() == 1  # the assert on PipelineEngine.__init__'s next line
    assert gate.zero_optimization_stage() == 2  # one shot
    gate.__dict__["_config"] = SimpleNamespace(zero_optimization_stage=1)
    gate.__dict__["_ds_mp_stage_for_pipeline_assert"] = True
    assert gate.zero_optimization_stage() == 1
    disarm(gate)
    gate.__dict__["_ds_mp_stage_for_pipeline_assert"] = True
    disarm(gate)
    gate.__dict__["_config"] = SimpleNamespace(zero_optimization_stage=2)
    assert gate.zero_optimization_stage() == 2  # disarmed after the constructor
    (r,) = run_ranks(_stage_rank, 1, timeout=300)
    assert r == {"stage": 2, "armed": False, "optimizer": True}, r
