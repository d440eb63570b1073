"""The mixture-of-experts family (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``), one folder: ``plan.py`` (the per-model-type rules and the TP plan of the
experts), ``layers.py`` (HF's router and experts under TP, on Llama's attention), ``hf_adapter.py``
(HF names, the Hub's per-expert keys), and here :class:`MoEFamily`, Llama's tables with a sparse
MLP where HF builds one.

Refused in one line (:meth:`MoEFamily.check`, :meth:`MoEFamily.check_run`): ``router_jitter_noise``
> 0 (Mixtral's training-time noise on the router input: a random multiplier HF draws per element),
``use_sliding_window`` (Qwen), an ``expert_layout`` other than whole/split, E not divisible by TP for
``whole``, an expert width not divisible by TP for ``split``.  LoRA: on attention's linears
(``target_modules``) and on the fused expert tensors (``target_parameters``, PEFT's ``ParamWrapper``:
``ds_mp.models.moe.lora``), whose LoRA dropout the config check refuses, as PEFT does.
"""
from __future__ import annotations

from typing import Any

from ds_mp.config.schema import ConfigError
from ds_mp.models.family import lora_targeted
from ds_mp.models.llama import LlamaFamily
from ds_mp.models.llama.plan import linear_shape
from ds_mp.models.moe import hf_adapter
from ds_mp.models.moe.layers import Block, expert_matmul_parameters
from ds_mp.models.moe.plan import (ATTENTION, LAYOUTS, MOE_LORA_PLAN, MOE_TP_PLAN, biases, expert_lora_shapes,
                                   expert_width, is_sparse, n_experts, param_shapes, qk_norm)


class MoEFamily(LlamaFamily):
    """Llama's tables with HF's sparse MLP (module docstring)."""

    name = "moe"
    hf_adapter = hf_adapter
    tp_plan, lora_plan = MOE_TP_PLAN, MOE_LORA_PLAN
    lora_modules = ATTENTION
    block_class = Block
    biases, qk_norm = staticmethod(biases), staticmethod(qk_norm)

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    def lora_shapes(self, cfg: Any, lora: dict | None) -> dict[str, tuple[int, ...]]:
        """Llama's (attention's factors), and per sparse block the expert factors ``target_parameters``
        names: ``lora_A`` (E, r, in), ``lora_B`` (E, out, r) (``ds_mp.models.moe.lora``), block by block."""
        dense = super().lora_shapes(cfg, lora)
        if not lora or not lora.get("r"):
            return dense
        targets, out = lora.get("target_parameters") or [], {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            out.update({n: s for n, s in dense.items() if n.startswith(p)})
            experts = expert_lora_shapes(cfg, i, lora["r"], lambda name: lora_targeted(name, targets))
            out.update({p + n: s for n, s in experts.items()})
        return out

    def expert_part(self, name: str) -> tuple[str, int, str] | None:
        return hf_adapter.expert_part(name)

    def sliding_window(self, cfg: Any) -> int | None:
        """Mixtral's ``sliding_window`` (HF applies it whenever it is set; Qwen's is refused by check)."""
        return getattr(cfg, "sliding_window", None) if cfg.model_type == "mixtral" else None

    def inline_hf(self, shape: Any) -> dict:
        raise ConfigError(f"ds_mp.model: an inline {shape.model_type} shape has no experts; give a checkpoint "
                          "directory (or a model object) of the mixture of experts")

    def check(self, cfg: Any) -> None:
        """Llama's checks, and what the sparse MLP does not build."""
        super().check(cfg)
        jitter = getattr(cfg, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise ValueError(f"{cfg.model_type} option router_jitter_noise={jitter} is not supported by ds_mp (a random "
                             "multiplier on the router input in training); set it 0")

    def check_run(self, cfg: Any) -> None:
        """The expert layout against TP (whole: TP divides E; split: TP divides each expert's width)."""
        super().check_run(cfg)
        hf = self.config_from_dict(self.text_config(cfg.hf_config))
        layout, E, inner = cfg.moe.expert_layout, n_experts(hf), expert_width(hf)
        if layout not in LAYOUTS:
            raise ConfigError(f"ds_mp.moe.expert_layout: {layout!r} is not a layout; use \"whole\" or \"split\"")
        if layout == "whole" and E % cfg.tp:
            raise ConfigError(f"ds_mp.moe.expert_layout: \"whole\" needs tensor_parallel.size={cfg.tp} to divide the "
                              f"{E} experts; use \"split\" or a TP size dividing {E}")
        if layout == "split" and inner % cfg.tp:
            raise ConfigError(f"ds_mp.moe.expert_layout: \"split\" needs tensor_parallel.size={cfg.tp} to divide the "
                              f"experts' width {inner}; use \"whole\" or a TP size dividing {inner}")

    def cost_shape(self, cfg: Any) -> dict:
        return {k: v for k, v in cfg.to_dict().items()
                if k not in ("_name_or_path", "transformers_version", "architectures", "num_hidden_layers")}

    def block_parameters(self, cfg: Any) -> int:
        """Weights one token multiplies in a block (attention, and the router and its k experts)."""
        attention = sum(o * i for o, i in (linear_shape(cfg, m) for m in ATTENTION))
        return attention + expert_matmul_parameters(cfg)

    def sparse(self, cfg: Any, index: int) -> bool:
        """Whether block ``index`` is a sparse (experts) layer."""
        return is_sparse(cfg, index)


FAMILY = MoEFamily()

__all__ = ["FAMILY", "MoEFamily"]
