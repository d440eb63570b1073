"""DeepSpeed's process grid with a context-parallel axis: the mpu ds_mp hands DeepSpeed.

DeepSpeed's ``ProcessTopology`` takes any axes, but its ``PipelineParallelGrid`` (the mpu a
``PipelineModule`` builds and ``PipelineEngine`` reads) knows three: ``pipe``, ``data``, ``model``.
ds_mp lays out ``pipe, data, context, model`` (:data:`AXES`; ``ds_mp.topology`` says why), so the
grid's ``data`` axis is the ranks that read distinct rows, and two of the groups DeepSpeed derives
from it are wrong as soon as ``context`` > 1.  :class:`ContextParallelGrid` answers DeepSpeed's mpu
protocol (DeepSpeed 0.19.8) as follows:

==========================================  =========================  ===================================
mpu call (who reads it)                     answers                    because
==========================================  =========================  ===================================
``data_parallel_size``/``_id``,             rows: dp                   ``PipelineEngine`` asserts
``get_data_parallel_world_size/rank()``                                ``dp_world_size == data_parallel_size``;
(engine ``dp_world_size``, batch sizes,                                ``train_batch_size`` = micro × GAS × it;
``DeepSpeedConfig``, ``deepspeed_io``)                                 users shard data by them
``get_data_parallel_group()``/``_ranks()``  dp × cp (the grad group)   ``PipelineEngine`` all-reduces the
                                                                       gradients over it and averages by its size
``get_sequence_data_parallel_group()``,     dp × cp                    ZeRO-1/2 and ``BF16_Optimizer`` partition
``…_world_size()``, ``…_rank()``                                       over it (``engine.seq_data_parallel_group``);
                                                                       the initial weight broadcast uses it
``get_model_parallel_group/rank/…()``       TP × PP of one (dp, cp)    norms and overflow checks sum over it: CP
                                                                       peers hold the same reduced gradients
``get_sequence_parallel_*``                 absent                     DeepSpeed's Ulysses paths stay off
                                                                       (``sequence_parallel_size`` = 1), so ZeRO
                                                                       also averages over all of dp × cp
==========================================  =========================  ===================================

The pipe, slice (TP) and p2p groups are DeepSpeed's own (they vary one axis and keep the others).
:meth:`ContextParallelGrid.get_row_parallel_group` is the rows group DeepSpeed built on ``data``;
:meth:`~ContextParallelGrid.get_context_parallel_group` the CP group.  With ``context`` = 1 every
group above is one DeepSpeed already built (no new process group is made).

Two DeepSpeed behaviours are wrong at cp > 1 and replaced here: ``_aggregate_total_loss``
all-reduces over ``get_data_parallel_group()`` (dp × cp) but divides by ``dp_world_size`` (dp), and
skips the all-reduce when dp = 1 (each CP rank's loss is its shard's part): :func:`grad_group_loss`
is the mean over dp × cp instead, and :func:`grad_group_mean` replaces ``_reduce_outputs``' (``eval_batch``).  ``PipelineModule._index_tied_modules`` builds the tied-weight
groups over ``data`` × ``model`` keeping each rank's own ``context`` coordinate (ranks of different CP
coordinates would call ``new_group`` with different ranks): ``pipeline_module`` builds them per CP
coordinate.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology

from ds_mp.deepspeed_compat.pipeline import Assumption, DeepSpeedIncompatible, _fail

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine

#: DeepSpeed's axis names, slowest first: rank = ((pipe·DP + data)·CP + context)·TP + model.
AXES: tuple[str, ...] = ("pipe", "data", "context", "model")

#: What the adapter reads of DeepSpeed's grid (instance attributes set by ``PipelineParallelGrid.__init__``).
GRID_ATTRIBUTES: tuple[Assumption, ...] = (
    Assumption("grid", "_topo", "the ProcessTopology the grid was built on"),
    Assumption("grid", "global_rank", "this process's rank"),
    Assumption("grid", "dp_proc_group", "the process group over the 'data' axis (the rows group here)"),
    Assumption("grid", "dp_group", "the ranks of dp_proc_group"),
    Assumption("grid", "ds_model_proc_group", "the group of every rank with this 'data' coordinate"),
)


def process_topology(*, pp: int, dp: int, cp: int, tp: int) -> ProcessTopology:
    """DeepSpeed's ``ProcessTopology`` over :data:`AXES` with these degrees (pure)."""
    return ProcessTopology(axes=list(AXES), dims=[pp, dp, cp, tp])


class ContextParallelGrid(PipelineParallelGrid):
    """``PipelineParallelGrid`` on :data:`AXES` answering DeepSpeed's mpu calls as the module
    docstring's table says.  Build it from a topology (``ContextParallelGrid(topology)``, a
    collective) or turn the grid a ``PipelineModule`` made into one (:meth:`adopt`)."""

    def __init__(self, topology: ProcessTopology) -> None:
        super().__init__(topology=topology)
        check_grid(self)
        self._add_groups()

    @classmethod
    def adopt(cls, grid: PipelineParallelGrid) -> "ContextParallelGrid":
        """``grid`` itself (same object: every reference to it stays valid) as this class, with the
        CP, grad and TP × PP groups added (a collective when cp > 1).  ``PipelineModule.__init__``
        builds DeepSpeed's grid with no way to name the class; this is where ds_mp's replaces it."""
        if isinstance(grid, cls):
            return grid
        check_grid(grid)
        names = tuple(grid._topo.get_axis_names())
        if names != AXES:
            raise ValueError(f"grid axes {names}: ds_mp's grid needs {AXES} (ds_mp.topology.Topology.topo)")
        grid.__class__ = cls
        grid._add_groups()
        return grid

    def _add_groups(self) -> None:
        topo, me = self._topo, self._topo.get_coord(self.global_rank)
        self.context_parallel_size = topo.get_dim("context")
        if self.context_parallel_size == 1:  # the rows group is dp × cp; DeepSpeed's model group is TP × PP
            self._context = None
            self._grad = (self.dp_proc_group, sorted(self.dp_group))
            self._model = self.ds_model_proc_group, sorted(topo.filter_match(data=me.data, context=me.context))
            return
        self._context = self._new_groups(topo.get_axis_comm_lists("context"))
        self._grad = self._new_groups([topo.filter_match(pipe=p, model=t) for p in range(topo.get_dim("pipe"))
                                       for t in range(topo.get_dim("model"))])
        self._model = self._new_groups([topo.filter_match(data=d, context=c) for d in range(topo.get_dim("data"))
                                        for c in range(self.context_parallel_size)])

    def _new_groups(self, lists: list[list[int]]) -> tuple[Any, list[int]]:
        """One process group per list (every rank creates every group, in the same order); mine."""
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks=sorted(ranks))
            if self.global_rank in ranks:
                mine = group, sorted(ranks)
        assert mine is not None, f"rank {self.global_rank} in none of {lists}"
        return mine

    # --- DeepSpeed's mpu protocol, as the table says ----------------------------------------
    def get_data_parallel_group(self) -> Any:
        """dp × cp: DeepSpeed's ``PipelineEngine`` reduces gradients over this group."""
        return self._grad[0]

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._grad[1]

    def get_sequence_data_parallel_group(self) -> Any:
        """dp × cp: ZeRO and ``BF16_Optimizer`` partition over this group."""
        return self._grad[0]

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self._grad[1])

    def get_sequence_data_parallel_rank(self) -> int:
        return self._grad[1].index(self.global_rank)

    def get_model_parallel_group(self) -> Any:
        """TP × PP of this rank's (dp, cp): every rank holding a distinct part of the model once."""
        return self._model[0]

    def get_model_parallel_world_size(self) -> int:
        return len(self._model[1])

    def get_model_parallel_rank(self) -> int:
        return self._model[1].index(self.global_rank)

    # --- ds_mp's names ----------------------------------------------------------------------
    def get_row_parallel_group(self) -> Any:
        """The ranks that read distinct rows (DeepSpeed's ``data`` axis alone)."""
        return self.dp_proc_group

    def get_row_parallel_group_ranks(self) -> list[int]:
        return sorted(self.dp_group)

    def get_context_parallel_group(self) -> Any:
        """The ranks that split one sequence; none exists at cp = 1 (guard with the degree)."""
        if self._context is None:
            raise RuntimeError("no context-parallel group at cp=1; guard its use with topology.cp > 1")
        return self._context[0]

    def get_context_parallel_world_size(self) -> int:
        return self.context_parallel_size

    def get_context_parallel_rank(self) -> int:
        return self._topo.get_coord(self.global_rank).context


def grad_group_mean(engine: PipelineEngine, value: Any) -> Any:
    """``value`` (a tensor or a list of them, this rank's mean over its micro-batches) summed over
    dp × cp and divided by its size: the mean DeepSpeed takes over dp at cp = 1, where dp × cp is
    dp.  At cp > 1 each CP rank's micro-batch loss is its shard's S / D (``ds_mp.losses.spec``), so
    the shards' parts are summed with the replicas (DeepSpeed divides by dp, and skips the
    all-reduce when dp = 1)."""
    grid = engine.grid
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        dist.all_reduce(v, group=grid.get_data_parallel_group())
        v /= grid.get_sequence_data_parallel_world_size()
    return value


def grad_group_loss(engine: PipelineEngine) -> Any:
    """``train_batch``'s loss at cp > 1, on every stage (DeepSpeed's ``_aggregate_total_loss`` with
    :func:`grad_group_mean`): the last stage's summed micro-batch losses (``total_loss``) over the
    micro-batches (DeepSpeed's 1/GAS), averaged over dp × cp, broadcast from the last stage."""
    import torch

    grid = engine.grid
    if engine.is_last_stage():
        loss = grad_group_mean(engine, engine.total_loss.detach().clone().float() / engine.micro_batches)
    else:
        loss = torch.zeros((), device=engine.device)
    if engine.num_stages > 1:
        last = grid.stage_to_global(stage_id=engine.num_stages - 1)
        dist.broadcast(loss, src=last, group=grid.get_pipe_parallel_group())
    return loss


def check_grid(grid: Any) -> None:
    """Raise :class:`DeepSpeedIncompatible` naming the first attribute of DeepSpeed's grid, or the
    first behaviour of its engine, that the table in this module's docstring relies on and is gone."""
    for a in GRID_ATTRIBUTES:
        if not hasattr(grid, a.name):
            raise _fail(a, type(grid).__name__)
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    reads = ((DeepSpeedEngine._reduce_non_expert_gradients, "self.mpu.get_data_parallel_group()",
              "the pipeline engine reduces gradients over mpu.get_data_parallel_group()"),
             (groups._get_sequence_data_parallel_group, "get_sequence_data_parallel_group",
              "ZeRO partitions over mpu.get_sequence_data_parallel_group()"))
    for fn, text, behaviour in reads:
        if text not in inspect.getsource(fn):
            raise DeepSpeedIncompatible(f"DeepSpeed's {fn.__qualname__} no longer reads {text} ({behaviour}); "
                                        "ds_mp.deepspeed_compat.grid needs updating")


__all__ = ["AXES", "GRID_ATTRIBUTES", "ContextParallelGrid", "check_grid", "grad_group_loss", "grad_group_mean", "process_topology"]
