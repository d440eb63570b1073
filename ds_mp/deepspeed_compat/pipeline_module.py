"""The adapter between DeepSpeed's ``PipelineModule`` and ds_mp's model pipeline: the one subclass of it.

DeepSpeed builds a pipeline stage through private hooks: ``_partition_layers`` (which layers this
stage holds), ``_build`` (construct them, after creating the process grid) and
``_synchronize_tied_weights`` (make the tied copies equal), ``_index_tied_modules`` (their groups, per
context-parallel coordinate too).  :class:`PipelineModuleAdapter`
overrides exactly those and translates them into ds_mp's terms: the stage bounds it was given,
ds_mp's grid (``ContextParallelGrid.adopt``: the mpu DeepSpeed's engine reads),
:meth:`~PipelineModuleAdapter.grid_ready` (the model's subclass, ``ds_mp.models.pipeline.DsMpPipeline``,
hands the grid's process groups to its ``Topology`` there) and a checksum before any broadcast.
:func:`check_overrides` derives the override list from the class and checks each name against
DeepSpeed, so a rename fails at engine construction instead of turning an override into dead code.

DeepSpeed's layer naming is decoded here and nowhere else: a layer built from a ``TiedLayerSpec`` is
registered once per stage in ``tied_modules`` (its parameters are ``tied_modules.<key>.<name>``), every
other layer under its index in the layer list (``<index>.<name>``).  :meth:`~PipelineModuleAdapter.param_layer`
turns either into ``(layer index, name inside the layer)``; the tied one is the first layer of the
list with that key (the embedding, in every layout ds_mp builds).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec

from ds_mp.deepspeed_compat.grid import ContextParallelGrid
from ds_mp.deepspeed_compat.pipeline import overridden_private_names, tied_weights

#: DeepSpeed's ``PipelineModule`` registers the tied layers in this submodule (``nn.ModuleDict``).
TIED_PREFIX = "tied_modules."


class PipelineModuleAdapter(PipelineModule):
    """``PipelineModule`` over a layer list whose stage bounds ``parts`` are given (stage s holds layers
    ``[parts[s], parts[s+1])``), built by DeepSpeed's ``_build`` after :meth:`grid_ready`."""

    def __init__(self, layers: list, parts: list[int], topology: Any, loss_fn: Any, **kw: Any) -> None:
        self._ds_mp_parts = list(parts)
        # tied key -> index of the first layer built from it (a tied parameter's layer: param_layer)
        self._tied_layer: dict[str, int] = {}
        for i, spec in enumerate(layers):
            if isinstance(spec, TiedLayerSpec):
                self._tied_layer.setdefault(spec.key, i)
        super().__init__(layers=layers, topology=topology, loss_fn=loss_fn, **kw)

    # --- DeepSpeed's hooks, translated --------------------------------------------------
    def _build(self) -> None:
        # DeepSpeed's grid (made in PipelineModule.__init__) becomes ds_mp's mpu in place: the rows /
        # dp × cp groups of ds_mp.deepspeed_compat.grid, before anything reads it
        self._grid = ContextParallelGrid.adopt(self._grid)
        self.grid_ready(self._grid)  # layers need the TP group at construction
        super()._build()

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - ours
        self.parts = self._ds_mp_parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _index_tied_modules(self) -> dict:
        """DeepSpeed's tied-weight groups (one per tied key and fiber of the stages owning it), over
        every ``data`` × ``context`` × ``model`` fiber.  DeepSpeed's own loops over ``data`` × ``model``
        and keeps each rank's own ``context`` coordinate, so at cp > 1 ranks of different CP
        coordinates would call ``new_group`` (a collective) with different ranks; at cp = 1 it is
        DeepSpeed's, unchanged."""
        topo = self._topo
        if topo.get_dim("context") == 1 or topo.get_dim("pipe") == 1:
            return super()._index_tied_modules()
        specs, tied_comms = self._layer_specs, {}
        for key in sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}):
            stages = sorted({self.stage_owner(i) for i, s in enumerate(specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for d, c, m in itertools.product(*(range(topo.get_dim(a)) for a in ("data", "context", "model"))):
                ranks = [topo.get_rank(pipe=s, data=d, context=c, model=m) for s in stages]
                group = torch.distributed.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    tied_comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                       "module": self.tied_modules[key]}
                    for p in self.tied_modules[key].parameters() if self.global_rank != ranks[0] else ():
                        p.ds_pipe_replicated = True  # counted once by DeepSpeed's norm, as its own marks it
        return tied_comms

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed broadcasts the tied embedding from its first owner when the module is built.
        Every stage here built its copy from the same weight source, so the copies already agree:
        an all-reduce of per-row checksums (their max and min over the copies) confirms it, and
        the full broadcast (which also doubled the last stage's memory for the tied shard while
        building) runs only if a row differs.  The row sums are fp32 reductions along each row
        (deterministic, no temporary the size of the shard: a float64 sum upcast its chunks and
        left ~50 MiB of freed heap behind on GPT-2 medium).  Under no_grad: outside it autograd
        would record the in-place collective on the leaf and warn on every backward that it
        backpropagates through ``c10d::broadcast_``."""
        with torch.no_grad():
            for _, w, group, ranks in tied_weights(self):
                rows = w.detach().reshape(w.shape[0], -1).sum(dim=1)  # (rows,)
                both = torch.cat([rows, -rows])  # all-reduce MAX: (max, -min) per row
                torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
                if not torch.equal(both[:len(rows)], -both[len(rows):]):
                    torch.distributed.broadcast(w, src=min(ranks), group=group)

    # --- ds_mp's side -------------------------------------------------------------------
    def grid_ready(self, grid: Any) -> None:
        """Called with DeepSpeed's process grid before any layer is built (a subclass's hook)."""

    def local_layers(self) -> list:
        """The layers this stage's ``forward()`` runs, in order."""
        return self.forward_funcs

    def param_layer(self, name: str) -> tuple[int, str]:
        """``(index in the layer list, name inside that layer)`` of one of this module's parameter
        names: ``5.c_attn.weight`` -> ``(5, "c_attn.weight")``, ``tied_modules.wte.wte.weight`` ->
        ``(0, "wte.weight")`` (the first layer tied under ``wte``)."""
        if is_tied_param(name):
            key, rest = name[len(TIED_PREFIX):].split(".", 1)
            return self._tied_layer[key], rest
        head, rest = name.split(".", 1)
        return int(head), rest


def is_tied_param(name: str) -> bool:
    """True for a parameter name of a tied layer (held by every stage that has one of its layers)."""
    return name.startswith(TIED_PREFIX)


def check_overrides(adapter: type = PipelineModuleAdapter) -> list[str]:
    """The private names ``adapter`` overrides, each still defined by DeepSpeed's ``PipelineModule``."""
    return overridden_private_names(adapter, PipelineModule, "module")


__all__ = ["TIED_PREFIX", "PipelineModuleAdapter", "check_overrides", "is_tied_param"]
