"""Hugging Face GPT-2 as a DeepSpeed ``PipelineModule`` with Megatron tensor parallelism.

The pipeline is a flat list of layers (DeepSpeed partitions it into stages); the one table
of it is :func:`pipeline_layers` (layer index ↔ HF name prefix ↔ the class built there):

    0        "wte"      TiedLayerSpec("wte")  token embedding (vocab-parallel), tied with the head
    1        "wpe"      Positions             + wpe, embedding dropout
    2..L+1   "h.<i>"    Block × L             pre-LN attention + MLP, TP plan applied
    L+2      "ln_f"     FinalNorm             ln_f
    L+3      "lm_head"  TiedLayerSpec("wte")  LM head: logits = h Eᵀ on the local vocab block
    loss                LMLoss                fused vocab-parallel cross-entropy, HF label shift

Weights are read from a :class:`WeightSource` (an in-memory HF model or a safetensors
directory) by HF name, and only for the layers this rank builds, so each rank
materialises just its own stage.  ``GPT2_TP_PLAN`` is the whole TP plan: one table, one
function (:func:`tp_kind`) applying it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from transformers.activations import ACT2FN

from ds_mp.deepspeed_compat import module_grid, module_topology, set_local_layers, tied_weights
from ds_mp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp,
                                   padded_vocab_size, vocab_parallel_cross_entropy)
from ds_mp.tensor_parallel.layers import embedding_lookup
from ds_mp.tensor_parallel.random import parallel_region_rng
from ds_mp.tensor_parallel.sharding import shard
from ds_mp.topology import Topology

#: Part of every cached cost profile's key (``partition_profile.json``, ``terapipe_profile.json``):
#: bumped when what a layer's forward + backward costs changes in kind, so older profiles are
#: measured again.  2: a step's later embedding backwards add only the looked-up rows.
LAYER_COST_VERSION = 2

# HF parameter name (suffix after "transformer." / "h.<i>.") -> how TP shards it.
GPT2_TP_PLAN: dict[str, str] = {
    "wte.weight": "vocab",
    "wpe.weight": "replicated",
    "ln_1.weight": "replicated", "ln_1.bias": "replicated",
    "attn.c_attn.weight": "qkv", "attn.c_attn.bias": "qkv",
    "attn.c_proj.weight": "row", "attn.c_proj.bias": "replicated",
    "ln_2.weight": "replicated", "ln_2.bias": "replicated",
    "mlp.c_fc.weight": "column", "mlp.c_fc.bias": "column",
    "mlp.c_proj.weight": "row", "mlp.c_proj.bias": "replicated",
    "ln_f.weight": "replicated", "ln_f.bias": "replicated",
}


# LoRA factors (``ds_mp.lora``), stored in the base's Conv1D layout (lora_A = Aᵀ: (in, r), lora_B = Bᵀ:
# (r, out)) and sharded consistently with it (ds_mp.tensor_parallel.lora).  Not part of an HF checkpoint,
# so kept apart from GPT2_TP_PLAN (whose keys are the HF files' tensors).
GPT2_LORA_PLAN: dict[str, str] = {
    "attn.c_attn.lora_A": "replicated", "attn.c_attn.lora_B": "qkv",
    "attn.c_proj.lora_A": "row", "attn.c_proj.lora_B": "replicated",
    "mlp.c_fc.lora_A": "replicated", "mlp.c_fc.lora_B": "column",
    "mlp.c_proj.lora_A": "row", "mlp.c_proj.lora_B": "replicated",
}


# Block submodule (ds_mp name) -> HF name inside ``transformer.h.<i>``.
BLOCK_RENAME: dict[str, str] = {"c_attn": "attn.c_attn", "attn_proj": "attn.c_proj",
                                "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}


def pipeline_layers(n_layer: int) -> list[str]:
    """THE layer layout: the HF name prefix held by each pipeline layer, in pipeline order.

    ``["wte", "wpe", "h.0", …, "h.<L-1>", "ln_f", "lm_head"]``; the head holds no tensor
    of its own (it is ``wte``, tied), so HF names map to layers 0 … L+2.
    """
    return ["wte", "wpe", *(f"h.{i}" for i in range(n_layer)), "ln_f", "lm_head"]


def layer_index(hf_name: str, layers: list[str]) -> int:
    """Index in ``layers`` (a :func:`pipeline_layers` order, or a reordering of it) of the layer
    holding the HF parameter ``hf_name`` (its first occurrence for the tied ``wte``)."""
    rest = re.sub(r"^transformer\.", "", hf_name)
    prefix = ".".join(rest.split(".")[:2]) if rest.startswith("h.") else rest.split(".")[0]
    return layers.index(prefix)


def hf_param_name(module_name: str, pipe: "GPT2Pipeline") -> str:
    """Map a pipeline parameter name (``5.c_attn.weight``, ``tied_modules.wte.wte.weight``) to its
    HF name (``transformer.h.3.attn.c_attn.weight``) through :func:`pipeline_layers`."""
    head, rest = module_name.split(".", 1)
    if head == "tied_modules":  # tied_modules.wte.wte.weight
        return "transformer.wte.weight"
    prefix = pipe.layer_names[int(head)]
    if prefix == "wpe":
        return "transformer.wpe.weight"
    if prefix == "ln_f":
        return "transformer." + rest  # ln_f.weight
    first, tail = rest.split(".", 1)
    return f"transformer.{prefix}.{BLOCK_RENAME.get(first, first)}.{tail}"


def hf_config_from(shape: Any) -> Any:
    """A ``GPT2Config`` for an inline model shape (``ds_mp.config.InlineModel``)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                      vocab_size=shape.vocab_size, n_positions=shape.n_positions,
                      resid_pdrop=shape.dropout, embd_pdrop=shape.dropout, attn_pdrop=shape.dropout,
                      bos_token_id=0, eos_token_id=0)


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every GPT-2 parameter (HF name, HF order) and its full shape for the ``GPT2Config`` ``cfg``."""
    C, inner = cfg.n_embd, getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
    size = {"wte.weight": (cfg.vocab_size, C), "wpe.weight": (cfg.n_positions, C),
            "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C),
            "mlp.c_fc.weight": (C, inner), "mlp.c_fc.bias": (inner,), "mlp.c_proj.weight": (inner, C)}
    top, final = ("wte.weight", "wpe.weight"), ("ln_f.weight", "ln_f.bias")
    out = {f"transformer.{k}": size[k] for k in top}
    for i in range(cfg.n_layer):
        out.update({f"transformer.h.{i}.{k}": size.get(k, (C,)) for k in GPT2_TP_PLAN if k not in top + final})
    out.update({f"transformer.{k}": (C,) for k in final})
    return out


def tp_kind(hf_name: str) -> str:
    """Shard kind of an HF GPT-2 parameter name (``transformer.h.3.attn.c_attn.weight``)."""
    key = re.sub(r"^(transformer\.)?(h\.\d+\.)?", "", hf_name)
    kind = GPT2_TP_PLAN.get(key) or GPT2_LORA_PLAN.get(key)
    if kind is None:
        raise KeyError(f"{hf_name!r} is not a GPT-2 parameter ds_mp knows")
    return kind


ShardGetter = Callable[..., torch.Tensor]  # (name, kind, rank, size, n_head=, padded_vocab=) -> shard



class WeightSource:
    """HF-layout tensors by name: ``get("transformer.h.0.ln_1.weight")`` (the full tensor) and
    ``get_shard(name, kind, rank, size, n_head=, padded_vocab=)`` (one TP shard, equal to
    ``shard(get(name), ...)``, as a new tensor the caller owns).  A source that can read or
    create a shard without the full tensor (safetensors ranges, sliced init) passes
    ``shard_getter`` (returning a new tensor too); the layers ask for shards through
    :meth:`lazy`, so a rank materialises only what it keeps, once.  ``names``: every
    name it holds, where known (optional tensors such as LoRA factors are looked up with
    :meth:`has`)."""

    def __init__(self, getter: Callable[[str], torch.Tensor], hf_config: Any,
                 shard_getter: ShardGetter | None = None, names: set[str] | None = None) -> None:
        self._get, self.config, self._get_shard = getter, hf_config, shard_getter
        self.names = names

    def get(self, name: str) -> torch.Tensor:
        return self._get(name)

    def get_shard(self, name: str, kind: str, rank: int, size: int, **meta: int) -> torch.Tensor:
        if self._get_shard is not None:
            return self._get_shard(name, kind, rank, size, **meta)
        return shard(self.get(name), kind, rank, size, **meta).clone()

    def lazy(self, name: str) -> "LazyWeight":
        """The weight ``name`` as the TP layers take it (``tp_parameter`` asks for its shard)."""
        return LazyWeight(self, name)

    def has(self, name: str) -> bool:
        """True if ``name`` is known to be present (False when the source cannot list its names)."""
        return self.names is not None and name in self.names

    @classmethod
    def from_model(cls, model: nn.Module) -> "WeightSource":
        """An HF ``GPT2LMHeadModel``, or a PEFT ``PeftModel`` over one (its LoRA factors are read as
        ``transformer.h.<i>.<module>.lora_A/B`` in ds_mp's layout, see :data:`GPT2_LORA_PLAN`)."""
        sd = model.state_dict()
        if hasattr(model, "peft_config"):
            sd = peft_to_hf_names(sd)
        return cls(lambda n: sd[n], model.config, names=set(sd))


def peft_to_hf_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's state dict (``base_model.model.<hf>.base_layer.weight``,
    ``….lora_A.<adapter>.weight`` (r, in), ``….lora_B.<adapter>.weight`` (out, r)) by HF name, the
    factors transposed into the Conv1D layout (``….lora_A`` (in, r), ``….lora_B`` (r, out))."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        name = re.sub(r"^base_model\.model\.", "", name).replace(".base_layer.", ".")
        m = re.match(r"^(.*)\.(lora_[AB])\.[^.]+\.weight$", name)
        if m:
            out[f"{m.group(1)}.{m.group(2)}"] = t.t().contiguous()
        elif "lora_" not in name:
            out[name] = t
    return out


class LazyWeight:
    """One named weight of a :class:`WeightSource`, read or created shard by shard."""

    def __init__(self, src: WeightSource, name: str) -> None:
        self.src, self.name = src, name

    def shard(self, kind: str, rank: int, size: int, **meta: int) -> torch.Tensor:
        """This rank's shard as a new tensor that the caller owns (``tp_parameter`` takes it
        over without a copy): never a view of a tensor kept elsewhere or of a memory-mapped
        file, which the parameter would keep alive (resident)."""
        return self.src.get_shard(self.name, kind, rank, size, **meta)


class Ctx:
    """What every layer needs: TP rank/size/group, SP flag, shapes. Passed explicitly."""

    def __init__(self, topology: Topology, hf_config: Any, sequence_parallel: bool,
                 vocab_pad_multiple: int) -> None:
        self.topology = topology
        self.tp_rank, self.tp = topology.tp_rank, topology.tp
        self.sp = sequence_parallel and self.tp > 1
        self.n_head, self.n_embd = hf_config.n_head, hf_config.n_embd
        self.vocab = hf_config.vocab_size
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, vocab_pad_multiple)
        self.dropout = hf_config.resid_pdrop
        self.embd_dropout = hf_config.embd_pdrop
        self.attn_dropout = hf_config.attn_pdrop
        self.eps = hf_config.layer_norm_epsilon
        self.act = hf_config.activation_function
        self.lora: Any = None  # a ds_mp.config.LoraConfig with r > 0, or None (set by build_gpt2_pipeline)
        self.seed = 0  # LoRA factors not in the weight source are initialised from this seed
        self.overlap_comm = True  # column-parallel backward overlaps the dX all-reduce with dW

    @property
    def group(self) -> Any:
        return self.topology.tp_group if self.tp > 1 else None

    def dropout_rng(self):
        """Dropout on sequence-sharded activations must differ per TP rank."""
        import contextlib
        return parallel_region_rng() if self.sp else contextlib.nullcontext()


class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm whose (replicated) weight and bias sum their gradients over the TP group in
    backward when sequence parallelism shards its input (``copy_to_tp``: identity forward,
    all-reduce backward): each rank saw only its part of the sequence.  Done inside autograd, so
    every optimizer wrapper (bf16 master gradients, ZeRO) sees the summed gradient."""

    def __init__(self, n: int, eps: float, group: Any) -> None:
        super().__init__(n, eps=eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, copy_to_tp(self.weight, self.group),
                            copy_to_tp(self.bias, self.group), self.eps)


def _layer_norm(src: WeightSource, prefix: str, ctx: Ctx) -> nn.LayerNorm:
    ln = SequenceParallelLayerNorm(ctx.n_embd, ctx.eps, ctx.group) if ctx.sp else nn.LayerNorm(ctx.n_embd, eps=ctx.eps)
    with torch.no_grad():
        ln.weight.copy_(src.get(prefix + ".weight"))
        ln.bias.copy_(src.get(prefix + ".bias"))
    for p in ln.parameters():
        p.tp_kind = "replicated"
    return ln


class Block(nn.Module):
    """One GPT-2 block, ``x + Attn(LN1 x)`` then ``+ MLP(LN2 ·)``, heads split over TP.

    ``kv_extension`` (set with :func:`attending_to`, e.g. by TeraPipe) supplies keys/values of
    earlier tokens of the same sequence: ``extend(index, k, v) -> (K̃, Ṽ, mask)``; the tokens
    attend to all of them plus causally to themselves.
    """

    def __init__(self, src: WeightSource, index: int, ctx: Ctx) -> None:
        super().__init__()
        p = f"transformer.h.{index}."
        g, r, n = ctx.group, ctx.tp_rank, ctx.tp
        self.ctx, self.index = ctx, index
        self.ln_1 = _layer_norm(src, p + "ln_1", ctx)
        self.c_attn = _lora_layer(src, index, "attn.c_attn", ctx) or ColumnParallelLinear(
            src.lazy(p + "attn.c_attn.weight"), src.lazy(p + "attn.c_attn.bias"), g, r, n, kind="qkv",
            n_head=ctx.n_head, sequence_parallel=ctx.sp, overlap_comm=ctx.overlap_comm)
        self.attn_proj = _lora_layer(src, index, "attn.c_proj", ctx) or RowParallelLinear(
            src.lazy(p + "attn.c_proj.weight"), src.lazy(p + "attn.c_proj.bias"), g, r, n, sequence_parallel=ctx.sp)
        self.ln_2 = _layer_norm(src, p + "ln_2", ctx)
        self.c_fc = _lora_layer(src, index, "mlp.c_fc", ctx) or ColumnParallelLinear(
            src.lazy(p + "mlp.c_fc.weight"), src.lazy(p + "mlp.c_fc.bias"), g, r, n, kind="column",
            sequence_parallel=ctx.sp, overlap_comm=ctx.overlap_comm)
        self.mlp_proj = _lora_layer(src, index, "mlp.c_proj", ctx) or RowParallelLinear(
            src.lazy(p + "mlp.c_proj.weight"), src.lazy(p + "mlp.c_proj.bias"), g, r, n, sequence_parallel=ctx.sp)
        self.act = ACT2FN[ctx.act]
        self.n_head_local = ctx.n_head // n
        self.kv_extension: Any = None  # see attending_to

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3·nh_l·hs)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.n_head_local, -1).permute(2, 0, 3, 1, 4)  # (B, nh_l, T, hs)
        p = self.ctx.attn_dropout if self.training else 0.0
        if self.kv_extension is not None:
            k, v, mask = self.kv_extension.extend(self.index, k, v)  # (B, nh_l, ctx+T, hs)
        else:
            mask = None
        with parallel_region_rng():  # each rank's own heads: its own dropout mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh_l·hs)
        return self.attn_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.ln_1(x))
        with self.ctx.dropout_rng():
            x = x + F.dropout(a, self.ctx.dropout, self.training)
        h = self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))
        with self.ctx.dropout_rng():
            return x + F.dropout(h, self.ctx.dropout, self.training)


def lora_targeted(module: str, targets: list[str]) -> bool:
    """PEFT's matching of ``target_modules``: ``module`` (``attn.c_proj``) equals a target or ends
    with ``.<target>`` (so ``c_proj`` means both projections)."""
    return any(module == t or module.endswith("." + t) for t in targets)


def _lora_layer(src: WeightSource, index: int, module: str, ctx: Ctx) -> nn.Module | None:
    """The LoRA variant of block ``index``'s ``module`` (``attn.c_attn`` …) when ``ctx.lora``
    targets it, else None.  Factors come from ``src`` when it holds them (a PEFT model), else
    PEFT's init from a generator seeded by (seed, block, module): identical on every rank."""
    from ds_mp.tensor_parallel.lora import LoRAColumnParallelLinear, LoRARowParallelLinear, lora_init

    lo = ctx.lora
    if lo is None or not lora_targeted(module, lo.target_modules):
        return None
    p = f"transformer.h.{index}.{module}"
    w, b = src.lazy(p + ".weight"), src.lazy(p + ".bias")  # the base: only this rank's shard is read
    if src.has(p + ".lora_A"):
        a, bb = src.get(p + ".lora_A").float(), src.get(p + ".lora_B").float()
    else:
        salt = list(BLOCK_RENAME.values()).index(module)
        fan_in, fan_out = param_shapes(src.config)[p + ".weight"]
        a, bb = lora_init(fan_in, fan_out, lo.r, torch.Generator().manual_seed(ctx.seed * 1000 + 4 * index + salt))
    kw = {"lora_A": a, "lora_B": bb, "scaling": lo.alpha / lo.r, "dropout": lo.dropout}
    kind = GPT2_TP_PLAN[module + ".weight"]
    if kind == "row":
        return LoRARowParallelLinear(w, b, ctx.group, ctx.tp_rank, ctx.tp, **kw)
    return LoRAColumnParallelLinear(w, b, ctx.group, ctx.tp_rank, ctx.tp, kind=kind, n_head=ctx.n_head, **kw)


@contextlib.contextmanager
def attending_to(blocks: list[Block], extension: Any) -> Iterator[None]:
    """Inside the block, ``blocks`` attend to the keys/values ``extension.extend`` adds."""
    for blk in blocks:
        blk.kv_extension = extension
    try:
        yield
    finally:
        for blk in blocks:
            blk.kv_extension = None


class TokenEmbedding(nn.Module):
    """``wte`` (vocab-parallel); tied between the first stage (lookup) and the last (head)."""

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.wte = VocabParallelEmbedding(src.lazy("transformer.wte.weight"), ctx.group, ctx.tp_rank, ctx.tp,
                                          ctx.padded_vocab, sequence_parallel=ctx.sp,
                                          overlap_comm=ctx.overlap_comm)


def embed_forward(module: TokenEmbedding, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage: ``ids`` or ``(ids, positions)`` -> ``(wte(ids), positions)``."""
    ids, pos = inputs if isinstance(inputs, (tuple, list)) else (inputs, None)
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return module.wte(ids), pos


def head_forward(module: TokenEmbedding, h: torch.Tensor) -> torch.Tensor:
    """Last stage: logits on the local vocab block, ``(B, T, V_p/p)``."""
    return module.wte.logits(h)


class Positions(nn.Module):
    """``h = dropout(wte(ids) + wpe(pos))`` (positions absolute, also for token slices).
    ``sparse_grads``: as :class:`ds_mp.tensor_parallel.VocabParallelEmbedding`'s."""

    sparse_grads = True

    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.wpe = nn.Parameter(src.get("transformer.wpe.weight").detach().clone())
        self.wpe.tp_kind = "replicated"

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tok, pos = inputs
        if self.ctx.sp:  # tok is the local sequence shard: take the matching positions
            pos = pos.expand(tok.shape[0], -1).chunk(self.ctx.tp, dim=1)[self.ctx.tp_rank]
        wpe = copy_to_tp(self.wpe, self.ctx.group) if self.ctx.sp else self.wpe  # SP: sum its grad over TP
        h = tok + embedding_lookup(pos, wpe, self.sparse_grads)
        with self.ctx.dropout_rng():
            return F.dropout(h, self.ctx.embd_dropout, self.training)


class FinalNorm(nn.Module):
    def __init__(self, src: WeightSource, ctx: Ctx) -> None:
        super().__init__()
        self.ln_f = _layer_norm(src, "transformer.ln_f", ctx)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h)


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


@dataclass(frozen=True)
class LayerCosts:
    """Measured seconds of one micro-batch's forward + backward through each kind of pipeline
    layer (``ds_mp.models.cost_profile`` measures them): ``embed`` = wte + wpe (stage 0),
    ``block`` = one transformer block, ``head`` = ln_f + tied LM head + loss (last stage)."""

    embed: float
    block: float
    head: float

    def blocks(self, n_layer: int, stages: int) -> list[int]:
        """Blocks per stage minimising the costliest stage (the pipeline runs at its pace); the
        first and last stage may hold no block when the embedding or head alone outweighs them."""
        return balanced_blocks(n_layer, stages, self.block, self.embed, self.head, min_end_blocks=0)

    @property
    def head_blocks(self) -> float:
        """Embedding + head + loss in units of one block: what a stage holding both ends (Ouroboros'
        ring rank 0) carries besides its blocks (``split_modules(head_blocks=...)``)."""
        return (self.embed + self.head) / self.block


def stage_parts(n_layer: int, stages: int, partition: str | list, n_embd: int, vocab: int,
                costs: LayerCosts | None = None) -> list[int]:
    """DeepSpeed ``parts``: layer-index boundaries of each stage over the L+4 layers.

    ``uniform`` gives blocks as evenly as possible (extra blocks to the middle stages,
    which carry no embedding/head).  ``parameters`` balances parameter counts, charging
    the embedding to the first stage and the (tied) head to the last; each stage keeps
    at least one block.  ``cost`` balances the measured ``costs`` (:meth:`LayerCosts.blocks`).
    A list gives blocks per stage.
    """
    if isinstance(partition, list):
        blocks = list(partition)
    elif partition == "uniform":
        base, extra = divmod(n_layer, stages)
        order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), s))
        blocks = [base + (1 if s in order[:extra] else 0) for s in range(stages)]
    elif partition == "parameters":
        block_w, embed_w = 12 * n_embd * n_embd, vocab * n_embd
        blocks = balanced_blocks(n_layer, stages, block_w, embed_w, embed_w, min_end_blocks=1)
    elif partition == "cost":
        if costs is None:
            raise ValueError("partition 'cost' needs the measured layer costs (ds_mp.models.cost_profile."
                             "agreed_layer_costs; ds_mp.initialize measures them), or give a list of blocks")
        blocks = costs.blocks(n_layer, stages)
    else:
        raise ValueError(f"unknown partition {partition!r}")
    parts, at = [0], 2  # layers 0,1 (embedding, positions) go to stage 0
    for s, b in enumerate(blocks):
        at += b
        parts.append(at if s < stages - 1 else n_layer + 4)
    return parts


def balanced_blocks(n_layer: int, stages: int, block: float, first: float, last: float,
                    min_end_blocks: int = 1) -> list[int]:
    """Contiguous blocks per stage minimising the costliest stage (linear partition, exact).

    Stage s holding c blocks costs ``c·block + first·[s = 0] + last·[s = K−1]``; middle stages
    hold ≥ 1 block, the first and last ≥ ``min_end_blocks``.  Two dynamic programs over
    (stage s, blocks n left for stages s…K−1), O(K·L²) each: the least max-cost M*, then, among
    the splits whose every stage costs ≤ M*, the one with the least sum of squared stage costs
    (the most even: idle stages absorb less jitter), ties to fewer blocks on earlier stages.
    Equal inputs give equal outputs on every rank.
    """
    K = stages
    low = [min_end_blocks if s in (0, K - 1) else 1 for s in range(K)]
    if K < 1 or n_layer < sum(low):
        raise ValueError(f"cannot split {n_layer} blocks over {K} stages with at least {low} blocks each")

    def cost(s: int, c: int) -> float:
        return c * block + (first if s == 0 else 0.0) + (last if s == K - 1 else 0.0)

    def table(combine: Callable[[float, float], float], allowed: Callable[[float], bool]) -> list[list[float]]:
        """``t[s][n]``: best ``combine``-fold of stage costs for stages s… holding n blocks."""
        t = [[inf] * (n_layer + 1) for _ in range(K + 1)]
        t[K][0] = 0.0
        for s in range(K - 1, -1, -1):
            for n in range(rest_low[s], n_layer + 1):
                top = n if s == K - 1 else n - rest_low[s + 1]
                t[s][n] = min((combine(cost(s, c), t[s + 1][n - c]) for c in range(low[s], top + 1)
                               if allowed(cost(s, c))), default=inf)
        return t

    inf = float("inf")
    rest_low = [sum(low[s:]) for s in range(K)] + [0]
    bound = table(max, lambda _: True)[0][n_layer]
    def square_sum(x: float, rest: float) -> float:
        return x * x + rest

    even = table(square_sum, lambda x: x <= bound)
    blocks, left = [], n_layer
    for s in range(K - 1):  # smallest count that keeps the optimum
        c = next(c for c in range(low[s], left - rest_low[s + 1] + 1)
                 if cost(s, c) <= bound and square_sum(cost(s, c), even[s + 1][left - c]) == even[s][left])
        blocks.append(c)
        left -= c
    return blocks + [left]


class GPT2Pipeline(PipelineModule):
    """GPT-2 as a PipelineModule; our partition replaces DeepSpeed's."""

    def __init__(self, layers: list, layer_names: list[str], parts: list[int], topology: Topology, ctx: Ctx,
                 **kw: Any) -> None:
        self._ds_mp_parts, self.ds_mp_topology, self.ds_mp_ctx = parts, topology, ctx
        self.layer_names = layer_names  # the pipeline_layers() entries in this pipeline's order
        super().__init__(layers=layers, topology=topology.topo, loss_fn=LMLoss(ctx), **kw)

    def _build(self) -> None:
        self.ds_mp_topology.attach(module_grid(self))  # layers need the TP group at construction
        super()._build()

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed broadcasts the tied ``wte`` from its first owner when the module is built.
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

    def allreduce_tied_weight_gradients(self) -> None:
        """DeepSpeed's, skipping a frozen tied weight (LoRA freezes ``wte``: there is no gradient)."""
        import deepspeed.comm as ds_dist

        for _, weight, group, _ in tied_weights(self):
            if weight.requires_grad:
                ds_dist.all_reduce(weight.grad, group=group)

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - ours
        self.parts = self._ds_mp_parts
        stage = module_topology(self).get_coord(self.global_rank).pipe
        set_local_layers(self, self.parts[stage], self.parts[stage + 1])

    def blocks(self) -> list[Block]:
        return [m for m in self.forward_funcs if isinstance(m, Block)]


def build_gpt2_pipeline(src: WeightSource, topology: Topology, *, partition: str | list = "uniform",
                        sequence_parallel: bool = False, overlap_comm: bool = True, vocab_pad_multiple: int = 128,
                        activation_checkpoint_interval: int = 0, dynamic_shape: bool = False,
                        layout: tuple[list[str], list[int]] | None = None, lora: Any = None,
                        seed: int = 0) -> GPT2Pipeline:
    """Build this rank's stage of GPT-2 (reading only its weights from ``src``).

    ``layout = (layer names, parts)`` replaces the default order :func:`pipeline_layers` and the
    ``partition`` with a reordering of the same layers (e.g. Ouroboros' ring, where stage 0 holds
    the first and the last module); stage s holds layers ``[parts[s], parts[s+1])`` of it.

    ``dynamic_shape`` makes DeepSpeed announce activation shapes on every send (TeraPipe's
    uneven slices); otherwise the engine re-announces only when the sequence length changes.

    ``lora`` (a ``ds_mp.config.LoraConfig`` with ``r > 0``): the targeted Conv1Ds get LoRA factors
    (from ``src`` if it holds them, else PEFT's init seeded by ``seed``) and every other parameter is
    frozen (``requires_grad=False``: no gradient, no optimizer state).
    """
    cfg = src.config
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(cfg, flag, False):
            raise ValueError(f"GPT-2 option {flag}=True is not supported by ds_mp")
    if not getattr(cfg, "scale_attn_weights", True):
        raise ValueError("GPT-2 option scale_attn_weights=False is not supported by ds_mp")
    ctx = Ctx(topology, cfg, sequence_parallel, vocab_pad_multiple)
    ctx.overlap_comm = overlap_comm
    ctx.lora, ctx.seed = (lora if lora is not None and lora.r > 0 else None), seed
    L = cfg.n_layer

    def spec(prefix: str) -> Any:
        if prefix == "wte":
            return TiedLayerSpec("wte", TokenEmbedding, src, ctx, forward_fn=embed_forward,
                                 tied_weight_attr=["wte.weight"])
        if prefix == "lm_head":
            return TiedLayerSpec("wte", TokenEmbedding, src, ctx, forward_fn=head_forward,
                                 tied_weight_attr=["wte.weight"])
        if prefix == "wpe":
            return LayerSpec(Positions, src, ctx)
        if prefix == "ln_f":
            return LayerSpec(FinalNorm, src, ctx)
        return LayerSpec(Block, src, int(prefix.split(".")[1]), ctx)

    names, parts = layout or (pipeline_layers(L), stage_parts(L, topology.pp, partition, cfg.n_embd, cfg.vocab_size))
    if sorted(names) != sorted(pipeline_layers(L)) or len(parts) != topology.pp + 1:
        raise ValueError(f"layout {names} / {parts} is not a reordering of GPT-2's {L + 4} layers over "
                         f"{topology.pp} stages")
    layers = [spec(prefix) for prefix in names]
    net = GPT2Pipeline(layers, names, parts, topology, ctx, activation_checkpoint_interval=activation_checkpoint_interval,
                       dynamic_shape=dynamic_shape)
    if ctx.lora is not None:
        for name, param in net.named_parameters():
            param.requires_grad = ".lora_" in name
    return net



__all__ = ["GPT2_TP_PLAN", "GPT2_LORA_PLAN", "lora_targeted", "peft_to_hf_names", "tp_kind", "param_shapes",
           "pipeline_layers", "layer_index", "hf_param_name", "hf_config_from", "WeightSource", "LazyWeight",
           "build_gpt2_pipeline", "GPT2Pipeline", "Block", "attending_to", "LMLoss", "shift_labels",
           "stage_parts", "balanced_blocks", "LayerCosts"]
