"""A model family: everything ds_mp needs to know about one kind of HF causal LM, as tables.

The family-free machinery (:mod:`ds_mp.models.pipeline`, the checkpoint readers and writers,
the fresh-weight init) asks a :class:`Family` instead of naming a model:

* the **layer table** — :meth:`Family.pipeline_layers`: the HF name prefix held by each pipeline
  layer in pipeline order (``["wte", "wpe", "h.0", …, "ln_f", "lm_head"]`` for GPT-2), with
  :meth:`~Family.layer_index` (HF name -> layer) and :meth:`~Family.hf_param_name` (pipeline
  parameter name -> HF name) its two directions; :attr:`~Family.lead_layers` of them come before
  the first block and :attr:`~Family.tail_layers` after the last;
* the **TP plan** — ``tp_plan`` (HF name suffix -> shard kind of
  :mod:`ds_mp.tensor_parallel.sharding`) applied by the one function :meth:`~Family.tp_kind`, and
  :meth:`~Family.heads` (the head count a ``qkv``/``kv`` kind is cut by);
* the **LoRA plan** — ``lora_plan`` (factor suffix -> shard kind) and ``lora_modules`` (the block
  linears LoRA may wrap, by their HF names);
* the **init rule** — :meth:`~Family.init_rule` (HF name -> ``("normal"|"zeros"|"ones", std)``),
  and the HF config of an inline shape to draw fresh weights for (:meth:`~Family.inline_config`);
* the **layers** — :meth:`~Family.layer_spec` builds the DeepSpeed ``LayerSpec`` of one table row.

A family registers its ``model_type`` values in :data:`FAMILIES` (name -> module path, imported on
first use); :func:`family_of` finds the family of an HF config.  Adding a family: docs/models.md.
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Any

#: HF ``model_type`` -> module defining ``FAMILY`` (imported lazily: reading a config imports no model).
FAMILIES: dict[str, str] = {
    "gpt2": "ds_mp.models.gpt2",
    "llama": "ds_mp.models.llama",
    "qwen2": "ds_mp.models.llama",
    "mistral": "ds_mp.models.llama",
}


class Family:
    """The tables of one model family (see the module docstring); subclasses fill them in."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()  # HF classes whose checkpoints it reads; the first is written
    tp_plan: dict[str, str] = {}
    lora_plan: dict[str, str] = {}
    lora_modules: tuple[str, ...] = ()  # block-relative HF names of the linears LoRA may wrap
    lora_targets: tuple[str, ...] = ()  # the target_modules values accepted in ds_mp.lora
    lead_layers: int = 2  # pipeline layers before the first block
    tail_layers: int = 2  # pipeline layers after the last block (the head's loss is DeepSpeed's loss_fn)
    block_prefix: str = ""  # HF prefix of block i is f"{block_prefix}{i}" (e.g. "transformer.h.")
    fan_in_fan_out: bool = False  # linear weights stored (in, out) (GPT-2's Conv1D), not nn.Linear's (out, in)
    # layer classes DeepSpeed may activation-checkpoint (None: any layer with parameters); a layer fed
    # token ids must not be (a reentrant checkpoint of an input without grad returns no graph)
    checkpointable: tuple[str, ...] | None = None

    # --- configs -----------------------------------------------------------------------
    def config_class(self) -> Any:
        """The HF config class of ``model_type`` (imported lazily)."""
        raise NotImplementedError

    def config_from_dict(self, raw: dict) -> Any:
        from transformers import AutoConfig

        raw = dict(raw)
        return AutoConfig.for_model(raw.pop("model_type"), **raw)

    def inline_config(self, shape: Any) -> Any:
        """The HF config of an inline model shape (``ds_mp.config.InlineModel``) of this family."""
        raise NotImplementedError

    def check(self, cfg: Any) -> None:
        """Raise ``ValueError`` (one line naming the option) for a config ds_mp would train wrongly."""

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
        """The HF class name an exported ``config.json`` names for ``cfg``."""
        return self.architectures[0]

    # --- the layer table ---------------------------------------------------------------
    def pipeline_layers(self, cfg: Any) -> list[str]:
        raise NotImplementedError

    def canonical_name(self, name: str) -> str:
        """The full HF parameter name of ``name`` (GPT-2 also accepts names without ``transformer.``)."""
        return name

    def layer_prefix(self, hf_name: str) -> str:
        """The :meth:`pipeline_layers` entry holding the HF parameter ``hf_name``."""
        raise NotImplementedError

    def layer_index(self, hf_name: str, layers: list[str]) -> int:
        """Index in ``layers`` (a :meth:`pipeline_layers` order or a reordering of it) of the layer
        holding ``hf_name`` (its first occurrence for a tied weight)."""
        return layers.index(self.layer_prefix(self.canonical_name(hf_name)))

    def hf_param_name(self, module_name: str, layer_names: list[str]) -> str:
        """HF name of a pipeline parameter (``5.attn_proj.weight``, ``tied_modules.wte.wte.weight``)."""
        raise NotImplementedError

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """Every trained parameter (HF name, HF order) and its full shape."""
        raise NotImplementedError

    def head_and_embedding(self) -> tuple[str, str]:
        """HF names of the LM head and the token embedding (a tied head is the embedding)."""
        raise NotImplementedError

    def ignored(self, key: str) -> bool:
        """True for stored tensors every implementation recomputes (GPT-2's causal-mask buffers)."""
        return False

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
        return re.sub(rf"^{re.escape(self.block_prefix)}\d+\.", "", hf_name)

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
        """The DeepSpeed ``LayerSpec``/``TiedLayerSpec`` of the table row ``prefix``."""
        raise NotImplementedError

    def block_parameters(self, cfg: Any) -> int:
        """Parameters of one block (``"partition": "parameters"``)."""
        raise NotImplementedError


def lora_targeted(module: str, targets: list[str]) -> bool:
    """PEFT's matching of ``target_modules``: ``module`` (``attn.c_proj``) equals a target or ends
    with ``.<target>`` (so ``c_proj`` means both projections)."""
    return any(module == t or module.endswith("." + t) for t in targets)


def family_named(model_type: str) -> Family:
    """The family registered for the HF ``model_type``."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a model family ds_mp knows; it trains GPT-2, Llama, "
                         f"Qwen2 and Mistral (model_type {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[model_type]).FAMILY


def family_of(hf_config: Any) -> Family:
    """The family of an HF config object (its ``model_type``)."""
    return family_named(hf_config.model_type)


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


__all__ = ["FAMILIES", "Family", "block_matmul_parameters", "family_named", "family_of", "inline_config",
           "lora_targeted", "model_config"]
