"""The TP × PP × DP grid: pure coordinates, and DeepSpeed's process groups on 4 ranks."""
from __future__ import annotations

import pytest

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
        assert t.rank_of(tp=t.tp_rank, pp=t.pp_rank, dp=t.dp_rank) == t.rank
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


def test_bad_degrees_and_missing_grid() -> None:
    with pytest.raises(ValueError, match="degrees must be >= 1"):
        Topology(tp=0, pp=1, dp=1, rank=0)
    with pytest.raises(ValueError, match="outside world of 4"):
        Topology(tp=2, pp=2, dp=1, rank=4)
    with pytest.raises(RuntimeError, match="call attach"):
        Topology(tp=1, pp=1, dp=1, rank=0).tp_group


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


def _grid_rank(rank: int) -> list[str]:
    """For every factorisation: DeepSpeed's grid agrees with our coordinates and lists."""
    from ds_mp.engine.initialize import init_distributed

    init_distributed()
    problems = []
    for tp, pp, dp in FACTORISATIONS:
        t = build_grid(Topology(tp=tp, pp=pp, dp=dp, rank=rank))
        g, name = t.grid, f"{tp}x{pp}x{dp}"
        got = (g.get_slice_parallel_rank(), g.get_stage_id(), g.get_data_parallel_rank())
        if got != (t.tp_rank, t.pp_rank, t.dp_rank):
            problems.append(f"{name}: grid coords {got} != ours {(t.tp_rank, t.pp_rank, t.dp_rank)}")
        for label, group, want in (("tp", t.tp_group, t.tp_ranks()), ("pp", t.pp_group, t.pp_ranks()),
                                   ("dp", t.dp_group, t.dp_ranks())):
            members = _gather(group, rank)
            if members != want:
                problems.append(f"{name} {label}: group members {members} != {want}")
        model = sorted(_gather(t.model_group, rank))
        want = sorted(t.rank_of(tp=a, pp=b, dp=t.dp_rank) for a in range(tp) for b in range(pp))
        if model != want:
            problems.append(f"{name} model group {model} != {want}")
    return problems


def test_deepspeed_grid_groups_on_4_ranks() -> None:
    for rank, problems in enumerate(run_ranks(_grid_rank, 4, timeout=120)):
        assert not problems, f"rank {rank}: {problems}"
