"""The named-axis process grid dp × cp × pp × tp, built on DeepSpeed's ``ProcessTopology``.

Rank layout (DeepSpeed's axes ``pipe, data, context, model``, slowest first; ``model`` = TP):

    rank = ((pp · DP + dp) · CP + cp) · TP + tp

Ordered by how often an axis talks: TP all-reduces activations in every layer (fastest axis: its
ranks are neighbours, the cheapest links), CP exchanges keys/values (or heads) in every attention
layer, DP reduces gradients once a step, PP sends one activation per micro-batch — so a pipeline
stage is a contiguous block of DP·CP·TP ranks (Megatron-core orders tp, cp, dp, pp for the same
reasons).  With cp = 1 the layout is the former ``pipe, data, model`` one, rank for rank.

"Data parallel" means two things, each with its own name here:

* ``dp``, ``dp_rank``, ``dp_ranks()``, ``dp_group`` — the ranks that read **distinct rows**.  CP
  peers, like TP and PP peers, read the same rows.  Batch arithmetic (``train_batch_size`` =
  micro × accumulation × dp), samplers, the batch ramp and the noise scale's B use these.
* ``grad_size``, ``grad_rank``, ``grad_ranks()``, ``grad_group`` — dp × cp: the ranks that hold
  the same parameters, whose gradients are reduced together, over which ZeRO partitions the
  optimizer state, and of which one writes a checkpoint's copy.

With cp = 1 the two coincide.  ``cp`` > 1 is ``"ds_mp": {"context_parallel": {"size": C}}``: CP
peers hold different tokens of the same rows (``ds_mp.context_parallel``, ``ds_mp.engine.context``).

A :class:`Topology` is created from the degrees alone (pure, no communication) so layers can be
sharded at construction; the process groups come from ds_mp's grid
(``ds_mp.deepspeed_compat.grid.ContextParallelGrid``, the mpu DeepSpeed's engine is given) once it
exists (:meth:`Topology.attach`).  The object is passed explicitly to every layer that
communicates: there are no module-global groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepspeed.runtime.pipe.topology import ProcessTopology

from ds_mp.deepspeed_compat.grid import ContextParallelGrid, process_topology

#: ds_mp's axis name -> DeepSpeed's.
DEEPSPEED_AXIS = {"pp": "pipe", "dp": "data", "cp": "context", "tp": "model"}


@dataclass
class Topology:
    tp: int
    pp: int
    dp: int
    rank: int
    cp: int = 1
    topo: ProcessTopology = field(init=False, repr=False)
    grid: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.cp) < 1:
            raise ValueError(f"degrees must be >= 1: tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        self.topo = process_topology(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp)

    # --- coordinates (pure) -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def grad_size(self) -> int:
        """dp × cp: the ranks whose gradients are reduced together (and ZeRO's partitions)."""
        return self.dp * self.cp

    def _coord(self, axis: str) -> int:
        return getattr(self.topo.get_coord(self.rank), DEEPSPEED_AXIS[axis])

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def dp_rank(self) -> int:
        """Which rows this rank reads (0 … dp-1)."""
        return self._coord("dp")

    @property
    def cp_rank(self) -> int:
        return self._coord("cp")

    @property
    def grad_rank(self) -> int:
        """This rank's place in :meth:`grad_ranks` (0 … dp·cp-1); 0 on one copy of each parameter shard."""
        return self.dp_rank * self.cp + self.cp_rank

    def rank_of(self, *, tp: int, pp: int, dp: int, cp: int) -> int:
        """The global rank at these coordinates (every axis named)."""
        return self.topo.get_rank(**{DEEPSPEED_AXIS[a]: v for a, v in (("tp", tp), ("pp", pp), ("dp", dp),
                                                                        ("cp", cp))})

    def peer(self, **coords: int) -> int:
        """The rank at this rank's coordinates with the given axes changed: ``peer(pp=0)`` is the
        first stage of this rank's (tp, dp, cp)."""
        unknown = set(coords) - set(DEEPSPEED_AXIS)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {sorted(DEEPSPEED_AXIS)}")
        mine = {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank, "cp": self.cp_rank}
        return self.rank_of(**{**mine, **coords})

    def _along(self, *axes: str) -> list[int]:
        """The ranks that differ from this one only along ``axes`` (ascending)."""
        fixed = {DEEPSPEED_AXIS[a]: self._coord(a) for a in DEEPSPEED_AXIS if a not in axes}
        return sorted(self.topo.filter_match(**fixed))

    def tp_ranks(self) -> list[int]:
        return self._along("tp")

    def pp_ranks(self) -> list[int]:
        return self._along("pp")

    def dp_ranks(self) -> list[int]:
        """The ranks that read the other rows (same tp, pp, cp)."""
        return self._along("dp")

    def cp_ranks(self) -> list[int]:
        return self._along("cp")

    def grad_ranks(self) -> list[int]:
        """dp × cp ranks holding this rank's parameter shard (same tp, pp)."""
        return self._along("dp", "cp")

    def model_ranks(self) -> list[int]:
        """TP × PP ranks of this rank's (dp, cp): each part of the model once."""
        return self._along("tp", "pp")

    # --- process groups (after attach) --------------------------------------------------
    def attach(self, grid: ContextParallelGrid) -> "Topology":
        """Take the process groups from ds_mp's grid (built on :attr:`topo`)."""
        if not isinstance(grid, ContextParallelGrid):
            raise TypeError(f"{type(grid).__name__}: attach needs ds_mp's ContextParallelGrid (build_grid)")
        got = (grid.get_slice_parallel_world_size(), grid.get_pipe_parallel_world_size(), grid.data_parallel_size,
               grid.get_context_parallel_world_size())
        if got != (self.tp, self.pp, self.dp, self.cp):
            raise ValueError(f"grid degrees (tp, pp, dp, cp) = {got} differ from the topology's")
        self.grid = grid
        return self

    def _need_grid(self) -> ContextParallelGrid:
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
        """The ranks that read distinct rows (:meth:`dp_ranks`)."""
        return self._need_grid().get_row_parallel_group()

    @property
    def cp_group(self) -> Any:
        """The ranks that split one sequence (:meth:`cp_ranks`); raises at cp = 1."""
        return self._need_grid().get_context_parallel_group()

    @property
    def grad_group(self) -> Any:
        """dp × cp (:meth:`grad_ranks`): gradient reduction, ZeRO partitions — DeepSpeed's
        ``get_data_parallel_group()`` on ds_mp's grid."""
        return self._need_grid().get_data_parallel_group()

    @property
    def model_group(self) -> Any:
        """TP × PP ranks of one (dp, cp) (:meth:`model_ranks`; DeepSpeed's "model parallel" group)."""
        return self._need_grid().get_model_parallel_group()

    def describe(self) -> str:
        return (f"rank {self.rank}: tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} "
                f"dp {self.dp_rank}/{self.dp} cp {self.cp_rank}/{self.cp}")


def build_grid(topology: Topology) -> Topology:
    """Create the process groups for ``topology`` (a collective) and attach them.

    Used where no ``PipelineModule`` creates the grid (unit tests, checkpoint tools)."""
    return topology.attach(ContextParallelGrid(topology.topo))
