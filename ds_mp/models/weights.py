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
            sd = peft_to_hf_names(sd, {n: m.parameter_name for n, m in model.named_modules()
                                       if hasattr(m, "parameter_name") and hasattr(m, "lora_A")})
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if getattr(cfg, "tie_word_embeddings", False) and head is not None and head.weight is not embedding.weight:
            cfg = untied_as_hf_loads(cfg, f"the {type(model).__name__} object")
        frozen = frozenset() if hasattr(model, "peft_config") else frozenset(  # a PeftModel: ds_mp.lora freezes
            n for n, p in model.named_parameters() if not p.requires_grad)
        return cls(lambda n: sd[n], cfg, names=set(sd), frozen=frozen)


def _hf_module(peft_name: str) -> str:
    """The HF name under a PEFT model's name: without ``base_model.model.`` and every ``.base_layer``."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", re.sub(r"^base_model\.model\.", "", peft_name))


def peft_to_hf_names(sd: dict[str, torch.Tensor], wrappers: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's state dict (``base_model.model.<hf>.base_layer.weight``,
    ``….lora_A.<adapter>.weight`` (r, in), ``….lora_B.<adapter>.weight`` (out, r)) by HF name, the
    factors transposed into ds_mp's layout (``….lora_A`` (in, r), ``….lora_B`` (r, out)).

    ``wrappers``: PEFT's ``ParamWrapper`` modules (``target_parameters``) by module name -> the name of the
    parameter each adapts; their factors are named after it (``<hf>.<parameter>.lora_A/B``) in ds_mp's
    expert layout (:func:`param_factors_from_peft`, E from the parameter's first dim)."""
    out: dict[str, torch.Tensor] = {}
    wrapped: dict[str, dict[str, torch.Tensor]] = {}
    for raw, t in sd.items():
        m = re.match(r"^(.*)\.(lora_[AB])\.[^.]+\.weight$", raw)
        if m and m.group(1) in (wrappers or {}):
            wrapped.setdefault(f"{_hf_module(m.group(1))}.{wrappers[m.group(1)]}", {})[m.group(2)] = t
            continue
        name = _hf_module(raw)
        if m:
            out[f"{_hf_module(m.group(1))}.{m.group(2)}"] = t.t().contiguous()
        elif "lora_" not in name:
            out[name] = t
    for param, f in wrapped.items():
        out[param + ".lora_A"], out[param + ".lora_B"] = param_factors_from_peft(f["lora_A"], f["lora_B"],
                                                                                out[param].shape[0])
    return out


def param_factors_from_peft(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``ParamWrapper`` factors of a 3-D parameter (E, out, in), ``lora_A.weight`` (r·E, in) and
    ``lora_B.weight`` (out, r·E), as ds_mp's ``lora_A`` (E, r, in) and ``lora_B`` (E, out, r): PEFT reads
    ``A_e = lora_A.reshape(E, r, in)[e]`` (expert-major rows) and ``B_e = lora_B.reshape(out, r, E)[:, :, e]``
    (expert-minor columns), ``ΔW_e = s · B_e A_e``."""
    return (a.reshape(experts, -1, a.shape[-1]).contiguous(),
            b.reshape(b.shape[0], -1, experts).permute(2, 0, 1).contiguous())


def param_factors_to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`param_factors_from_peft`: (E, r, in), (E, out, r) -> (r·E, in), (out, r·E)."""
    E, r, n_in = a.shape
    return a.reshape(E * r, n_in).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous()


def peft_wrapper_names(params: list[str], order: list[str]) -> dict[str, str]:
    """The module name (HF-relative) of PEFT's ``ParamWrapper`` adapting each of ``params`` (HF names of
    parameters ``target_parameters`` names).  PEFT wraps a module's targeted parameters one after the other,
    in the order the module registers them (``order``: HF names in HF order), each wrapper around the
    previous: the last one is the module itself, each earlier one a ``.base_layer`` deeper."""
    by_module: dict[str, list[str]] = {}
    for p in sorted(params, key=order.index):
        by_module.setdefault(p.rsplit(".", 1)[0], []).append(p)
    return {p: module + ".base_layer" * (len(ps) - 1 - k) for module, ps in by_module.items() for k, p in enumerate(ps)}


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


__all__ = ["WeightSource", "LazyWeight", "peft_to_hf_names", "param_factors_from_peft", "param_factors_to_peft",
           "peft_wrapper_names", "ROWS_PER_DRAW", "fresh_tensor", "fresh_source"]
