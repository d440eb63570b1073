"""The named-axis grid dp × cp × pp × tp: pure coordinates, DeepSpeed's process groups on 4 ranks, and
DeepSpeed's engine on ds_mp's grid (gradients over dp × cp, batch arithmetic over dp)."""
from __future__ import annotations

import pytest

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ds_mp.topology import Topology, build_grid
from dist_utils import run_ranks

FACTORISATIONS = [(tp, pp, 4 // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4) if 4 % (tp * pp) == 0]


def _is_partition(lists: list[list[int]], world: int) -> bool:
    groups = {tuple(x) for x in lists}
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("tp, pp, dp", FACTORISATIONS)
def test_coordinates_and_groups_partition_the_world(tp: int, pp: int, dp: int) -> None:
    tops = [Topology(tp=tp, pp=pp, dp=dp, rank=r) for r in range(4)]
    for t in tops:
        # rank = pipe·(DP·TP) + data·TP + model: TP neighbours, stages contiguous
        assert t.rank == t.pp_rank * dp * tp + t.dp_rank * tp + t.tp_rank
        assert t.rank_of(tp=t.tp_rank, pp=t.pp_rank, dp=t.dp_rank, cp=0) == t.rank
        assert t.tp_ranks()[t.tp_rank] == t.rank and t.pp_ranks()[t.pp_rank] == t.rank
        assert t.dp_ranks()[t.dp_rank] == t.rank
        assert (len(t.tp_ranks()), len(t.pp_ranks()), len(t.dp_ranks())) == (tp, pp, dp)
    for axis in ("tp_ranks", "pp_ranks", "dp_ranks"):
        lists = [getattr(t, axis)() for t in tops]
        assert _is_partition(lists, 4), f"{axis} for {tp}x{pp}x{dp}: {lists}"
        for t, mine in zip(tops, lists):  # every member of my group sees the same group
            assert all(getattr(tops[r], axis)() == mine for r in mine)
    coords = {(t.tp_rank, t.pp_rank, t.dp_rank) for t in tops}
    assert len(coords) == 4
    old = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)  # the layout before the cp axis
    for t in tops:  # cp = 1: rank for rank the former layout, and the grad group is the rows group
        assert old.get_rank(pipe=t.pp_rank, data=t.dp_rank, model=t.tp_rank) == t.rank
        assert (t.cp_rank, t.cp_ranks(), t.grad_size, t.grad_ranks()) == (0, [t.rank], dp, t.dp_ranks())


def _all(tp: int, pp: int, dp: int, cp: int) -> list[Topology]:
    return [Topology(tp=tp, pp=pp, dp=dp, cp=cp, rank=r) for r in range(tp * pp * dp * cp)]


@pytest.mark.parametrize("tp, pp, dp, cp", [(2, 2, 2, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 1, 3, 2), (1, 3, 1, 4)])
def test_context_axis_layout_and_groups_by_name(tp: int, pp: int, dp: int, cp: int) -> None:
    tops, world = _all(tp, pp, dp, cp), tp * pp * dp * cp
    for t in tops:
        assert t.rank == ((t.pp_rank * dp + t.dp_rank) * cp + t.cp_rank) * tp + t.tp_rank
        assert t.rank_of(tp=t.tp_rank, pp=t.pp_rank, dp=t.dp_rank, cp=t.cp_rank) == t.rank
        base = t.rank - t.tp_rank  # TP ranks are neighbours
        assert t.tp_ranks() == list(range(base, base + tp))
        block = dp * cp * tp  # a stage is one contiguous block
        assert t.pp_rank == t.rank // block and t.pp_ranks() == [p * block + t.rank % block for p in range(pp)]
        assert t.cp_ranks() == [t.rank - t.cp_rank * tp + c * tp for c in range(cp)]  # next to TP
        assert t.dp_ranks() == [t.peer(dp=d) for d in range(dp)]
        # by name: rows = dp alone; grad group = dp × cp (same tp, pp); model = TP × PP of one (dp, cp)
        assert t.grad_size == dp * cp and len(t.grad_ranks()) == dp * cp
        assert t.grad_ranks() == sorted(t.rank_of(tp=t.tp_rank, pp=t.pp_rank, dp=d, cp=c)
                                        for d in range(dp) for c in range(cp))
        assert set(t.dp_ranks()) | set(t.cp_ranks()) <= set(t.grad_ranks())
        assert t.grad_ranks()[t.grad_rank] == t.rank
        assert t.model_ranks() == sorted(t.peer(tp=a, pp=b) for a in range(tp) for b in range(pp))
        peers = [tops[r] for r in t.cp_ranks()]  # CP peers read the same rows
        assert {(p.dp_rank, p.tp_rank, p.pp_rank) for p in peers} == {(t.dp_rank, t.tp_rank, t.pp_rank)}
    for axis in ("tp_ranks", "pp_ranks", "dp_ranks", "cp_ranks", "grad_ranks", "model_ranks"):
        lists = [getattr(t, axis)() for t in tops]
        assert _is_partition(lists, world), f"{axis}: {lists}"
        assert all(getattr(tops[r], axis)() == mine for mine in lists for r in mine)
    assert len({(t.tp_rank, t.pp_rank, t.dp_rank, t.cp_rank) for t in tops}) == world
    assert sum(t.grad_rank == 0 for t in tops) == tp * pp  # one writer per parameter shard


def test_bad_degrees_and_missing_grid() -> None:
    with pytest.raises(ValueError, match="degrees must be >= 1"):
        Topology(tp=0, pp=1, dp=1, rank=0)
    with pytest.raises(ValueError, match="outside world of 4"):
        Topology(tp=2, pp=2, dp=1, rank=4)
    with pytest.raises(RuntimeError, match="call attach"):
        Topology(tp=1, pp=1, dp=1, rank=0).tp_group
    with pytest.raises(ValueError, match="degrees must be >= 1"):
        Topology(tp=1, pp=1, dp=1, cp=0, rank=0)
    with pytest.raises(ValueError, match="unknown axes"):
        Topology(tp=1, pp=1, dp=1, rank=0).peer(ep=0)
    from ds_mp.deepspeed_compat import DeepSpeedIncompatible
    from ds_mp.deepspeed_compat.grid import check_grid

    with pytest.raises(DeepSpeedIncompatible, match="_topo"):  # a DeepSpeed grid without what the adapter reads
        check_grid(object())


def _gather(group, rank: int) -> list[int]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(out, torch.tensor([rank]), group=group)
    total = torch.tensor([rank])
    dist.all_reduce(total, group=group)
    assert int(total) == sum(int(x) for x in out)
    return [int(x) for x in out]


#: (tp, pp, dp, cp) at world 4: every cp = 1 factorisation, and cp = 2 with DP or with PP.
GRIDS = [(tp, pp, dp, 1) for tp, pp, dp in FACTORISATIONS] + [(1, 1, 2, 2), (1, 2, 1, 2)]


def _group_problems(t: Topology, rank: int) -> list[str]:
    """Each named group's members (gathered over it) against the pure lists; the grid's mpu answers."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import groups

    g, name, problems = t.grid, f"tp{t.tp} pp{t.pp} dp{t.dp} cp{t.cp}", []
    got = (g.get_slice_parallel_rank(), g.get_stage_id(), g.data_parallel_id, g.get_context_parallel_rank())
    if got != (t.tp_rank, t.pp_rank, t.dp_rank, t.cp_rank):
        problems.append(f"{name}: grid coords {got} != ours")
    named = [("tp", t.tp_group, t.tp_ranks()), ("pp", t.pp_group, t.pp_ranks()), ("dp", t.dp_group, t.dp_ranks()),
             ("grad", t.grad_group, t.grad_ranks()), ("model", t.model_group, t.model_ranks())]
    if t.cp > 1:
        named.append(("cp", t.cp_group, t.cp_ranks()))
    else:  # no group stands in for a missing axis (a None group would be the whole world)
        with pytest.raises(RuntimeError, match="no context-parallel group at cp=1"):
            t.cp_group
    # DeepSpeed's engine-facing answers: reduction and ZeRO over dp × cp, data and batch sizes over dp
    groups.mpu = g  # what DeepSpeedEngine does with the mpu it is given
    try:
        named += [("mpu data-parallel group (gradient all-reduce)", g.get_data_parallel_group(), t.grad_ranks()),
                  ("groups sequence-data-parallel (ZeRO partitions)", groups._get_sequence_data_parallel_group(),
                   t.grad_ranks()),
                  ("mpu model-parallel group (norms)", g.get_model_parallel_group(), t.model_ranks())]
        sizes = (g.get_data_parallel_world_size(), g.data_parallel_size, groups._get_data_parallel_world_size(),
                 DeepSpeedConfig({"train_batch_size": 2 * t.dp, "train_micro_batch_size_per_gpu": 2}, g).world_size)
    finally:
        groups.mpu = None
    if sizes != (t.dp,) * 4 or g.get_data_parallel_rank() != t.dp_rank:
        problems.append(f"{name}: rows answered {sizes}, rank {g.get_data_parallel_rank()}; want dp={t.dp}")
    for label, group, want in named:
        members = _gather(group, rank)
        if members != want:
            problems.append(f"{name} {label}: members {members} != {want}")
    return problems


def _engine_problems(t: Topology, rank: int) -> list[str]:
    """DeepSpeed's own PipelineEngine (ZeRO-1, SGD, its default clipping at 1) on ds_mp's grid, each rank
    of the grad group fed its own rows: one step must leave every rank with w - lr · clip(mean over
    dp × cp of the gradients) (a reduction over the rows group alone would leave CP peers apart; a norm
    summed over CP peers would clip harder), with batch sizes over dp."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec

    from ds_mp.deepspeed_compat.pipeline_module import PipelineModuleAdapter

    torch.manual_seed(100 + rank)  # every rank builds other weights: the engine's broadcast must agree them
    layers = [LayerSpec(torch.nn.Linear, 3, 4), LayerSpec(torch.nn.Linear, 4, 2)]
    net = PipelineModuleAdapter(layers, [0, 1, 2] if t.pp == 2 else [0, 2], t.topo, torch.nn.MSELoss())
    t.attach(net.mpu())
    cfg = {"train_batch_size": 2 * t.dp, "train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    name, problems = f"engine tp{t.tp} pp{t.pp} dp{t.dp} cp{t.cp}", []
    got = (engine.dp_world_size, engine.grid.data_parallel_id, engine.train_batch_size(),
           dist.get_world_size(engine.optimizer.dp_process_group), _gather(engine.seq_data_parallel_group, rank))
    if got != (t.dp, t.dp_rank, 2 * t.dp, t.grad_size, t.grad_ranks()):
        problems.append(f"{name}: (dp_world_size, data_parallel_id, batch, ZeRO group, its ranks) = {got}")
    start = {k: v.detach().clone() for k, v in net.state_dict().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, start)
    full = {k: v for d in every for k, v in d.items()}  # the whole model (layer index.name)
    data = [(torch.randn(2, 3, generator=torch.Generator().manual_seed(g)),
             torch.randn(2, 2, generator=torch.Generator().manual_seed(50 + g))) for g in range(t.grad_size)]
    engine.train_batch(iter([data[t.grad_rank]]))
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ref.load_state_dict(full)
    sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in data).div(t.grad_size).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default clipping: the norm over TP × PP
    want = {k: v.detach() - 0.5 * ref.get_parameter(k).grad for k, v in ref.state_dict().items()}
    for k, v in net.state_dict().items():
        if not torch.allclose(v, want[k], atol=1e-6):
            problems.append(f"{name}: {k} after the step differs by {(v - want[k]).abs().max():.2e}")
        if [d[k] for d in every if k in d][0].ne(start[k]).any():
            problems.append(f"{name}: {k} not broadcast over the grad group before the step")
    return problems


def _grid_rank(rank: int) -> list[str]:
    """Every layout of :data:`GRIDS`: the grid's groups by name; DeepSpeed's engine at the cp = 2 ones."""
    from ds_mp.engine.initialize import init_distributed

    init_distributed()
    problems = []
    for tp, pp, dp, cp in GRIDS:
        problems += _group_problems(build_grid(Topology(tp=tp, pp=pp, dp=dp, cp=cp, rank=rank)), rank)
    for tp, pp, dp, cp in GRIDS:
        if cp > 1:
            problems += _engine_problems(Topology(tp=tp, pp=pp, dp=dp, cp=cp, rank=rank), rank)
    return problems


def test_deepspeed_grid_groups_and_engine_on_4_ranks() -> None:
    for rank, problems in enumerate(run_ranks(_grid_rank, 4, timeout=180)):
        assert not problems, f"rank {rank}: {problems}"
