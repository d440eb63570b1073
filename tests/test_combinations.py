"""What combines with what: model family × precision × optimizer wrapper × layout × schedule, with clipping.

The oracle is the unmodified single-process HF model of the case (``GPT2LMHeadModel``, or the
Llama family's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``) trained with
torch SGD and ``torch.nn.utils.clip_grad_norm_`` (:func:`test_tensor_parallel.hf_train`):

* fp32: every step's loss within 2e-4 relative of HF, and DeepSpeed's public
  ``engine.get_global_grad_norm()`` within 1e-4 relative of torch's pre-clip norm.
* bf16: the loss falls, the step-1 norm is within 3% of HF's fp32 norm, and losses/norms are
  within ``BF16_VS_ONE_RANK`` of the same bf16 config trained on one rank.

Pairwise coverage (:data:`CASES`, asserted by :func:`test_cases_cover_every_pair`): layout ×
schedule needs all 15 pairs of 1f1b/gpipe/TeraPipe, and zb-h1, interleaved (v = 2) and zb-v meet
the three PP = 2 layouts, so there are 24 cases; the precision/wrapper pair of each case
rotates so every schedule sees both precisions and both wrappers (the first three all four
pairs) and every layout three of them.  Nine cases train a Llama-family model instead
of GPT-2 (:data:`MODELS`), chosen so the family meets every layout, schedule, precision and
wrapper and GPT-2 still does too.  Awkward sizes: vocab 203; GPT-2 n_embd 48, 4 heads, 4
layers; the Llama family hidden 72, 2 layers (4 for interleaved and zb-v: 2 × 2 chunks), 6 heads
(head dim 12) with 2 or 3 key/value heads (split or replicated at TP = 2), intermediate 128
(``test_llama.tiny_llama``); seq 16 (TeraPipe slices 6 + 10, and sequence parallelism where TP > 1).  Activation checkpointing every 1 (TeraPipe),
2 or 3 pipeline layers in 18 cases (:data:`CHECKPOINT`): every schedule meets intervals 2 and 3 on
GPT-2, whose token lookup then shares a checkpoint segment with the position embedding.

The same spawns also check (cheaply, on the engines already built) that every tensor ds_mp
hands to a collective was made on a device (:class:`CollectiveDeviceGuard`), and that
dropout seeds differ across pipeline stages and agree across TP ranks.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import sys
from typing import Any, Callable

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2
from test_llama import tiny_llama
from test_tensor_parallel import hf_train

VOCAB, SEQ, LR, CLIP, STEPS = 203, 16, 0.1, 1.0, 3
FP32_LOSS_TOL, FP32_NORM_TOL = 2e-4, 1e-4
BF16_NORM_VS_HF = 0.03  # step-1 norm against HF's fp32 norm
BF16_VS_ONE_RANK = 0.02  # losses and norms against the same bf16 config on one rank

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2pp2": (2, 2, 1), "tp2dp2": (2, 1, 2), "pp2dp2": (1, 2, 2)}
A, B, C, D = ("fp32", "none"), ("fp32", "zero1"), ("bf16", "none"), ("bf16", "zero1")
# (layout, schedule, (precision, wrapper)).  Per schedule the four (precision, wrapper) pairs
# rotate over the first four layouts (1f1b: A B C D, gpipe: B C D A, terapipe: C D A B), so
# precision×wrapper, precision×schedule and wrapper×schedule are all covered; each layout gets
# three distinct (precision, wrapper) pairs, covering precision×layout and wrapper×layout;
# layout×schedule is the full 5 × 3 grid.
CASES: list[tuple[str, str, tuple[str, str]]] = [
    ("tp2", "1f1b", A), ("tp2", "gpipe", B), ("tp2", "terapipe", C),
    ("pp2", "1f1b", B), ("pp2", "gpipe", C), ("pp2", "terapipe", D),
    ("tp2pp2", "1f1b", C), ("tp2pp2", "gpipe", D), ("tp2pp2", "terapipe", A),
    ("tp2dp2", "1f1b", D), ("tp2dp2", "gpipe", A), ("tp2dp2", "terapipe", B),
    ("pp2dp2", "1f1b", A), ("pp2dp2", "gpipe", C), ("pp2dp2", "terapipe", D),
    # zb-h1, interleaved (v = 2) and zb-v schedule a pipeline: only the PP = 2 layouts (at PP = 1 there
    # is none; interleaved and zb-v refuse it), each schedule with both precisions, both wrappers, both
    # families.
    ("pp2", "zb-h1", A), ("tp2pp2", "zb-h1", D), ("pp2dp2", "zb-h1", C),
    ("pp2", "interleaved", D), ("tp2pp2", "interleaved", A), ("pp2dp2", "interleaved", B),
    ("pp2", "zb-v", C), ("tp2pp2", "zb-v", B), ("pp2dp2", "zb-v", A),
]
PIPELINE_ONLY = ("zb-h1", "interleaved", "zb-v")  # schedules without a pairing at PP = 1
# (layout, schedule) -> the Llama-family model a case trains (every other case: GPT-2).  Qwen2: 2 KV
# heads (split at TP=2), q/k/v biases, untied head; Llama: 3 KV heads (replicated at TP=2, gradients
# summed), tied head; Mistral: 2 KV heads, tied head.
MODELS = {("tp2", "1f1b"): "qwen2", ("pp2", "terapipe"): "mistral", ("tp2pp2", "terapipe"): "qwen2",
          ("tp2pp2", "1f1b"): "llama", ("tp2dp2", "gpipe"): "llama", ("pp2dp2", "1f1b"): "mistral",
          ("tp2pp2", "zb-h1"): "qwen2", ("pp2dp2", "interleaved"): "llama", ("tp2pp2", "zb-v"): "llama"}
FAMILY_MODELS = {"qwen2": (2, False), "llama": (3, True), "mistral": (2, True)}  # (KV heads, tied)
# (layout, schedule) -> pipeline.activation_checkpoint_interval (every other case: 1 for TeraPipe, else
# off).  At 2 and 3 a GPT-2 stage's first segment holds the token lookup with other layers: it must run
# plainly (a reentrant checkpoint of token ids returns no graph); every schedule on GPT-2 meets both.
CHECKPOINT = {("tp2", "terapipe"): 2, ("pp2", "1f1b"): 2, ("pp2", "gpipe"): 3, ("tp2pp2", "1f1b"): 3,
              ("tp2pp2", "gpipe"): 2, ("tp2dp2", "1f1b"): 3, ("pp2dp2", "terapipe"): 3, ("pp2", "zb-h1"): 2,
              ("tp2pp2", "zb-h1"): 3, ("pp2dp2", "zb-h1"): 3, ("pp2", "interleaved"): 2,
              ("tp2pp2", "interleaved"): 3, ("pp2dp2", "interleaved"): 2, ("pp2", "zb-v"): 2,
              ("pp2dp2", "zb-v"): 3}
FACTORS = {"family": ("gpt2", "llama"), "precision": ("fp32", "bf16"), "wrapper": ("none", "zero1"),
           "layout": tuple(LAYOUTS), "schedule": ("1f1b", "gpipe", "terapipe", *PIPELINE_ONLY)}


def checkpoint_interval(case: tuple) -> int:
    """The case's ``pipeline.activation_checkpoint_interval`` (:data:`CHECKPOINT`)."""
    return CHECKPOINT.get(case[:2], int(case[1] == "terapipe"))


def case_values(case: tuple) -> dict[str, str]:
    layout, schedule, (precision, wrapper) = case
    every = checkpoint_interval(case)
    return {"model": MODELS.get((layout, schedule), "gpt2"), "precision": precision, "wrapper": wrapper,
            "layout": layout, "schedule": schedule, "activation checkpoint": f"every {every}" if every else "off"}


def case_name(case: tuple) -> str:
    v = case_values(case)
    return f"{v['model']}_{v['precision']}_{v['wrapper']}_{v['layout']}_{v['schedule']}"


def model_for(case: tuple):
    """The case's HF model (fresh, seeded: the same weights on every rank and in the reference)."""
    name, layers = case_values(case)["model"], 4 if case[1] in ("interleaved", "zb-v") else 2  # 2 × 2 chunks
    return tiny_gpt2() if name == "gpt2" else tiny_llama(name, *FAMILY_MODELS[name], n_layer=layers, inner=128,
                                                         hidden=72, vocab=VOCAB)


def config(case: tuple, one_rank: bool = False) -> dict:
    """The DeepSpeed JSON of ``case`` (``one_rank``: the same but TP = PP = 1, for bf16)."""
    v = case_values(case)
    tp, pp, dp = LAYOUTS[v["layout"]]
    tp, pp, gas = (1, 1, 2 * dp) if one_rank else (tp, pp, 2)  # one rank accumulates every replica's share
    schedule = "1f1b" if one_rank and v["schedule"] in PIPELINE_ONLY else v["schedule"]
    extra: dict = {"pipeline": {"virtual_stages": 2}} if schedule == "interleaved" else {}
    if v["schedule"] == "terapipe":  # sequence parallelism where TP > 1
        extra = {"terapipe": {"slices": [6, 10]}}
        if tp > 1:
            extra["tensor_parallel"] = {"sequence_parallel": True}
    if checkpoint_interval(case):
        extra.setdefault("pipeline", {})["activation_checkpoint_interval"] = checkpoint_interval(case)
    return ds_config(tp=tp, pp=pp, micro=2, gas=gas, lr=LR, clip=CLIP, schedule=schedule, seq=SEQ,
                     bf16=v["precision"] == "bf16", zero=int(v["wrapper"] == "zero1"), **extra)


def steps_for(case: tuple) -> list[list]:
    """STEPS steps of DP × GAS micro-batches (DP replica d takes the d-th GAS of them); the
    same batch every step, so the loss must fall (micro-batches within a step differ)."""
    dp = LAYOUTS[case[0]][2]
    out = []
    for _ in range(STEPS):
        mbs = batches(2 * dp, 2, SEQ, VOCAB, seed=100)
        mbs[0][1][0, :2] = -100  # some ignored labels
        out.append(mbs)
    return out


# --- a guard on the devices of collective arguments ------------------------------------------
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_gather_single", "reduce_scatter_single", "reduce_scatter", "send", "recv", "isend", "irecv",
                "reduce")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "randn", "rand", "arange")


def _from_ds_mp(depth: int) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("ds_mp")


class CollectiveDeviceGuard:
    """Records every tensor that code in ``ds_mp`` hands to a ``torch.distributed`` collective.

    Two checks per tensor: (1) its device equals ``device`` (the engine's); (2) if ds_mp
    code created it with a factory (``torch.zeros(...)``, ``torch.tensor(...)``, …) the call
    named a ``device=`` — a tensor made without one lands on the CPU, which NCCL rejects.
    On a CPU-only machine (1) cannot fail (everything is on the CPU), so (2) is what makes
    the guard honest here: had ``_announce_shape`` in the engine been written
    ``shape = torch.zeros(2, dtype=torch.long)``, the tensor would carry the "no device"
    mark set by the wrapped factory and its ``dist.broadcast`` would raise.  Tensors derived
    from other tensors (``x.clone()``, ``p.grad``) inherit the device and are not marked.
    """

    def __init__(self, device: Callable[[], torch.device]) -> None:
        self.device, self.seen, self.errors = device, 0, []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap_collective(self, fn: Callable, name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _from_ds_mp(2):
                where = sys._getframe(1).f_globals.get("__name__")
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                for t in tensors:
                    self.seen += 1
                    if getattr(t, "_made_without_device", False):
                        self.errors.append(f"{where}: dist.{name} got a tensor made without device=")
                    if t.device != self.device():
                        self.errors.append(f"{where}: dist.{name} got a tensor on {t.device}, "
                                           f"engine device {self.device()}")
            return fn(*args, **kwargs)
        return call

    def _wrap_factory(self, fn: Callable) -> Callable:
        def make(*args: Any, **kwargs: Any) -> Any:
            t = fn(*args, **kwargs)
            if kwargs.get("device") is None and isinstance(t, torch.Tensor) and _from_ds_mp(2):
                t._made_without_device = True
            return t
        return make

    def __enter__(self) -> "CollectiveDeviceGuard":
        import torch.distributed as dist

        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._saved.append((dist, name, getattr(dist, name)))
                setattr(dist, name, self._wrap_collective(getattr(dist, name), name))
        for name in _FACTORIES:
            self._saved.append((torch, name, getattr(torch, name)))
            setattr(torch, name, self._wrap_factory(getattr(torch, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)


def _dropout_digest() -> str:
    """A digest of the next dropout mask drawn from the current default stream."""
    mask = torch.nn.functional.dropout(torch.ones(256), 0.5)
    return hashlib.sha1(mask.numpy().tobytes()).hexdigest()


# --- spawned ranks ----------------------------------------------------------------------------
def _combo_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import ds_mp
    from ds_mp.tensor_parallel.random import parallel_region_rng

    out: dict = {"cases": {}}
    engine = None
    with CollectiveDeviceGuard(lambda: engine.device if engine is not None else torch.device("cpu")) as guard:
        for case in CASES:
            tp, pp, dp = LAYOUTS[case[0]]
            if tp * pp * dp != world:
                continue
            engine, *_ = ds_mp.initialize(model=model_for(case), config=config(case))
            if case[0] == "tp2pp2" and "rng" not in out:  # right after initialize: the seeded streams
                with parallel_region_rng():
                    tp_stream = _dropout_digest()
                out["rng"] = (engine.topology.tp_rank, engine.topology.pp_rank, _dropout_digest(), tp_stream)
            d = (rank // tp) % dp  # rank = pipe·DP·TP + data·TP + model
            losses, norms = [], []
            for step in steps_for(case):
                losses.append(float(engine.train_batch(iter(step[2 * d:2 * d + 2]))))
                norm = engine.get_global_grad_norm()
                norms.append(None if norm is None else float(norm))
            out["cases"][case_name(case)] = (losses, norms)
    out["guard"] = (guard.seen, guard.errors)
    if "rng" in out:
        every: list = [None] * world
        dist.all_gather_object(every, out["rng"])
        out["rng_all"] = every
    return out


def _one_rank_bf16(rank: int) -> dict:
    import ds_mp

    out = {}
    for case in CASES:
        if case[2][0] != "bf16":
            continue
        engine, *_ = ds_mp.initialize(model=model_for(case), config=config(case, one_rank=True))
        losses, norms = [], []
        for step in steps_for(case):  # one rank trains on every replica's micro-batches
            losses.append(float(engine.train_batch(iter(step))))
            norms.append(float(engine.get_global_grad_norm()))
        out[case_name(case)] = (losses, norms)
    return out


# --- tests ------------------------------------------------------------------------------------
def test_cases_cover_every_pair() -> None:
    names = list(FACTORS)
    rows = [{**case_values(c), "family": "gpt2" if case_values(c)["model"] == "gpt2" else "llama"} for c in CASES]
    for f1, f2 in itertools.combinations(names, 2):
        want = set(itertools.product(FACTORS[f1], FACTORS[f2]))
        if (f1, f2) == ("layout", "schedule"):
            want -= {(lay, s) for lay in LAYOUTS for s in PIPELINE_ONLY if LAYOUTS[lay][1] == 1}
        have = {(r[f1], r[f2]) for r in rows}
        assert want <= have, f"{f1} × {f2}: missing {sorted(want - have)}"
    assert len({case_name(c) for c in CASES}) == len(CASES) == 24
    for every in (2, 3):  # the intervals where GPT-2's token lookup shares a checkpoint segment
        met = {r["schedule"] for r in rows if r["model"] == "gpt2" and r["activation checkpoint"] == f"every {every}"}
        assert met == set(FACTORS["schedule"]), f"GPT-2 at activation checkpoint interval {every}: only {met}"


@pytest.fixture(scope="module")
def references() -> dict:
    """HF fp32 losses and pre-clip norms per case, and the one-rank bf16 runs."""
    hf = {case_name(c): hf_train(model_for(c), steps_for(c), LR, CLIP)[:2] for c in CASES}
    return {"hf": hf, "bf16_one_rank": run_ranks(_one_rank_bf16, 1, timeout=300)[0]}


def _check(case: tuple, results: list[dict], refs: dict) -> None:
    name = case_name(case)
    hf_losses, hf_norms = refs["hf"][name]
    assert min(hf_norms) > CLIP, f"{name}: clipping must be active to test it ({hf_norms})"
    for rank, res in enumerate(results):
        losses, norms = res["cases"][name]
        where = f"{name} rank {rank}: losses {losses} norms {norms} vs HF {hf_losses} {hf_norms}"
        assert None not in norms, where
        if case[2][0] == "fp32":
            assert all(abs(a - b) <= FP32_LOSS_TOL * abs(b) for a, b in zip(losses, hf_losses)), where
            assert all(abs(a - b) <= FP32_NORM_TOL * b for a, b in zip(norms, hf_norms)), where
        else:
            one_losses, one_norms = refs["bf16_one_rank"][name]
            assert losses[-1] < losses[0], f"loss does not fall: {where}"
            assert abs(norms[0] - hf_norms[0]) <= BF16_NORM_VS_HF * hf_norms[0], where
            assert all(abs(a - b) <= BF16_VS_ONE_RANK * abs(b) for a, b in zip(losses, one_losses)), \
                f"{where}; one rank {one_losses}"
            assert all(abs(a - b) <= BF16_VS_ONE_RANK * b for a, b in zip(norms, one_norms)), \
                f"{where}; one rank {one_norms}"
    seen, errors = results[0]["guard"]
    assert seen > 0 and all(not r["guard"][1] for r in results), [r["guard"] for r in results]


@pytest.mark.parametrize("world", [2, 4])
def test_combinations_equal_hf(world: int, references: dict) -> None:
    results = run_ranks(_combo_rank, world, world, timeout=400)
    for case in CASES:
        tp, pp, dp = LAYOUTS[case[0]]
        if tp * pp * dp == world:
            _check(case, results, references)
    if world == 4:  # dropout streams right after initialize on TP2 × PP2
        every = results[0]["rng_all"]
        by = {(tp_rank, pp_rank): (default, tp_stream) for tp_rank, pp_rank, default, tp_stream in every}
        for t in range(2):
            assert by[(t, 0)][0] != by[(t, 1)][0], f"default stream repeats across stages: {by}"
        for s in range(2):
            assert by[(0, s)][0] == by[(1, s)][0], f"default stream differs across TP ranks: {by}"
        assert len({v[1] for v in by.values()}) == 4, f"TP streams must all differ: {by}"


# --- the guard itself can fail ----------------------------------------------------------------
def test_collective_device_guard_catches_a_tensor_made_without_device() -> None:
    """Code in a ``ds_mp`` module that hands ``torch.zeros(1)`` to a collective is reported;
    the same with ``device=`` is not.  A fake collective stands in for ``dist.all_reduce``."""
    import torch.distributed as dist

    calls: list = []
    saved = getattr(dist, "all_reduce")
    dist.all_reduce = lambda t, *a, **k: calls.append(t)  # replaced before the guard wraps it
    try:
        src = ("import torch\nimport torch.distributed as dist\n"
               "def bad():\n    dist.all_reduce(torch.zeros(1))\n"
               "def good(dev):\n    dist.all_reduce(torch.zeros(1, device=dev))\n")
        ns: dict = {"__name__": "ds_mp.fake_module"}
        exec(compile(src, "ds_mp/fake_module.py", "exec"), ns)
        with CollectiveDeviceGuard(lambda: torch.device("cpu")) as guard:
            ns["good"](torch.device("cpu"))
            assert guard.errors == [] and guard.seen == 1
            ns["bad"]()
        assert len(guard.errors) == 1 and "made without device=" in guard.errors[0], guard.errors
        with CollectiveDeviceGuard(lambda: torch.device("meta")) as guard:  # a non-CPU engine device
            ns["good"](torch.device("cpu"))
        assert "engine device meta" in guard.errors[0], guard.errors
    finally:
        dist.all_reduce = saved
    assert len(calls) == 3


# --- sequence-parallel collectives against the sums they stand for ---------------------------
def _sp_rank(rank: int) -> dict:
    import torch.distributed as dist

    from ds_mp.tensor_parallel import mappings

    dist.init_process_group("gloo")
    n, group = dist.get_world_size(), dist.group.WORLD
    xs = [torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(r)) for r in range(n)]  # every rank's input
    w = torch.arange(2 * 6 * 5, dtype=torch.float32).reshape(2, 6, 5)  # loss = Σ z ∘ w
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = xs[rank].to(dtype).detach().clone().requires_grad_(True)
        y = mappings.reduce_scatter_to_sequence(a, group, dim=1)  # Σ_r x_r, this rank's chunk of dim 1
        z = mappings.gather_from_sequence(y * 2, group, dim=1)  # every rank's 2y, concatenated on dim 1
        (z.float() * w).sum().backward()
        total = sum(x.to(dtype).float() for x in xs)
        # oracle: z = 2 Σ_r x_r on every rank, so dL/dx_rank = 2 Σ_r w (the all-gather's backward
        # reduce-scatters w from every rank, then the reduce-scatter's backward all-gathers it)
        want = {"y": total.chunk(n, dim=1)[rank], "z": 2 * total, "grad": 2 * n * w}
        got = {"y": y.float(), "z": z.float(), "grad": a.grad.float()}
        errs[str(dtype)] = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    return {"errs": errs, "shape": tuple(y.shape)}


def test_sequence_parallel_collectives_equal_their_sums() -> None:
    """reduce_scatter_to_sequence / gather_from_sequence (one reduce_scatter_single /
    all_gather_single each, the path NCCL also takes) give the sums they stand for, forward
    and backward, with chunks along dim 1 (not dim 0), in fp32 and bf16."""
    for r in run_ranks(_sp_rank, 2, timeout=120):
        assert r["shape"] == (2, 3, 5), r
        assert r["errs"]["torch.float32"] < 1e-6 and r["errs"]["torch.bfloat16"] < 2e-2, r


# --- RNG --------------------------------------------------------------------------------------
def test_seeds_offset_by_pipeline_stage() -> None:
    from ds_mp.tensor_parallel.random import seed_everything

    assert seed_everything(7, 0, 0) == {"default": 7, "tensor_parallel": 7 + 2718}
    assert seed_everything(7, 1, 2) == {"default": 207, "tensor_parallel": 207 + 2719}


def test_rng_state_round_trips_the_accelerator_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU and tracker streams round-trip; the accelerator's generator is saved and restored
    through ``get_rng_state``/``set_rng_state`` when the accelerator is not the CPU (a fake
    one here, holding its own ``torch.Generator``)."""
    from ds_mp.tensor_parallel import random as tp_random

    tp_random.seed_everything(3, 0)
    assert tp_random.rng_state()["accelerator"] is None  # CPU accelerator: nothing extra

    class FakeAccelerator:
        gen = torch.Generator().manual_seed(11)

        def get_rng_state(self) -> torch.Tensor:
            return self.gen.get_state()

        def set_rng_state(self, state: torch.Tensor) -> None:
            self.gen.set_state(state)

    fake = FakeAccelerator()
    monkeypatch.setattr(tp_random, "_accelerator", lambda: fake)
    state = copy.deepcopy(tp_random.rng_state())
    first = (torch.rand(4), torch.rand(4, generator=fake.gen))
    with tp_random.parallel_region_rng():
        first_tp = torch.rand(4)
    tp_random.set_rng_state(state)
    assert torch.equal(torch.rand(4), first[0]) and torch.equal(torch.rand(4, generator=fake.gen), first[1])
    with tp_random.parallel_region_rng():
        assert torch.equal(torch.rand(4), first_tp)


# --- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, match", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage: 3, but ds_mp runs on DeepSpeed's PipelineEngine"),
])
def test_refused_combinations(extra: dict, match: str) -> None:
    """Refused by ``load_config`` (every rank, before any collective) with one line."""
    from ds_mp.config import ConfigError, load_config

    cfg = {**ds_config(tp=2), **extra}
    with pytest.raises(ConfigError, match=match) as e:
        load_config(cfg, 2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("has_fp16", [False, True])
def test_fp16_refused_only_without_accelerator_fp16(has_fp16: bool, monkeypatch) -> None:
    """fp16 is refused by ``load_config`` exactly where DeepSpeed's accelerator reports no fp16
    (its CPU accelerator asks oneDNN: an AMD EPYC says no, an Intel Xeon with AVX512-FP16 yes),
    whatever this machine's CPU: the accelerator's answer is fixed by the test."""
    from deepspeed.accelerator import get_accelerator

    from ds_mp.config import ConfigError, load_config

    acc = get_accelerator()
    monkeypatch.setattr(type(acc), "is_fp16_supported", lambda self: has_fp16)
    cfg = {**ds_config(tp=2), "fp16": {"enabled": True}}
    if has_fp16:
        load_config(cfg, 2)
        return
    with pytest.raises(ConfigError, match=f"fp16.enabled: DeepSpeed's '{acc.device_name()}' accelerator has no fp16"):
        load_config(cfg, 2)
