"""A run's whole life: train k steps, save, resume at another layout or DP, train k more — equal
to the uninterrupted run — over precision × ZeRO × layout change × schedule × LoRA × optimizer ×
clipping, pairwise.

* :data:`FACTORS` are the factors; :func:`refusal` states which combinations ds_mp refuses at
  config time and why (:data:`REFUSALS`); :data:`CASES` is a greedy pairwise cover of every pair
  of factor values that some runnable combination holds.  ``test_refusals_are_exactly_the_rules``
  runs ds_mp's own config check over the whole product, so the rules cannot drift from the code;
  ``test_every_pair_is_covered_or_refused`` checks the cover.  docs/layouts.md's table is this list.
* Each case: an engine at the ``before`` layout trains :data:`K` steps, saves (half the cases
  through DeepSpeed's own ``engine.save_checkpoint`` / ``engine.load_checkpoint``, half through
  ``ds_mp.save_checkpoint`` / ``ds_mp.load_checkpoint``), trains :data:`K` more; a fresh engine at
  the ``after`` layout (another TP × PP × DP, same world size; the global batch kept by changing
  gradient accumulation) loads it and trains the same :data:`K` steps.  Its losses equal the
  uninterrupted ones (fp32: :data:`FP32_RTOL`; bf16/fp16: :data:`HALF_RTOL`, measured), and DP
  replicas hold bit-identical parameters at the end of both runs.  Each DP replica reads its own
  micro-batches; an LR warm-up runs through the resume (its state must travel too).
* zb-v schedules a pipeline: where a change's side has none (PP = 1) that side runs 1f1b, so
  its cases resume across schedules too (zb-v -> 1f1b at DP = 2, 1f1b at TP = 2 -> zb-v) or at
  another pipelined layout (TP2 × PP2 -> PP2 × DP2); DP2 -> TP2 has no zb-v case
  (:data:`NOT_A_CASE`).
* Ouroboros keeps work in flight across steps (stashed inputs, deltas), tied to its ring (PP) and
  to each replica's samples (DP): it resumes at the same PP and DP and any TP, which needs another
  world size (``test_run_life_mends.test_ouroboros_in_flight_work_resumes_at_another_tp``, with
  the refusal of a DP change).  Here the ``after`` layout of an Ouroboros case is its ``before``.
* The saves and loads run under :class:`test_combinations.CollectiveDeviceGuard`: every tensor ds_mp
  hands to a collective on the way was made with an explicit device.
"""
from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from helpers import batches, tiny_gpt2

# The module fixture trains every case (140 s on a quiet 2-core box, past 300 s under load): the
# ranks' own limit is run_ranks' 900 s, and pytest's matches it so a loaded CI does not cut it short.
pytestmark = pytest.mark.timeout(900)

VOCAB, SEQ, K, ROWS = 203, 16, 2, 4  # ROWS sequences per global batch, one per micro-batch
FP32_RTOL = 1e-5
HALF_RTOL = 5e-4  # bf16: resumed vs uninterrupted losses; measured max 5.0e-5 over the bf16 cases (10x headroom)

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2), "tp2pp2": (2, 2, 1), "pp2dp2": (1, 2, 2),
           "tp2dp2": (2, 1, 2)}
CHANGES = {"tp2>pp2": ("tp2", "pp2"), "pp2>dp2": ("pp2", "dp2"), "dp2>tp2": ("dp2", "tp2"),
           "tp2pp2>pp2dp2": ("tp2pp2", "pp2dp2")}
FACTORS: dict[str, tuple] = {
    "precision": ("fp32", "bf16", "fp16"),
    "zero": (0, 1, 2),
    "change": tuple(CHANGES),
    "schedule": ("1f1b", "gpipe", "terapipe", "ouroboros", "zb-v"),
    "lora": (False, True),
    "optimizer": ("AdamW", "Lamb", "SGD"),
    "clip": (0.0, 0.5),
}

# (predicate over a case's values, the words ds_mp's ConfigError must contain)
REFUSALS: list[tuple[str, Any, str]] = [
    ("ouroboros assembles module gradients by hand: no LoRA", lambda c: c["schedule"] == "ouroboros" and c["lora"],
     r"ds_mp\.lora: not supported with the ouroboros schedule"),
    ("ouroboros: no ZeRO", lambda c: c["schedule"] == "ouroboros" and c["zero"] > 0,
     r"zero_optimization\.stage: the ouroboros schedule supports ZeRO stage 0"),
    ("ouroboros: no fp16 loss scaling", lambda c: c["schedule"] == "ouroboros" and c["precision"] == "fp16",
     r"fp16\.enabled: the ouroboros schedule trains in fp32 or bf16"),
    ("zb-v defers W past DeepSpeed's backward: no ZeRO-2", lambda c: c["schedule"] == "zb-v" and c["zero"] == 2,
     r"zero_optimization\.stage: the zb-v schedule computes weight gradients in a deferred pass"),
    ("zb-v: fp32 and bf16 only", lambda c: c["schedule"] == "zb-v" and c["precision"] == "fp16",
     r"fp16\.enabled: the zb-v schedule is tested in fp32 and bf16 only"),
]
# (predicate, why): combinations that would not test what their values say, left out of the cover.
NOT_A_CASE: list[tuple[Any, str]] = [
    (lambda c: c["schedule"] == "zb-v" and c["change"] == "dp2>tp2",
     "zb-v needs a pipeline: with none on either side the case would run 1f1b only"),
]


def refusal(values: dict) -> str | None:
    """The message pattern ds_mp must refuse ``values`` with (any of the rules that apply), or
    None if it must run."""
    patterns = [pattern for _, rule, pattern in REFUSALS if rule(values)]
    return "|".join(f"(?:{p})" for p in patterns) or None


def layouts_of(values: dict) -> tuple[str, str]:
    before, after = CHANGES[values["change"]]
    return (before, before) if values["schedule"] == "ouroboros" else (before, after)


def schedule_at(values: dict, layout: str) -> str:
    """The schedule a case runs at ``layout``: its own, but 1f1b where zb-v has no pipeline (PP = 1),
    so a zb-v case's change across PP = 1 also resumes across schedules (zb-v -> 1f1b or back)."""
    return "1f1b" if values["schedule"] == "zb-v" and LAYOUTS[layout][1] == 1 else values["schedule"]


def is_case(values: dict) -> bool:
    """Runnable and testing what its values say (:data:`REFUSALS`, :data:`NOT_A_CASE`)."""
    return refusal(values) is None and not any(rule(values) for rule, _ in NOT_A_CASE)


def config(values: dict, layout: str) -> dict:
    """The DeepSpeed JSON of a case at ``layout`` (global batch ROWS rows at every DP)."""
    tp, pp, dp = LAYOUTS[layout]
    lr = {"AdamW": 0.01, "Lamb": 0.01, "SGD": 0.1}[values["optimizer"]]
    params = {"AdamW": {"lr": lr, "weight_decay": 0.1, "torch_adam": True},
              "Lamb": {"lr": lr, "weight_decay": 0.1}, "SGD": {"lr": lr, "momentum": 0.9}}[values["optimizer"]]
    cfg: dict = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ROWS // dp,
                 "gradient_clipping": values["clip"], "steps_per_print": 10**9,
                 "optimizer": {"type": values["optimizer"], "params": params},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                              "warmup_num_steps": 3, "warmup_type": "linear"}},
                 "ds_mp": {"tensor_parallel": {"size": tp},
                           "pipeline": {"stages": pp, "schedule": schedule_at(values, layout)},
                           "data": {"seq_len": SEQ},
                           "model": {"n_layer": 4, "n_embd": 48, "n_head": 4, "vocab_size": VOCAB,
                                     "n_positions": 64, "dropout": 0.0}}}
    if values["schedule"] == "terapipe":
        cfg["ds_mp"]["terapipe"] = {"slices": [6, 10]}
    if values["lora"]:
        cfg["ds_mp"]["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["c_attn", "c_proj", "c_fc"]}
    if values["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif values["precision"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if values["zero"]:
        cfg["zero_optimization"] = {"stage": values["zero"]}
        cfg["zero_allow_untested_optimizer"] = True  # DeepSpeed's rule for SGD and client optimizers
    return cfg


def _all_values() -> list[dict]:
    return [dict(zip(FACTORS, combo)) for combo in itertools.product(*FACTORS.values())]


def _pairs(values: dict) -> set[tuple]:
    items = sorted(values.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairwise_cases() -> list[dict]:
    """Greedy pairwise cover over the runnable combinations (deterministic): first without zb-v
    (the cover the matrix had before it), then the pairs zb-v adds."""
    runnable = [v for v in _all_values() if is_case(v)]
    cases: list[dict] = []
    for pool in ([v for v in runnable if v["schedule"] != "zb-v"], runnable):
        todo = set().union(*(_pairs(v) for v in pool)) - set().union(set(), *(_pairs(c) for c in cases))
        while todo:
            best = max(pool, key=lambda v: len(_pairs(v) & todo))
            cases.append(best)
            todo -= _pairs(best)
    return cases


CASES = pairwise_cases()


def case_id(values: dict) -> str:
    return "-".join(f"{values['precision']} z{values['zero']} {values['change']} {values['schedule']} "
                    f"{'lora ' if values['lora'] else ''}{values['optimizer']} clip{values['clip']}".split())


# --- the rank program ------------------------------------------------------------------------
def _data(values: dict) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """2K global batches of ROWS one-row micro-batches (a few ignored labels)."""
    out = []
    for t in range(2 * K):
        mbs = batches(ROWS, 1, SEQ, VOCAB, seed=50 + t)
        mbs[0][1][0, :3] = -100
        out.append(mbs)
    return out


def _replica_digest(engine: Any) -> list[tuple[int, int, int, float]]:
    """Every rank's (tp, pp, dp, Σ params in float64) (collective), so replicas can be compared."""
    import torch.distributed as dist

    topo = engine.topology
    total = float(sum(p.detach().double().sum() for p in engine.module.parameters()))
    mine = (topo.tp_rank, topo.pp_rank, topo.dp_rank, total)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _train(engine: Any, steps: list) -> list[float]:
    topo = engine.topology
    gas = ROWS // topo.dp
    return [float(engine.train_batch(iter(mbs[topo.dp_rank * gas:(topo.dp_rank + 1) * gas]))) for mbs in steps]


def run_case(values: dict, ckpt: str, api: str, switch: dict | None = None) -> dict:
    """``switch`` (precision / zero of the resumed engine) changes the wrapper at the resume."""
    import ds_mp
    from test_combinations import CollectiveDeviceGuard

    before, after = layouts_of(values)
    data = _data(values)
    engine = None
    with CollectiveDeviceGuard(lambda: engine.device if engine is not None else torch.device("cpu")) as guard:
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=config(values, before))
        torch.manual_seed(3)
        first = _train(engine, data[:K])
        if api == "deepspeed":
            engine.save_checkpoint(ckpt, tag="mid", client_state={"seen": K})
        else:
            ds_mp.save_checkpoint(engine, ckpt, "mid", client_state={"seen": K})
        rest = _train(engine, data[K:])
        digest_a = _replica_digest(engine)
        resumed_as = {**values, **(switch or {})}
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(seed=1), config=config(resumed_as, after))  # other init: all loaded
        if api == "deepspeed":
            path, client = engine.load_checkpoint(ckpt)
            assert path.endswith("mid"), path
        else:
            client = ds_mp.load_checkpoint(engine, ckpt)
        assert client == {"seen": K} and engine.global_steps == K
        torch.manual_seed(3)
        resumed = _train(engine, data[K:])
        digest_b = _replica_digest(engine)
    return {"first": first, "rest": rest, "resumed": resumed, "digests": (digest_a, digest_b),
            "guard_errors": guard.errors}


def _program(rank: int, jobs: list[tuple]) -> dict:
    return {name: run_case(*args) for name, *args in jobs}


# Resumes that change precision and optimizer wrapper (fp32 <-> bf16, ZeRO 0/1/2): the checkpoint
# holds fp32 masters and fp32 optimizer state whatever wrote it.  Compared with the uninterrupted
# run in the precision it was saved in, at SWITCH_RTOL (bf16 activations on one side only).
SWITCHES: list[tuple[dict, dict]] = [
    (dict(precision="fp32", zero=0, change="tp2>pp2", schedule="1f1b", lora=False, optimizer="AdamW", clip=0.5),
     dict(precision="bf16", zero=1)),
    (dict(precision="bf16", zero=1, change="pp2>dp2", schedule="gpipe", lora=False, optimizer="AdamW", clip=0.0),
     dict(precision="fp32", zero=2)),
]
SWITCH_RTOL = 5e-4  # bf16 vs fp32 activations over two steps (measured max 4.5e-5)


def switch_id(values: dict, switch: dict) -> str:
    return f"{case_id(values)}-to-{switch['precision']}-z{switch['zero']}"


def _world(values: dict) -> int:
    tp, pp, dp = LAYOUTS[layouts_of(values)[0]]
    return tp * pp * dp


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every runnable case here, one spawn per world size (process start-up dominates)."""
    out: dict[str, list[dict]] = {}
    for world in (2, 4):
        jobs = [(case_id(v), v, str(tmp_path_factory.mktemp("life")), ("deepspeed", "ds_mp")[i % 2])
                for i, v in enumerate(CASES) if _world(v) == world]
        jobs += [(switch_id(v, sw), v, str(tmp_path_factory.mktemp("switch")), "ds_mp", sw)
                 for v, sw in SWITCHES if _world(v) == world]
        if jobs:
            per_rank = run_ranks(_program, world, jobs, timeout=900)
            for name, *_ in jobs:
                out[name] = [r[name] for r in per_rank]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_resume_at_another_layout_equals_uninterrupted(values, results):
    ranks = results[case_id(values)]
    rtol = FP32_RTOL if values["precision"] == "fp32" else HALF_RTOL
    for r in ranks:
        assert r["guard_errors"] == []
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["rest"]), rtol=rtol, atol=0)
        assert r["rest"] != r["first"]
        for digest in r["digests"]:  # DP replicas: bit-identical parameters
            by_coord: dict[tuple, set] = {}
            for tp, pp, _, total in digest:
                by_coord.setdefault((tp, pp), set()).add(total)
            assert all(len(v) == 1 for v in by_coord.values()), digest


@pytest.mark.slow
@pytest.mark.parametrize("values, switch", SWITCHES, ids=[switch_id(v, sw) for v, sw in SWITCHES])
def test_resume_in_another_precision_continues_the_run(values, switch, results):
    """Saved in fp32 and resumed in bf16 under ZeRO-1, and back (bf16 ZeRO-1 -> fp32 ZeRO-2), at
    another layout: the resumed losses follow the uninterrupted run within SWITCH_RTOL."""
    for r in results[switch_id(values, switch)]:
        assert r["guard_errors"] == []
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["rest"]), rtol=SWITCH_RTOL, atol=0)


# --- the cover and the refusals --------------------------------------------------------------
def test_every_pair_is_covered_or_refused():
    """Each pair of factor values is in some case, or every combination holding it is refused (or
    left out as :data:`NOT_A_CASE`)."""
    covered = set().union(*(_pairs(v) for v in CASES))
    for values in _all_values():
        for pair in _pairs(values):
            if pair not in covered:
                holders = [v for v in _all_values() if pair in _pairs(v)]
                assert not any(is_case(v) for v in holders), pair


def test_refusals_are_exactly_the_rules(monkeypatch):
    """ds_mp's config check over the whole product (fp16 judged as if the accelerator had it):
    it refuses exactly what :data:`REFUSALS` says, with the words it says, and nothing else — at
    each layout for the schedule that runs there (:func:`schedule_at`)."""
    from deepspeed.accelerator import get_accelerator

    from ds_mp.config import ConfigError, load_config

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    seen = set()
    for values in _all_values():
        for layout in set(layouts_of(values)):
            tp, pp, dp = LAYOUTS[layout]
            there = {**values, "schedule": schedule_at(values, layout)}
            key = (tuple(sorted((k, v) for k, v in there.items() if k != "change")), layout)
            if key in seen:
                continue
            seen.add(key)
            pattern = refusal(there)
            if pattern is None:
                load_config(config(values, layout), tp * pp * dp)
            else:
                with pytest.raises(ConfigError, match=pattern):
                    load_config(config(values, layout), tp * pp * dp)


def test_cases_are_few_enough():
    """The cover stays small (the suite's time budget): at most 30 cases."""
    assert len(CASES) <= 30, len(CASES)
    assert all(re.fullmatch(r"[\w.>-]+", case_id(v)) for v in CASES)
