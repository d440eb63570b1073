"""Any family's HF causal LM as a pipeline of layers with Megatron tensor parallelism.

The pipeline is a flat list of layers, one per row of the family's layer table
(``Family.pipeline_layers``: GPT-2's ``["wte", "wpe", "h.0", …, "ln_f", "lm_head"]``), split into
stages by :func:`ds_mp.models.partition.stage_parts` (or a ring layout); each rank builds only its
stage's layers (``Family.layer_spec``), reading only their weights from a
:class:`~ds_mp.models.weights.WeightSource`.  The loss is the run's
:class:`~ds_mp.losses.spec.LossSpec` bound to the stage's ``Ctx`` (the slot: ``ds_mp.losses``; the
per-token LM loss by default).  Nothing here names a model, and nothing here touches
DeepSpeed's module protocol: :class:`DsMpPipeline` subclasses the adapter
``ds_mp.deepspeed_compat.pipeline_module.PipelineModuleAdapter``, which translates DeepSpeed's build
hooks into :meth:`DsMpPipeline.grid_ready` and decodes DeepSpeed's parameter naming
(:meth:`~ds_mp.deepspeed_compat.pipeline_module.PipelineModuleAdapter.param_layer`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from deepspeed import checkpointing

from ds_mp.deepspeed_compat.pipeline_module import PipelineModuleAdapter, is_tied_param
from ds_mp.models.carry import CarriedLoss, Carry, carry_for, carrying_checkpoint
from ds_mp.models.ctx import Ctx
from ds_mp.models.family import family_of
from ds_mp.models.partition import LayerCosts, interleaved_layout, stage_parts, v_layout
from ds_mp.models.weights import WeightSource
from ds_mp.losses import LM_LOSS, LossSpec
from ds_mp.topology import Topology

#: Part of every cached cost profile's key (``partition_profile.json``, ``terapipe_profile.json``):
#: bumped when what a layer's forward + backward costs changes in kind, so older profiles are
#: measured again.  2: a step's later embedding backwards add only the looked-up rows.
LAYER_COST_VERSION = 2


@contextlib.contextmanager
def attending_to(blocks: list[nn.Module], extension: Any) -> Iterator[None]:
    """Inside the block, ``blocks`` attend to the keys/values ``extension.extend`` adds
    (``extend(index, k, v) -> (K̃, Ṽ, mask)``: earlier tokens of the same sequence, TeraPipe)."""
    for blk in blocks:
        blk.kv_extension = extension
    try:
        yield
    finally:
        for blk in blocks:
            blk.kv_extension = None


class DsMpPipeline(PipelineModuleAdapter):
    """A family's model as a pipeline stage: the layers of its table, ``parts`` (stage bounds over
    ``layer_names``), the ``Ctx`` its layers read, ``loss`` (its ``loss_fn`` is the spec bound to the
    ``Ctx``); DeepSpeed's module protocol is the adapter's (``ds_mp.deepspeed_compat.pipeline_module``)."""

    def __init__(self, layers: list, layer_names: list[str], parts: list[int], topology: Topology, ctx: Ctx,
                 loss: LossSpec = LM_LOSS, carry: Carry | None = None, **kw: Any) -> None:
        self.ds_mp_topology, self.ds_mp_ctx = topology, ctx
        self.family = ctx.family
        self.layer_names = layer_names  # the family's pipeline_layers() entries in this pipeline's order
        self.loss_spec = loss
        self.carry = carry  # what travels with the hidden state (ds_mp.models.carry), or None
        self._head: Any = None  # the forward function of the table's last layer, if on this stage
        loss_fn = loss.bind(ctx) if carry is None else CarriedLoss(loss, ctx, carry)
        super().__init__(layers, parts, topology.topo, loss_fn,
                         activation_checkpoint_func=inputs_carry_grad(checkpointing.checkpoint), **kw)
        if carry is not None:
            table_end = layer_names.index(self.family.pipeline_layers(ctx.hf)[-1])
            start, stop = parts[topology.pp_rank], parts[topology.pp_rank + 1]
            self._head = self.local_layers()[table_end - start] if start <= table_end < stop else None

    # DeepSpeed's forward checkpoints each segment with this; with a carry it is also a segment input/output
    @property
    def activation_checkpoint_func(self) -> Callable:
        return functools.partial(carrying_checkpoint, self._checkpoint_func, self.ds_mp_ctx)

    @activation_checkpoint_func.setter
    def activation_checkpoint_func(self, checkpoint: Callable) -> None:
        self._checkpoint_func = checkpoint

    def forward(self, inputs: Any) -> Any:
        """This stage's (or interleaved chunk's) layers; with a carry, the activation between stages
        is ``(h, carry)``: a stage that receives one continues its carry, the first starts it at zero,
        and every stage but the one ending with the head sends ``(h, carry)`` on (the head's stage
        leaves the carry in ``ctx.carry`` for the loss)."""
        if self.carry is None:
            return super().forward(inputs)
        ctx = self.ds_mp_ctx
        if isinstance(inputs, tuple) and inputs[0].is_floating_point():  # (h, carry) from the previous stage
            inputs, ctx.carry = inputs
        else:  # token ids (and positions): the micro-batch enters
            ctx.carry = self.carry.zeros(inputs[0].device if isinstance(inputs, tuple) else inputs.device)
        out = super().forward(inputs)
        if self._head is not None and self.local_layers()[-1] is self._head:  # (interleaved: the chunk's)
            return out
        return out, ctx.carry

    def grid_ready(self, grid: Any) -> None:
        self.ds_mp_topology.attach(grid)  # layers need the TP group at construction

    def blocks(self) -> list[nn.Module]:
        """This stage's transformer blocks, in order (the layers marked ``is_block``)."""
        return [m for m in self.local_layers() if getattr(m, "is_block", False)]


def inputs_carry_grad(checkpoint: Callable) -> Callable:
    """``checkpoint(fn, *args)`` whose floating inputs require grad when none does.

    DeepSpeed's reentrant checkpoint backpropagates into its segment only when an input requires
    grad: a segment fed by a frozen embedding (LoRA freezes ``wte``/``wpe``) would train none of the
    adapters inside it (and the step's loss would carry no graph).  As HF's
    ``enable_input_require_grads`` does for PEFT with gradient checkpointing, such inputs become
    leaves that require grad (nothing upstream had a graph, so nothing is cut).  Outside autograd
    (eval, ``no_grad``) the inputs pass unchanged."""
    def run(fn: Callable, *args: Any) -> Any:
        if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
            args = tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
        return checkpoint(fn, *args)
    return run


def hf_param_name(module_name: str, pipe: DsMpPipeline) -> str:
    """HF name of a pipeline parameter (``5.c_attn.weight`` -> ``transformer.h.3.attn.c_attn.weight``):
    its layer's table row, then the family's name of it."""
    index, name = pipe.param_layer(module_name)
    return pipe.family.hf_name(pipe.layer_names[index], name)


def is_tied_copy(module_name: str, pp_rank: int) -> bool:
    """True for a tied module's copy off stage 0 (the first and last stage share the embedding;
    checkpoints store it once, from stage 0, which holds the first layer in every layout)."""
    return is_tied_param(module_name) and pp_rank != 0


def v_pipeline_layout(hf_config: Any, stages: int, partition: str,
                      costs: LayerCosts | None = None) -> tuple[list[str], list[int], list[int]]:
    """ZB-V's layer placement for ``stages`` = P ranks: the family's layer table cut into 2P chunks
    by ``partition`` ("uniform" or "parameters", as the other schedules cut stages; "cost": the
    measured ``costs`` balanced per rank, :meth:`~ds_mp.models.partition.LayerCosts.v_blocks`), rank r holding
    chunks r and 2P − 1 − r (:func:`~ds_mp.models.partition.v_layout`).  Returns ``(names, parts,
    chunk_parts)``: the pipeline's layer order, its stage bounds, and the chunk bounds over the
    family's table (the same on every rank)."""
    family = family_of(hf_config)
    table = family.pipeline_layers(hf_config)
    if partition == "cost" and costs is not None:  # (without costs stage_parts says what it needs)
        partition = costs.v_blocks(hf_config.num_hidden_layers, stages)
    chunk_parts = stage_parts(hf_config.num_hidden_layers, 2 * stages, partition, hf_config.hidden_size,
                              hf_config.vocab_size, lead=family.lead_layers, tail=family.tail_layers,
                              block_params=family.block_parameters(hf_config))
    names, parts = v_layout(table, chunk_parts, stages)
    return names, parts, chunk_parts


def build_pipeline(src: WeightSource, topology: Topology, *, partition: str | list = "uniform",
                   sequence_parallel: bool = False, overlap_comm: bool = True, vocab_pad_multiple: int = 128,
                   activation_checkpoint_interval: int = 0, dynamic_shape: bool = False,
                   layout: tuple[list[str], list[int]] | None = None, lora: Any = None,
                   seed: int = 0, virtual_stages: int = 1, loss: LossSpec = LM_LOSS,
                   cp_impl: str = "allgather", expert_layout: str = "whole") -> DsMpPipeline:
    """Build this rank's stage of ``src.config``'s family (reading only its weights from ``src``).

    ``layout = (layer names, parts)`` replaces the default order (``Family.pipeline_layers``) and
    the ``partition`` with a reordering of the same layers (e.g. Ouroboros' ring, where stage 0
    holds the first and the last module); stage s holds layers ``[parts[s], parts[s+1])`` of it.

    ``dynamic_shape`` makes DeepSpeed announce activation shapes on every send (TeraPipe's
    uneven slices); otherwise the engine re-announces only when the sequence length changes.

    ``lora`` (a ``ds_mp.config.LoraConfig`` with ``r > 0``): the targeted linears get LoRA factors
    (from ``src`` if it holds them, else PEFT's init seeded by ``seed``) and every other parameter is
    frozen (``requires_grad=False``: no gradient, no optimizer state).  Without LoRA, the weights
    ``src.frozen`` names are frozen so (every TP shard, and the tied copy of a frozen embedding).

    ``virtual_stages`` = v > 1 (interleaved 1F1B): ``partition`` cuts the layers into K·v chunks and
    rank r builds chunks r, r + K, … (:func:`~ds_mp.models.partition.interleaved_layout`), one after
    the other; ``net.virtual_parts`` keeps the chunk boundaries over the family's table (None at v = 1).

    ``loss``: the run's :class:`~ds_mp.losses.spec.LossSpec` (``net.loss_spec``; ``net.loss_fn`` is it
    bound to this stage's ``Ctx``).  ``cp_impl``: context parallelism's exchange (``topology.cp`` > 1;
    ``ds_mp.context_parallel``).

    ``expert_layout``: a mixture of experts' ``"whole"`` or ``"split"`` experts over TP (``ds_mp.moe``).
    """
    cfg = src.config
    family = family_of(cfg)
    family.check(cfg)
    ctx = Ctx(topology, cfg, sequence_parallel, vocab_pad_multiple, cp_impl=cp_impl)
    ctx.overlap_comm, ctx.expert_layout = overlap_comm, expert_layout
    ctx.lora, ctx.seed = (lora if lora is not None and lora.r > 0 else None), seed
    L, table = cfg.num_hidden_layers, family.pipeline_layers(cfg)
    names, parts = layout or (table, stage_parts(L, topology.pp * virtual_stages, partition, cfg.hidden_size,
                                                 cfg.vocab_size, lead=family.lead_layers, tail=family.tail_layers,
                                                 block_params=family.block_parameters(cfg)))
    virtual_parts = parts if layout is None and virtual_stages > 1 else None
    if virtual_parts is not None:
        names, parts = interleaved_layout(names, virtual_parts, topology.pp)
    if sorted(names) != sorted(table) or len(parts) != topology.pp + 1:
        raise ValueError(f"layout {names} / {parts} is not a reordering of {family.name}'s {len(table)} layers "
                         f"over {topology.pp} stages")
    layers = [family.layer_spec(prefix, src, ctx) for prefix in names]
    net = DsMpPipeline(layers, names, parts, topology, ctx, loss, activation_checkpoint_interval=activation_checkpoint_interval,
                       dynamic_shape=dynamic_shape,
                       checkpointable_layers=list(family.checkpointable) if family.checkpointable else None,
                       carry=carry_for(cfg))
    net.virtual_parts = virtual_parts
    if ctx.lora is not None:
        for name, param in net.named_parameters():
            param.requires_grad = ".lora_" in name
    elif src.frozen:  # the HF model's requires_grad=False weights: every shard and tied copy of them
        for name, param in net.named_parameters():
            if hf_param_name(name, net) in src.frozen:
                param.requires_grad = False
    return net


__all__ = ["LAYER_COST_VERSION", "attending_to", "DsMpPipeline", "hf_param_name",
           "is_tied_copy", "v_pipeline_layout", "build_pipeline"]
