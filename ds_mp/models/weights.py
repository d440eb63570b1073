"""Where a pipeline's weights come from: HF-layout tensors by HF name, read shard by shard.

:class:`WeightSource` wraps an in-memory HF model, a checkpoint directory
(``ds_mp.checkpoint.hf.directory_source``) or fresh weights (:func:`fresh_source`); the TP layers
ask it for their shards through :class:`LazyWeight`, so a rank materialises only what it keeps.

Layout-free fresh weights (:func:`fresh_source`): each tensor is drawn by HF name from its own
seeded streams, one per block of :data:`ROWS_PER_DRAW` rows (seed = hash(seed, name, block)), by
the family's init rule (``Family.init_rule``), so the same seed gives the same full tensors
whatever the TP × PP layout, and a rank creates only the rows it keeps (``row``/``vocab`` shards)
or one row block at a time (``column``/``qkv`` shards): no full model, and no full tensor of the
big matrices.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Callable

import torch
import torch.nn as nn

from ds_mp.tensor_parallel.sharding import read_shard, shard

ShardGetter = Callable[..., torch.Tensor]  # (name, kind, rank, size, n_head=, padded_vocab=) -> shard
ROWS_PER_DRAW = 64  # rows per seeded stream of a fresh tensor (fixed: part of the init's definition)


class WeightSource:
    """HF-layout tensors by name: ``get("transformer.h.0.ln_1.weight")`` (the full tensor) and
    ``get_shard(name, kind, rank, size, n_head=, padded_vocab=)`` (one TP shard, equal to
    ``shard(get(name), ...)``, as a new tensor the caller owns).  A source that can read or
    create a shard without the full tensor (safetensors ranges, sliced init) passes
    ``shard_getter`` (returning a new tensor too); the layers ask for shards through
    :meth:`lazy`, so a rank materialises only what it keeps, once.  ``names``: every
    name it holds, where known (optional tensors such as LoRA factors are looked up with
    :meth:`has`).  ``frozen``: the names of weights the model does not train (``requires_grad=False``
    in the HF model it was read from); their shards are built frozen."""

    def __init__(self, getter: Callable[[str], torch.Tensor], hf_config: Any,
                 shard_getter: ShardGetter | None = None, names: set[str] | None = None,
                 frozen: frozenset[str] = frozenset()) -> None:
        self._get, self.config, self._get_shard = getter, hf_config, shard_getter
        self.names, self.frozen = names, frozen

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
        """An HF ``…ForCausalLM``, or a PEFT ``PeftModel`` over one (its LoRA factors are read as
        ``<module>.lora_A/B`` in ds_mp's layout, see :func:`peft_to_hf_names`); any other object is
        refused (:func:`~ds_mp.models.family.causal_lm_family`).  Its weights with ``requires_grad=False``
        stay frozen (:attr:`frozen`).  Its config is the one the object
        trains with: a head HF left untied although the config ties it (``from_pretrained`` of a
        checkpoint storing a different head) stays untied (:func:`~ds_mp.models.family.untied_as_hf_loads`)."""
        from ds_mp.models.family import causal_lm_family, untied_as_hf_loads

        causal_lm_family(model)
        sd, cfg = model.state_dict(), model.config
        if hasattr(model, "peft_config"):
            sd = peft_to_hf_names(sd)
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if getattr(cfg, "tie_word_embeddings", False) and head is not None and head.weight is not embedding.weight:
            cfg = untied_as_hf_loads(cfg, f"the {type(model).__name__} object")
        frozen = frozenset() if hasattr(model, "peft_config") else frozenset(  # a PeftModel: ds_mp.lora freezes
            n for n, p in model.named_parameters() if not p.requires_grad)
        return cls(lambda n: sd[n], cfg, names=set(sd), frozen=frozen)


def peft_to_hf_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's state dict (``base_model.model.<hf>.base_layer.weight``,
    ``….lora_A.<adapter>.weight`` (r, in), ``….lora_B.<adapter>.weight`` (out, r)) by HF name, the
    factors transposed into ds_mp's layout (``….lora_A`` (in, r), ``….lora_B`` (r, out))."""
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


def _stream_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fresh_tensor(name: str, shape: tuple[int, ...], seed: int, rule: tuple[str, float], dim: int = 0, lo: int = 0,
                 hi: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index range ``[lo, hi)`` along ``dim`` of the fresh fp32 tensor ``name`` (whole by default)
    drawn by ``rule`` (``("normal", std)``, ``("zeros", 0)``, ``("ones", 0)``), written into ``out``
    when given (a view of that shape), else into a new tensor; returned.

    Rows (dim 0) come in blocks of :data:`ROWS_PER_DRAW`, each drawn from its own stream, so
    any row range is produced without the others; each block's part of the range is copied
    into place as it is drawn (peak: the range plus one block)."""
    kind, sd = rule
    hi = shape[dim] if hi is None else hi
    out_shape = list(shape)
    out_shape[dim] = hi - lo
    out = torch.empty(out_shape) if out is None else out
    if kind != "normal":
        return out.fill_(0.0 if kind == "zeros" else 1.0)
    rows = (lo, hi) if dim == 0 else (0, shape[0])
    for b in range(rows[0] // ROWS_PER_DRAW, -(-rows[1] // ROWS_PER_DRAW)):
        b_lo, b_hi = b * ROWS_PER_DRAW, min((b + 1) * ROWS_PER_DRAW, shape[0])
        g = torch.Generator().manual_seed(_stream_seed(seed, name, b))
        block = torch.empty((b_hi - b_lo, *shape[1:])).normal_(0.0, sd, generator=g)
        r_lo, r_hi = max(rows[0], b_lo), min(rows[1], b_hi)
        part = block[r_lo - b_lo: r_hi - b_lo]
        out[r_lo - rows[0]: r_hi - rows[0]] = part if dim == 0 else part.narrow(dim, lo, hi - lo)
    return out


def fresh_source(hf_config: Any, seed: int, std: float = 0.02) -> WeightSource:
    """A :class:`WeightSource` of the family's init for ``hf_config``, layout-free (module
    docstring): ``get`` creates one full tensor, ``get_shard`` only the shard's ranges."""
    from ds_mp.models.family import family_of

    family = family_of(hf_config)
    shapes = family.param_shapes(hf_config)

    def full_name(name: str) -> str:
        name = family.canonical_name(name)
        if name not in shapes:
            raise KeyError(f"{name!r} is not a parameter of this {family.name} config")
        return name

    def rule(name: str) -> tuple[str, float]:
        return family.init_rule(name, hf_config, std)

    def get(name: str) -> torch.Tensor:
        name = full_name(name)
        return fresh_tensor(name, shapes[name], seed, rule(name))

    def get_shard(name: str, kind: str, rank: int, size: int, **meta: int) -> torch.Tensor:
        name = full_name(name)
        return read_shard(lambda d, lo, hi, out: fresh_tensor(name, shapes[name], seed, rule(name), d, lo, hi, out),
                          shapes[name], kind, rank, size, **meta)

    return WeightSource(get, hf_config, get_shard)


__all__ = ["WeightSource", "LazyWeight", "peft_to_hf_names", "ROWS_PER_DRAW", "fresh_tensor", "fresh_source"]
