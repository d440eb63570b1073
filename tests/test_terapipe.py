"""TeraPipe: token-sliced pipelining equals unsliced HF training.

* single process: the KV context (sliced forward+backward of Blocks = unsliced), the mask,
  the planner glue (explicit/auto plans, ``plan_from_config``);
* pure-Python unroll of the schedule: every unit forwarded/backwarded once per stage, slices
  backwarded in reverse, every send received by the neighbour at the same step, and the
  forward/backward order equals the simulator's ``terapipe_timetable``;
* multi-rank (gloo, CPU): loss and every weight after SGD steps equal HF's for uneven slices
  [5, 3, 7, 1] of 16 tokens at PP=2×DP=2, PP=3, TP=2×PP=2 with 2 batch-slices, and
  ``"slices": "auto"`` (profiled at start-up) at PP=2×DP=2.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from dist_utils import run_ranks
from ds_mp.schedules.terapipe.schedule import BackwardSlice, ForwardSlice, LoadSlice
from ds_mp.schedules.simulate import simulate, terapipe_timetable
from ds_mp.schedules.terapipe.cost_model import CostModel, batch_cost, load_cost_model
from ds_mp.schedules.terapipe.planner import plan_joint
from ds_mp.engine.terapipe_kv import KVContext, context_mask
from ds_mp.schedules.terapipe.schedule import TeraPipeSchedule, plan_units
from ds_mp.schedules.terapipe.planner import explicit_plan
from helpers import batches, ds_config, tiny_gpt2, train_one_process

SEQ, VOCAB, TOL = 16, 203, 1e-5
SLICES = [5, 3, 7, 1]


# ------------------------------------------------------------------ single process

def _blocks(n: int = 3, n_embd: int = 48, n_head: int = 4) -> torch.nn.ModuleList:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from ds_mp.models.ctx import Ctx
    from ds_mp.models.gpt2 import Block
    from ds_mp.models.weights import WeightSource
    from ds_mp.topology import Topology

    hf = tiny_gpt2(n_layer=n, n_embd=n_embd, n_head=n_head).config
    torch.manual_seed(0)
    sds = [GPT2Block(hf, layer_idx=i).state_dict() for i in range(n)]
    src = WeightSource(lambda name: sds[int(name.split(".")[2])][name.split(".", 3)[3]], hf)
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), hf, sequence_parallel=False, vocab_pad_multiple=1)
    return torch.nn.ModuleList(Block(src, i, ctx) for i in range(n))


def test_context_mask() -> None:
    assert context_mask(3, 0, "cpu") is None
    m = context_mask(2, 3, "cpu")
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_kv_context_equals_unsliced() -> None:
    """Two sequences interleaved slice by slice through 3 Blocks; backward in reverse order."""
    ref, blocks = _blocks(), _blocks()
    x, g = torch.randn(2, 2, SEQ, 48), torch.randn(2, 2, SEQ, 48)
    for seq in range(2):
        h = x[seq].clone().requires_grad_(True)
        out = h
        for blk in ref:
            out = blk(out)
        out.backward(g[seq])
    context = KVContext()
    for blk in blocks:
        blk.kv_extension = context
    bounds = [(sum(SLICES[:i]), sum(SLICES[:i + 1])) for i in range(len(SLICES))]
    ins, outs = {}, {}
    for i, (a, b) in enumerate(bounds):
        for seq in range(2):
            context.key = seq
            ins[seq, i] = h = x[seq, :, a:b].clone().requires_grad_(True)
            for blk in blocks:
                h = blk(h)
            outs[seq, i] = h
    assert len(context) == 2
    for i in reversed(range(len(SLICES))):
        for seq in range(2):
            a, b = bounds[i]
            outs[seq, i].backward(g[seq, :, a:b])  # no retain_graph: each graph once
        if i == 0:
            context.release(0)
            context.release(1)
    assert len(context) == 0
    for (n, p), q in zip(blocks.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=0, msg=n)


def test_explicit_plan_and_errors() -> None:
    from ds_mp.config import ConfigError

    assert explicit_plan(SLICES, 3, 2) == [(2, SLICES), (1, SLICES)]
    with pytest.raises(ConfigError, match="batch_slices"):
        explicit_plan(SLICES, 2, 3)
    units = plan_units([(2, [3, 1]), (1, [3, 1])], micro_batches=2)
    assert [(u.micro, u.batch_slice, u.slice, u.rows, u.tokens) for u in units[:4]] == [
        (0, 0, 0, (0, 2), (0, 3)), (0, 0, 1, (0, 2), (3, 4)), (0, 1, 0, (2, 3), (0, 3)), (0, 1, 1, (2, 3), (3, 4))]


def test_plan_from_config(tmp_path, capsys) -> None:
    from ds_mp.config import ConfigError
    from ds_mp.schedules.terapipe.planner import plan_for
    from ds_mp.tools.plan import plan_from_config

    cost = CostModel(c0=1e-3, c1=1e-4, c2=1e-6, a3=2e-6)
    cost.save(tmp_path / "cost.json")
    cfg = ds_config(pp=4, micro=4, seq=64, schedule="terapipe",
                    terapipe={"profile": str(tmp_path / "cost.json"), "granularity": 4, "batch_slices": 2})
    out = plan_from_config(cfg, profile=False)  # a step of gradient_accumulation_steps = 2 micro-batches
    assert out["micro_batches"] == 2
    assert out["plan"] == [[b, s] for b, s in plan_joint(4, 64, 4, batch_cost(cost, 4, cost.c0),
                                                          granularity=4, batch_sizes=[2], micro_batches=2)]
    assert out["speedup_vs_no_slicing"] > 1.0 and out["speedup_vs_uniform"] >= 1.0
    cfg["ds_mp"]["terapipe"].update(batch_slices="auto", slices="auto")  # the knapsack over batch splits
    auto = plan_from_config(cfg, profile=False)
    assert auto["predicted_time"] <= min(out["predicted_time"], auto["best_equal_split_time"]) * (1 + 1e-12)
    assert "terapipe plan" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="divide"):
        plan_for(cost, 4, 64, 4, 3, 4)
    missing = ds_config(pp=2, schedule="terapipe", training={"output_dir": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="--profile"):
        plan_from_config(missing, profile=False)
    out = plan_from_config(missing, profile=True)  # times blocks here, then plans
    saved = json.loads((tmp_path / "none" / "terapipe_profile.json").read_text())
    assert saved["kind"] == "batch_table" and sum(out["plan"][0][1]) == SEQ
    assert saved["meta"]["batch_sizes"] == [int(b) for b in saved["models"]]  # every size the plan may use
    assert saved["meta"]["compute_profile_s"] > 0  # how long profiling took is kept with the profile


@pytest.mark.parametrize("source", ["inline", "directory"])
def test_plan_profiles_the_models_own_family_blocks(source, tmp_path, monkeypatch) -> None:
    """``ds-mp plan --profile`` times the blocks of the model's family (a Qwen2 stage: its GQA
    attention and SwiGLU, not GPT-2 blocks of the same width), ⌈layers / stages⌉ of them, from
    an inline shape or a checkpoint directory."""
    from ds_mp.config import load_config
    from ds_mp.models.llama import layers as llama_layers
    from ds_mp.engine import terapipe_profile as profile
    from test_llama import tiny_llama

    if source == "inline":
        model = {"model_type": "qwen2", "n_layer": 3, "n_embd": 72, "n_head": 6, "n_kv_head": 2,
                 "intermediate_size": 128, "vocab_size": 203}
    else:
        model = str(tmp_path / "qwen2")
        tiny_llama("qwen2", n_layer=3, hidden=72, inner=128).save_pretrained(model)
    cfg, _ = load_config(ds_config(pp=2, schedule="terapipe", seq=16, model=model, terapipe={"granularity": 8}), 2)
    timed = []
    real_timer = profile._slice_timer

    def spy(stage, blocks, make_input, batch, head_dim, *rest):
        timed.append((blocks, head_dim, make_input(4, 0).shape))
        return real_timer(stage, blocks, make_input, batch, head_dim, *rest)

    monkeypatch.setattr(profile, "_slice_timer", spy)
    rows = profile.profile_blocks(cfg, 2)
    (blocks, head_dim, shape), = timed
    assert [type(b) for b in blocks] == [llama_layers.Block] * 2 and head_dim == 12 and tuple(shape) == (2, 4, 72)
    assert blocks[0].self_attn.n_kv_local == 2 and all(t > 0 for *_, t in rows)


def test_saved_profile_reused_only_for_its_setup(tmp_path, capsys) -> None:
    """A cached profile is reused when what it was measured for (shape, micro-batch, layout,
    device, ...) matches; else it is measured again — unless the user named the file."""
    from ds_mp.schedules.terapipe.cost_model import TableCostModel
    from ds_mp.engine.terapipe_profile import _cached

    meta = {"n_embd": 48, "micro_batch": 2, "tp": 1, "pp": 2, "device": "cpu"}
    path = str(tmp_path / "p.json")
    assert not _cached(path, meta, explicit=False)
    TableCostModel((4, 8), (1.0, 2.0)).save(path, {**meta, "compute_profile_s": 1.0})
    assert _cached(path, meta, explicit=False)
    other = {**meta, "micro_batch": 4}
    assert not _cached(path, other, explicit=False)
    assert _cached(path, other, explicit=True) and "using it as given" in capsys.readouterr().out


@pytest.mark.parametrize("block, key", [
    ({"tensor_parallel": {"size": 2, "sequence_parallel": True}, "terapipe": {"slices": [5, 11]}}, "terapipe.slices"),
    ({"tensor_parallel": {"size": 2, "sequence_parallel": True}, "terapipe": {"granularity": 3}},
     "terapipe.granularity")])
def test_unsupported_options_fail_with_one_line(block: dict, key: str) -> None:
    """Sequence parallelism splits every slice over the TP ranks: uneven slices are refused."""
    from ds_mp.config import ConfigError, parse_config, validate

    raw = {**block, "pipeline": {**block.get("pipeline", {}), "schedule": "terapipe"}, "data": {"seq_len": SEQ}}
    with pytest.raises(ConfigError, match=key) as err:  # refused by the config check, before any collective
        validate(parse_config(raw), 2)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ schedule unroll

def _unroll(K: int, M: int, plan: list) -> None:
    """Play all stages step by step; check pairing, buffers and per-stage order."""
    scheds = [TeraPipeSchedule(M, K, s, plan) for s in range(K)]
    streams = [list(s.steps()) for s in scheds]
    assert len({len(st) for st in streams}) == 1
    U = len(scheds[0].units)
    fwd: list[list[int]] = [[] for _ in range(K)]
    bwd: list[list[int]] = [[] for _ in range(K)]
    for t in range(len(streams[0])):
        sends = {(s, type(c), c.buffer_id) for s in range(K) for c in streams[s][t]
                 if isinstance(c, (ds.SendActivation, ds.SendGrad))}
        recvs = {(s, type(c), c.buffer_id) for s in range(K) for c in streams[s][t]
                 if isinstance(c, (ds.RecvActivation, ds.RecvGrad))}
        assert {(s + 1, ds.RecvActivation, b) for s, T, b in sends if T is ds.SendActivation} \
            | {(s - 1, ds.RecvGrad, b) for s, T, b in sends if T is ds.SendGrad} == recvs, f"step {t}"
        for s in range(K):
            for c in streams[s][t]:
                if isinstance(c, (LoadSlice, ds.RecvActivation)):
                    assert c.buffer_id not in fwd[s], f"stage {s} reloads buffer {c.buffer_id}"
                if isinstance(c, LoadSlice):
                    assert s in (0, K - 1)
                if isinstance(c, ForwardSlice):
                    fwd[s].append(c.buffer_id)
                if isinstance(c, (BackwardSlice, ds.SendGrad, ds.RecvGrad)):
                    assert c.buffer_id in fwd[s], f"stage {s}: {c} before its forward"
                if isinstance(c, BackwardSlice):
                    bwd[s].append(c.buffer_id)
                assert c.kwargs.get("buffer_id", 0) < scheds[s].num_pipe_buffers()
    for s in range(K):
        assert fwd[s] == list(range(U)) and bwd[s] == list(reversed(range(U))), f"stage {s}"
        assert [type(c) for c in streams[s][-1][-3:]] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("M, plan", [(1, [(2, SLICES)]), (2, [(1, [3, 1]), (1, [2, 2])]), (3, [(1, [4])])])
def test_schedule_unroll(K: int, M: int, plan: list) -> None:
    _unroll(K, M, plan)


@pytest.mark.parametrize("K, M", [(2, 1), (3, 2)])
def test_schedule_is_the_simulators_timetable(K: int, M: int) -> None:
    table = [TeraPipeSchedule(M, K, s, [(2, SLICES)]).ops() for s in range(K)]
    assert table == terapipe_timetable(K, len(SLICES), M)
    assert simulate(table, lambda s, op: 1.0).iteration_time == 2 * (M * len(SLICES) + K - 1)


# ------------------------------------------------------------------ multi-rank vs HF

def _hf_steps(steps: list[list], lr: float) -> tuple[list[float], dict]:
    model = copy.deepcopy(tiny_gpt2(n_positions=32, vocab=VOCAB)).train()
    losses, _ = train_one_process(model, steps, torch.optim.SGD(model.parameters(), lr=lr))  # per-token loss
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _data(steps: int, per_step: int, micro: int) -> list[list]:
    out = []
    for s in range(steps):
        mbs = batches(per_step, micro, SEQ, VOCAB, seed=10 + s)
        mbs[0][1][0, 4:9] = -100  # ignored targets across the slice boundary at 5
        out.append(mbs)
    return out


def _case(tp: int, pp: int, micro: int, gas: int, terapipe: dict, out_dir: str = "", extra: dict | None = None) -> dict:
    """Two SGD steps (lr 0.5) through ds_mp.initialize; this rank's shards vs HF's."""
    import ds_mp
    from ds_mp.models.gpt2 import tp_kind
    from ds_mp.models.pipeline import hf_param_name
    from ds_mp.tensor_parallel import shard

    dp = int(os.environ["WORLD_SIZE"]) // (tp * pp)
    cfg = ds_config(tp=tp, pp=pp, micro=micro, gas=gas, lr=0.5, seq=SEQ, schedule="terapipe",
                    terapipe=terapipe, training={"output_dir": out_dir or "runs/unused"}, **(extra or {}))
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(n_positions=32, vocab=VOCAB), config=cfg)
    steps = _data(2, gas * dp, micro)
    d = engine.topology.dp_rank
    losses = [float(engine.train_batch(iter(mbs[d * gas:(d + 1) * gas]))) for mbs in steps]
    hf_losses, hf_w = _hf_steps(steps, lr=0.5)
    pipe, ctx, topo = engine.module, engine.module.ds_mp_ctx, engine.topology
    names, diff = [], 0.0
    for name, p in pipe.named_parameters():
        hf = hf_param_name(name, pipe)
        want = shard(hf_w[hf], tp_kind(hf), topo.tp_rank, topo.tp, n_head=ctx.n_head, padded_vocab=ctx.padded_vocab)
        diff = max(diff, float((p.detach() - want).abs().max()))
        names.append(hf)
    return {"loss": max(abs(a - b) for a, b in zip(losses, hf_losses)), "weights": diff, "names": names,
            "all_names": sorted(hf_w), "plan": engine.schedule_support.plan, "cache_left": len(engine.schedule_support.context)}


def _ranks(rank: int, cases: list[dict]) -> list[dict]:
    return [_case(**c) for c in cases]


def _check(results: list[list[dict]], cases: list[dict]) -> None:
    for c, case in enumerate(cases):
        per_rank = [r[c] for r in results]
        for rank, r in enumerate(per_rank):
            where = f"{case} rank {rank}"
            assert r["loss"] <= TOL and r["weights"] <= TOL, f"{where}: loss {r['loss']} weights {r['weights']}"
            assert r["cache_left"] == 0, where
        assert set().union(*(r["names"] for r in per_rank)) == set(per_rank[0]["all_names"]), case
        assert all(r["plan"] == per_rank[0]["plan"] for r in per_rank), case


def test_terapipe_equals_hf_on_4_ranks(tmp_path) -> None:
    """PP=2×DP=2 with explicit slices; TP=2×PP=2 with 2 uneven batch-slices (rows 2 + 1);
    PP=2×DP=2 with "auto": profiled at start-up (no profile yet), fitted and saved, planned on
    rank 0 and agreed by every rank; PP=2×DP=2 with activation checkpointing; TP=2×PP=2 with
    sequence parallelism and activation checkpointing."""
    auto = {"slices": "auto", "granularity": 4, "batch_slices": 2}
    cases = [dict(tp=1, pp=2, micro=2, gas=2, terapipe={"slices": SLICES}),
             dict(tp=2, pp=2, micro=3, gas=1, terapipe={"slices": SLICES, "batch_slices": 2}),
             dict(tp=1, pp=2, micro=2, gas=1, terapipe=auto, out_dir=str(tmp_path)),
             # activation checkpointing: each block's forward is recomputed in backward and must
             # attend to the same cached keys/values (and reuse its own entry) as the first time
             dict(tp=1, pp=2, micro=2, gas=2, terapipe={"slices": SLICES},
                  extra={"pipeline": {"activation_checkpoint_interval": 1}}),
             # sequence parallelism inside each slice (slices even), with activation checkpointing
             dict(tp=2, pp=2, micro=2, gas=1, terapipe={"slices": [6, 2, 8]},
                  extra={"tensor_parallel": {"sequence_parallel": True},
                         "pipeline": {"activation_checkpoint_interval": 1}})]
    results = run_ranks(_ranks, 4, cases, timeout=300)
    _check(results, cases)
    plan = results[0][2]["plan"]
    assert [b for b, _ in plan] == [1, 1] and all(sum(s) == SEQ and all(n % 4 == 0 for n in s) for _, s in plan)
    cost = load_cost_model(os.path.join(tmp_path, "terapipe_profile.json"))
    assert cost.sizes == [1, 2]  # batch_slices 2 of a 2-row micro-batch: profiled at 1 row and at 2
    assert plan == [(b, list(s)) for b, s in plan_joint(2, SEQ, 2, cost, granularity=4, batch_sizes=[1])]


def test_terapipe_equals_hf_pp3_batch_slices() -> None:
    cases = [dict(tp=1, pp=3, micro=3, gas=2, terapipe={"slices": SLICES, "batch_slices": 2})]
    _check(run_ranks(_ranks, 3, cases, timeout=240), cases)
