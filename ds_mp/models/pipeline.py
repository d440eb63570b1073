"""Any family's HF causal LM as a DeepSpeed ``PipelineModule`` with Megatron tensor parallelism.

The pipeline is a flat list of layers, one per row of the family's layer table
(``Family.pipeline_layers``: GPT-2's ``["wte", "wpe", "h.0", …, "ln_f", "lm_head"]``), split into
stages by :func:`ds_mp.models.partition.stage_parts` (or a ring layout); each rank builds only its
stage's layers (``Family.layer_spec``), reading only their weights from a
:class:`~ds_mp.models.weights.WeightSource`.  The loss is :class:`LMLoss` (fused vocab-parallel
cross-entropy with HF's label shift).  Nothing here names a model.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed import checkpointing
from deepspeed.pipe import PipelineModule

from ds_mp.deepspeed_compat import module_grid, module_topology, set_local_layers, tied_weights
from ds_mp.models.family import Family, family_of
from ds_mp.models.partition import LayerCosts, interleaved_layout, stage_parts, v_layout
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel import padded_vocab_size, vocab_parallel_cross_entropy
from ds_mp.tensor_parallel.random import parallel_region_rng
from ds_mp.topology import Topology

#: Part of every cached cost profile's key (``partition_profile.json``, ``terapipe_profile.json``):
#: bumped when what a layer's forward + backward costs changes in kind, so older profiles are
#: measured again.  2: a step's later embedding backwards add only the looked-up rows.
LAYER_COST_VERSION = 2


class Ctx:
    """What every layer needs: TP rank/size/group, SP flag, shapes, the family. Passed explicitly."""

    def __init__(self, topology: Topology, hf_config: Any, sequence_parallel: bool,
                 vocab_pad_multiple: int) -> None:
        self.topology, self.hf = topology, hf_config
        self.family: Family = family_of(hf_config)
        self.tp_rank, self.tp = topology.tp_rank, topology.tp
        self.sp = sequence_parallel and self.tp > 1
        self.n_head, self.n_embd = hf_config.num_attention_heads, hf_config.hidden_size
        self.vocab = hf_config.vocab_size
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, vocab_pad_multiple)
        # residual, embedding and attention-probability dropout (0 where the family has none)
        self.dropout, self.embd_dropout, self.attn_dropout = self.family.dropouts(hf_config)
        self.lora: Any = None  # a ds_mp.config.LoraConfig with r > 0, or None (set by build_pipeline)
        self.seed = 0  # LoRA factors not in the weight source are initialised from this seed
        self.overlap_comm = True  # column-parallel backward overlaps the dX all-reduce with dW
        # the running micro-batch's documents/padding/window (ds_mp.models.batch.Layout), set by the engine
        # around each forward and backward; None = plain causal attention over positions 0 … T-1
        self.layout: Any = None
        self.window: int | None = self.family.sliding_window(hf_config)

    @property
    def group(self) -> Any:
        return self.topology.tp_group if self.tp > 1 else None

    def dropout_rng(self) -> Any:
        """Dropout on sequence-sharded activations must differ per TP rank."""
        return parallel_region_rng() if self.sp else contextlib.nullcontext()


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


class LMLoss:
    """Mean next-token cross-entropy with HF's shift (``logits[:, t]`` predicts
    ``labels[:, t+1]``; ``-100`` ignored), from vocab-parallel logits."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.__name__ = "LMLoss"

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``(B, T)`` against already-shifted ``targets``."""
        if self.ctx.tp == 1:  # one rank holds every logit: the plain (faster) kernel, padding cut off
            flat = F.cross_entropy(logits[..., :self.ctx.vocab].reshape(-1, self.ctx.vocab).float(),
                                   targets.reshape(-1), ignore_index=-100, reduction="none")
            return flat.view(targets.shape)
        start = self.ctx.tp_rank * (self.ctx.padded_vocab // self.ctx.tp)
        flat = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            vocab_start=start, true_vocab=self.ctx.vocab, group=self.ctx.group)
        return flat.view(targets.shape)

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        """``labels`` (B, T), or ``(targets, count)`` for a TeraPipe token slice: its already-shifted
        targets and the number of valid targets of its whole micro-batch (slice losses then sum
        to the micro-batch loss)."""
        if isinstance(labels, tuple):
            targets, count = labels
        else:
            targets = shift_labels(labels)
            count = (targets != -100).sum().clamp(min=1)
        return self.token_losses(logits, targets).sum() / count


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``targets[:, t] = labels[:, t+1]``, last position ignored (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


class DsMpPipeline(PipelineModule):
    """A family's model as a PipelineModule; our partition replaces DeepSpeed's."""

    def __init__(self, layers: list, layer_names: list[str], parts: list[int], topology: Topology, ctx: Ctx,
                 **kw: Any) -> None:
        self._ds_mp_parts, self.ds_mp_topology, self.ds_mp_ctx = parts, topology, ctx
        self.family = ctx.family
        self.layer_names = layer_names  # the family's pipeline_layers() entries in this pipeline's order
        super().__init__(layers=layers, topology=topology.topo, loss_fn=LMLoss(ctx),
                         activation_checkpoint_func=inputs_carry_grad(checkpointing.checkpoint), **kw)

    def _build(self) -> None:
        self.ds_mp_topology.attach(module_grid(self))  # layers need the TP group at construction
        super()._build()

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

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - ours
        self.parts = self._ds_mp_parts
        stage = module_topology(self).get_coord(self.global_rank).pipe
        set_local_layers(self, self.parts[stage], self.parts[stage + 1])

    def blocks(self) -> list[nn.Module]:
        """This stage's transformer blocks, in order (the layers marked ``is_block``)."""
        return [m for m in self.forward_funcs if getattr(m, "is_block", False)]


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
    """HF name of a pipeline parameter (``5.c_attn.weight`` -> ``transformer.h.3.attn.c_attn.weight``),
    through the family's layer table."""
    return pipe.family.hf_param_name(module_name, pipe.layer_names)


def is_tied_copy(module_name: str, pp_rank: int) -> bool:
    """True for a tied module's copy off stage 0 (the first and last stage share the embedding;
    checkpoints store it once, from stage 0, which holds the first layer in every layout)."""
    return module_name.startswith("tied_modules.") and pp_rank != 0


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
                   seed: int = 0, virtual_stages: int = 1) -> DsMpPipeline:
    """Build this rank's stage of ``src.config``'s family (reading only its weights from ``src``).

    ``layout = (layer names, parts)`` replaces the default order (``Family.pipeline_layers``) and
    the ``partition`` with a reordering of the same layers (e.g. Ouroboros' ring, where stage 0
    holds the first and the last module); stage s holds layers ``[parts[s], parts[s+1])`` of it.

    ``dynamic_shape`` makes DeepSpeed announce activation shapes on every send (TeraPipe's
    uneven slices); otherwise the engine re-announces only when the sequence length changes.

    ``lora`` (a ``ds_mp.config.LoraConfig`` with ``r > 0``): the targeted linears get LoRA factors
    (from ``src`` if it holds them, else PEFT's init seeded by ``seed``) and every other parameter is
    frozen (``requires_grad=False``: no gradient, no optimizer state).

    ``virtual_stages`` = v > 1 (interleaved 1F1B): ``partition`` cuts the layers into K·v chunks and
    rank r builds chunks r, r + K, … (:func:`~ds_mp.models.partition.interleaved_layout`), one after
    the other; ``net.virtual_parts`` keeps the chunk boundaries over the family's table (None at v = 1).
    """
    cfg = src.config
    family = family_of(cfg)
    family.check(cfg)
    ctx = Ctx(topology, cfg, sequence_parallel, vocab_pad_multiple)
    ctx.overlap_comm = overlap_comm
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
    net = DsMpPipeline(layers, names, parts, topology, ctx, activation_checkpoint_interval=activation_checkpoint_interval,
                       dynamic_shape=dynamic_shape,
                       checkpointable_layers=list(family.checkpointable) if family.checkpointable else None)
    net.virtual_parts = virtual_parts
    if ctx.lora is not None:
        for name, param in net.named_parameters():
            param.requires_grad = ".lora_" in name
    return net


__all__ = ["LAYER_COST_VERSION", "Ctx", "attending_to", "LMLoss", "shift_labels", "DsMpPipeline", "hf_param_name",
           "is_tied_copy", "v_pipeline_layout", "build_pipeline"]
