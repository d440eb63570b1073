"""Layer-wise LAMB on any layout: the :class:`~ds_mp.optim.lamb.LayerMap` of an engine.

LAMB's trust ratio ``||w|| / ||u||`` belongs to one parameter of the *model* (a "layer").  The
tensors ds_mp's :class:`~ds_mp.optim.Lamb` steps are pieces of them:

* TP: a sharded parameter (``tensor_model_parallel``) is 1/TP of the model's; a replicated one
  is whole, and identical on every TP rank;
* bf16 (``BF16_Optimizer``) and ZeRO-1/2 (``DeepSpeedZeroOptimizer``): the optimizer steps one
  flat fp32 partition per parameter group and DP rank; parameter ``q``'s elements in it are the
  range ``q._hp_mapping.hp_fragment_address`` (``deepspeed_compat.flat_fragments``), and the
  rest of ``q`` lies in other DP ranks' partitions.

With every model parameter a layer, each rank adds the squares of its pieces per layer and

    Σ over the DP group   (flat partitions: each element of q on exactly one DP rank)
    Σ over the TP group   (shards; a replicated layer counted on TP rank 0 only)

gives ``||w||²`` and ``||u||²`` of the whole parameter on every rank: two small all-reduces of a
``(layers, 2)`` tensor per step.  Pipeline stages need nothing: each holds its parameters whole
(the tied ``wte`` on the first and last stage has equal values and gradients, hence the same
ratio on both).  Without a wrapper and at DP > 1 every replica holds whole reduced gradients,
so only TP is summed.
"""
from __future__ import annotations



import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.optim.lamb import Lamb, LayerMap
from ds_mp.engine_view import RuntimeEngine


def layer_map(engine: RuntimeEngine, base: Lamb) -> LayerMap:
    """The layers of ``base`` (the torch optimizer the engine steps) on this rank."""
    topo, wrapped = engine.topology, not isinstance(engine.optimizer, torch.optim.Optimizer)
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # id(optimizer tensor) -> (start, numel, layer)
    replicated: list[bool] = []
    if wrapped:  # one flat partition per group: the fragments of the group's parameters in it
        flats = compat.flat_partitions(engine.optimizer)
        for g, fragments in enumerate(compat.flat_fragments(engine.optimizer)):
            for param, fragment in fragments:  # every DP rank lists every parameter, in the same order
                if fragment is not None:
                    pieces.setdefault(id(flats[g]), []).append((*fragment, len(replicated)))
                replicated.append(not getattr(param, "tensor_model_parallel", False))
    else:
        for group in base.param_groups:
            for param in group["params"]:
                pieces[id(param)] = [(0, param.numel(), len(replicated))]
                replicated.append(not getattr(param, "tensor_model_parallel", False))
    not_owned = torch.tensor(replicated, device=engine.device) & (topo.tp_rank != 0)
    sum_dp = wrapped and topo.grad_size > 1

    def reduce(partial: torch.Tensor) -> None:
        if sum_dp:
            dist.all_reduce(partial, group=topo.grad_group)
        if topo.tp > 1:
            partial[not_owned] = 0.0  # a replicated layer: TP rank 0's copy only
            dist.all_reduce(partial, group=topo.tp_group)

    return LayerMap(layers=len(replicated), pieces=pieces, reduce=reduce, device=engine.device)


def attach(engine: RuntimeEngine) -> None:
    """Give ds_mp's Lamb (if it is the engine's torch optimizer) the engine's layer map."""
    opt = engine.optimizer
    base = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
    if isinstance(base, Lamb):
        base.set_layers(layer_map(engine, base))


__all__ = ["layer_map", "attach"]
