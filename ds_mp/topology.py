"""The TP × PP × DP process grid, built on DeepSpeed's ``PipeModelDataParallelTopology``.

Rank layout (DeepSpeed's axis order ``pipe, data, model``; ``model`` = TP is fastest):

    rank = pipe * (DP * TP) + data * TP + model

so TP ranks are neighbours (cheapest links) and a pipeline stage is a contiguous block.
A :class:`Topology` is created from the degrees alone (pure, no communication) so layers
can be sharded at construction; the process groups come from DeepSpeed's
``PipelineParallelGrid`` once it exists (``attach``).  The object is passed explicitly to
every layer that communicates: there are no module-global groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass
class Topology:
    tp: int
    pp: int
    dp: int
    rank: int
    topo: PipeModelDataParallelTopology = field(init=False, repr=False)
    grid: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"degrees must be >= 1: tp={self.tp} pp={self.pp} dp={self.dp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        self.topo = PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    # --- coordinates (pure) -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.topo.get_coord(self.rank).model

    @property
    def pp_rank(self) -> int:
        return self.topo.get_coord(self.rank).pipe

    @property
    def dp_rank(self) -> int:
        return self.topo.get_coord(self.rank).data

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        return self.topo.get_rank(pipe=pp, data=dp, model=tp)

    def tp_ranks(self) -> list[int]:
        return [self.rank_of(tp=t, pp=self.pp_rank, dp=self.dp_rank) for t in range(self.tp)]

    def pp_ranks(self) -> list[int]:
        return [self.rank_of(tp=self.tp_rank, pp=p, dp=self.dp_rank) for p in range(self.pp)]

    def dp_ranks(self) -> list[int]:
        return [self.rank_of(tp=self.tp_rank, pp=self.pp_rank, dp=d) for d in range(self.dp)]

    # --- process groups (after attach) --------------------------------------------------
    def attach(self, grid: Any) -> "Topology":
        """Take the process groups from DeepSpeed's ``PipelineParallelGrid``."""
        if grid.get_slice_parallel_world_size() != self.tp or grid.get_pipe_parallel_world_size() != self.pp:
            raise ValueError("grid degrees differ from the topology's")
        self.grid = grid
        return self

    def _need_grid(self) -> Any:
        if self.grid is None:
            raise RuntimeError("Topology has no process groups yet; call attach(grid) first")
        return self.grid

    @property
    def tp_group(self) -> Any:
        return self._need_grid().get_slice_parallel_group()

    @property
    def pp_group(self) -> Any:
        return self._need_grid().get_pipe_parallel_group()

    @property
    def dp_group(self) -> Any:
        return self._need_grid().get_data_parallel_group()

    @property
    def model_group(self) -> Any:
        """TP × PP ranks of one data-parallel replica (DeepSpeed's "model parallel" group)."""
        return self._need_grid().get_model_parallel_group()

    def describe(self) -> str:
        return (f"rank {self.rank}: tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} "
                f"dp {self.dp_rank}/{self.dp}")


def build_grid(topology: Topology) -> Topology:
    """Create DeepSpeed's process groups for ``topology`` (a collective) and attach them.

    Used where no ``PipelineModule`` creates the grid (unit tests, checkpoint tools).
    """
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    return topology.attach(PipelineParallelGrid(topology=topology.topo))
