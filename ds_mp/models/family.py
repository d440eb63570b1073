"""A model family: everything ds_mp needs to know about one kind of HF causal LM, as tables.

The family-free machinery (:mod:`ds_mp.models.pipeline`, the checkpoint readers and writers,
the fresh-weight init) asks a :class:`Family` instead of naming a model:

* the **layer table** — :meth:`Family.pipeline_layers`: the HF name prefix held by each pipeline
  layer in pipeline order (``["wte", "wpe", "h.0", …, "ln_f", "lm_head"]`` for GPT-2), with
  :meth:`~Family.layer_index` (HF name -> layer) and :meth:`~Family.hf_name` (layer row and the
  name inside the layer -> HF name) its two directions; :attr:`~Family.lead_layers` of them come before
  the first block and :attr:`~Family.tail_layers` after the last;
* the **TP plan** — ``tp_plan`` (HF name suffix -> shard kind of
  :mod:`ds_mp.tensor_parallel.sharding`) applied by the one function :meth:`~Family.tp_kind`, and
  :meth:`~Family.heads` (the head count a ``qkv``/``kv`` kind is cut by);
* the **LoRA plan** — ``lora_plan`` (factor suffix -> shard kind) and ``lora_modules`` (the block
  linears LoRA may wrap, by their HF names);
* the **init rule** — :meth:`~Family.init_rule` (HF name -> ``("normal"|"zeros"|"ones", std)``),
  and the HF config of an inline shape to draw fresh weights for (:meth:`~Family.inline_config`);
* the **layers** — :meth:`~Family.layer_spec` builds the DeepSpeed ``LayerSpec`` of one table row.

A family is one package, ``ds_mp/models/<family>/`` (``plan.py``: the TP/LoRA plan that builds the
layers and shards checkpoints; ``layers.py``; ``hf_adapter.py``: HF names; ``__init__.py``: the
``Family`` subclass and ``FAMILY``), registered per ``model_type`` in the one registry,
:data:`ds_mp.config.families.FAMILIES` (imported on first use); :func:`family_of` finds the family of
an HF config.  Adding a family: docs/design.md, "How to add a model family".
"""
from __future__ import annotations

import math
import re
from types import ModuleType
from typing import Any

from ds_mp.config.families import FAMILIES, family_for, model_types_of
from ds_mp.models.family_config import FamilyConfig


class Family(FamilyConfig):
    """The tables of one model family (see the module docstring); subclasses fill them in.  What
    config validation asks of it (its ``config.json``, its checks) is :class:`FamilyConfig`'s."""

    name: str = ""  # its name in the registry (ds_mp.config.families) and its package
    tp_plan: dict[str, str] = {}
    lora_plan: dict[str, str] = {}
    lora_modules: tuple[str, ...] = ()  # block-relative HF names of the linears LoRA may wrap
    lead_layers: int = 2  # pipeline layers before the first block
    tail_layers: int = 2  # pipeline layers after the last block (the head's loss is DeepSpeed's loss_fn)
    block_prefix: str = ""  # HF prefix of block i is f"{block_prefix}{i}" (e.g. "transformer.h.")
    fan_in_fan_out: bool = False  # linear weights stored (in, out) (GPT-2's Conv1D), not nn.Linear's (out, in)
    # layer classes DeepSpeed may activation-checkpoint (None: any layer with parameters); a layer fed
    # token ids must not be (a reentrant checkpoint of an input without grad returns no graph)
    checkpointable: tuple[str, ...] | None = None
    #: the family's ``hf_adapter`` module (names only): its ``canonical_name``, ``layer_prefix``,
    #: ``hf_name``, ``plan_key`` and ``ignored`` are the methods of the same names below
    hf_adapter: ModuleType

    # --- the registry's entries ---------------------------------------------------------
    @property
    def model_types(self) -> tuple[str, ...]:
        """The HF ``model_type`` values registered for this family."""
        return model_types_of(self.name)

    @property
    def architectures(self) -> tuple[str, ...]:
        """The HF classes whose checkpoints it reads (one per ``model_type``)."""
        return tuple(FAMILIES[t].architecture for t in self.model_types)

    # --- configs -----------------------------------------------------------------------
    def config_class(self) -> Any:
        """The HF config class of ``model_type`` (imported lazily)."""
        raise NotImplementedError

    def inline_config(self, shape: Any) -> Any:
        """The HF config of an inline model shape (``ds_mp.config.InlineModel``) of this family."""
        raise NotImplementedError

    def dropouts(self, cfg: Any) -> tuple[float, float, float]:
        """Residual, embedding and attention-probability dropout of ``cfg`` (0 where it has none)."""
        return 0.0, 0.0, float(getattr(cfg, "attention_dropout", 0.0))

    def sliding_window(self, cfg: Any) -> int | None:
        """The attention window of ``cfg`` (each query sees its ``window`` latest keys), or None."""
        return None

    def model_class(self, cfg: Any) -> Any:
        """The HF ``…ForCausalLM`` class whose checkpoints this family reads and writes."""
        raise NotImplementedError

    def architecture(self, cfg: Any) -> str:
        """The HF class name an exported ``config.json`` names for ``cfg`` (by its ``model_type``)."""
        return FAMILIES[cfg.model_type].architecture

    # --- the layer table ---------------------------------------------------------------
    def pipeline_layers(self, cfg: Any) -> list[str]:
        raise NotImplementedError

    def canonical_name(self, name: str) -> str:
        """The full HF parameter name of ``name`` (GPT-2 also accepts names without ``transformer.``)."""
        return self.hf_adapter.canonical_name(name)

    def layer_prefix(self, hf_name: str) -> str:
        """The :meth:`pipeline_layers` entry holding the HF parameter ``hf_name``."""
        return self.hf_adapter.layer_prefix(hf_name)

    def layer_index(self, hf_name: str, layers: list[str]) -> int:
        """Index in ``layers`` (a :meth:`pipeline_layers` order or a reordering of it) of the layer
        holding ``hf_name`` (its first occurrence for a tied weight)."""
        return layers.index(self.layer_prefix(self.canonical_name(hf_name)))

    def hf_name(self, prefix: str, name: str) -> str:
        """HF name of the parameter ``name`` of the layer built for the table row ``prefix``
        (``("h.3", "attn_proj.weight")`` -> ``transformer.h.3.attn.c_proj.weight``)."""
        return self.hf_adapter.hf_name(prefix, name)

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """Every trained parameter (HF name, HF order) and its full shape."""
        raise NotImplementedError

    def head_and_embedding(self) -> tuple[str, str]:
        """HF names of the LM head and the token embedding (a tied head is the embedding)."""
        raise NotImplementedError

    def expert_part(self, name: str) -> tuple[str, int, str] | None:
        """A checkpoint key storing one expert's projection apart (the Hub's MoE layout) as (the fused
        tensor it belongs to, expert, "gate"|"up"|"down"); None for every other key (every dense family)."""
        return None

    def ignored(self, key: str) -> bool:
        """True for stored tensors every implementation recomputes (GPT-2's causal-mask buffers)."""
        return self.hf_adapter.ignored(key)

    # --- the TP and LoRA plans ---------------------------------------------------------
    def tp_kind(self, hf_name: str) -> str:
        """Shard kind of an HF parameter (or LoRA factor) name: the plans, applied."""
        key = self.plan_key(self.canonical_name(hf_name))
        kind = self.tp_plan.get(key) or self.lora_plan.get(key)
        if kind is None:
            raise KeyError(f"{hf_name!r} is not a {self.name} parameter ds_mp knows")
        return kind

    def plan_key(self, hf_name: str) -> str:
        """``hf_name`` without its block prefix (``attn.c_attn.weight``), as the plans key it."""
        return self.hf_adapter.plan_key(hf_name)

    def head_dim(self, cfg: Any) -> int:
        """Width of one attention head (a key/value cache entry's last dimension)."""
        return cfg.hidden_size // cfg.num_attention_heads

    def qk_norm(self, cfg: Any) -> bool:
        """Whether each head's queries and keys are RMS-normalised over ``head_dim`` (Qwen3, Gemma 3)."""
        return False

    def heads(self, hf_name: str, cfg: Any) -> int:
        """Heads of the tensor ``hf_name`` (what a ``qkv``/``kv`` cut keeps whole)."""
        return cfg.num_attention_heads

    def lora_shapes(self, cfg: Any, lora: dict | None) -> dict[str, tuple[int, ...]]:
        """The LoRA factors of a run with ``lora`` (``{"r", "target_modules"}``) and their full shapes
        in ds_mp's layout (``lora_A`` (in, r), ``lora_B`` (r, out)), in HF order; empty without LoRA."""
        if not lora or not lora.get("r"):
            return {}
        r, base, out = lora["r"], self.param_shapes(cfg), {}
        for i in range(cfg.num_hidden_layers):
            for module in self.lora_modules:
                if lora_targeted(module, lora["target_modules"]):
                    prefix = f"{self.block_prefix}{i}.{module}"
                    n_in, n_out = self.linear_in_out(base[prefix + ".weight"])
                    out[prefix + ".lora_A"], out[prefix + ".lora_B"] = (n_in, r), (r, n_out)
        return out

    def linear_in_out(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        """(in, out) features of a linear weight stored as the HF checkpoint stores it."""
        raise NotImplementedError

    # --- init and layers ---------------------------------------------------------------
    def init_rule(self, hf_name: str, cfg: Any, std: float = 0.02) -> tuple[str, float]:
        """The family's init of ``hf_name``: ``("zeros"|"ones"|"normal", std)``."""
        raise NotImplementedError

    def layer_spec(self, prefix: str, src: Any, ctx: Any) -> Any:
        """The DeepSpeed ``LayerSpec``/``TiedLayerSpec`` of the table row ``prefix`` (built from the plan)."""
        raise NotImplementedError

    def block_parameters(self, cfg: Any) -> int:
        """Parameters of one block (``"partition": "parameters"``)."""
        raise NotImplementedError


def lora_targeted(module: str, targets: list[str]) -> bool:
    """PEFT's matching of ``target_modules``: ``module`` (``attn.c_proj``) equals a target or ends
    with ``.<target>`` (so ``c_proj`` means both projections)."""
    return any(module == t or module.endswith("." + t) for t in targets)


def family_named(model_type: str) -> Family:
    """The family registered for the HF ``model_type`` (``ValueError`` naming the known ones)."""
    return family_for(model_type)


def family_of(hf_config: Any) -> Family:
    """The family of an HF config object (its ``model_type``)."""
    return family_named(hf_config.model_type)


def untied_as_hf_loads(cfg: Any, where: str) -> Any:
    """A copy of ``cfg`` with ``tie_word_embeddings`` false, with HF's warning: what HF's
    ``from_pretrained`` (``PreTrainedModel.tie_weights``) trains when a config ties the LM head but
    ``where`` (a checkpoint, a model object) holds a head that differs from the embedding: it loads the
    two untied.  A family whose table always ties the head (GPT-2) then refuses the copy."""
    import copy
    import warnings

    head, embedding = family_of(cfg).head_and_embedding()
    warnings.warn(f"ds_mp: {where}: {head} differs from {embedding} although tie_word_embeddings is true; "
                  "loading them untied, as HF's from_pretrained does (set tie_word_embeddings false to silence)")
    out = copy.deepcopy(cfg)
    out.tie_word_embeddings = False
    return out


def causal_lm_family(model: Any) -> Family:
    """The family of an HF model object (a PEFT model: of its base), refusing one that is not the
    family's causal LM (``LlamaModel``, ``LlamaForSequenceClassification``: ds_mp would train the
    causal-LM head and loss, not the object's own) with one line."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    cfg = getattr(base, "config", None)
    if cfg is None or not hasattr(cfg, "model_type"):
        raise ValueError(f"model: a {type(model).__name__} has no HF config; pass an HF …ForCausalLM, a model "
                         "directory or a Hub id")
    family = family_of(cfg)
    cls = family.model_class(cfg)
    if not isinstance(base, cls):
        raise ValueError(f"model: a {type(base).__name__} is not a causal LM; ds_mp trains {cls.__name__} (its LM "
                         f"head and loss, not this object's): pass {cls.__name__}.from_pretrained(...) of its weights")
    return family


def inline_config(shape: Any) -> Any:
    """The HF config of an inline model shape (``ds_mp.config.InlineModel``), by its ``model_type``."""
    return family_named(shape.model_type).inline_config(shape)


def model_config(cfg: Any) -> Any:
    """The HF config of a validated ``DsMpConfig``: its checkpoint's ``config.json``
    (``cfg.hf_config``), else its inline shape's."""
    if cfg.hf_config:
        return family_named(cfg.hf_config["model_type"]).config_from_dict(cfg.hf_config)
    return inline_config(cfg.shape)


def block_matmul_parameters(hf_config: Any) -> int:
    """Weights of one block that multiply activations (its 2-D parameters: q/k/v/o and MLP
    projections; norms and biases excluded): a token's forward through the block costs 2× this
    in FLOPs, besides attention's scores."""
    family = family_of(hf_config)
    first = next(r for r in family.pipeline_layers(hf_config) if re.fullmatch(r"[a-z_]+\.0", r))
    return sum(math.prod(shape) for name, shape in family.param_shapes(hf_config).items()
               if len(shape) == 2 and family.layer_prefix(name) == first)


__all__ = ["FAMILIES", "Family", "block_matmul_parameters", "causal_lm_family", "family_named", "family_of",
           "inline_config", "lora_targeted", "model_config", "untied_as_hf_loads"]
