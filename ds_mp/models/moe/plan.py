"""The mixture-of-experts families' plan: Llama's layer table and attention plan
(``ds_mp.models.llama.plan``) with a sparse MLP in the layers HF makes sparse.

Per model type, read from its HF config as HF reads it (:func:`n_experts`, :func:`expert_width`,
:func:`is_sparse`, :func:`renormalises`):

    qwen3_moe   Qwen3 attention (q/k norms);  E = num_experts, width moe_intermediate_size;
                sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (then a dense
                MLP of intermediate_size); top-k renormalised iff norm_topk_prob
    qwen2_moe   Qwen2 attention (q/k/v biases); as qwen3_moe, plus a shared expert (an MLP of
                shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate x)
    mixtral     Mistral attention; E = num_local_experts, width intermediate_size; every layer
                sparse; top-k always renormalised

A sparse layer's tensors (transformers 5's fused layout; the Hub's per-expert keys are fused on
read, ``ds_mp.models.moe.hf_adapter``):

    mlp.gate.weight             (E, H)       the router: replicated
    mlp.experts.gate_up_proj    (E, 2I, H)   [gate; up] per expert: "experts" (whole) or
                                             "experts_gate_up" (split: gate and up rows cut alike)
    mlp.experts.down_proj       (E, H, I)    "experts" (whole) or "experts_down" (split)

:data:`MOE_TP_PLAN` names the split layout's kinds; a layer built ``whole``
(``ds_mp.moe.expert_layout``) cuts both by experts, and its parameters carry the kind they were cut
with (``tp_kind``), which the export and the checkpoints read.
"""
from __future__ import annotations

from typing import Any

from ds_mp.models.llama.plan import LLAMA_LORA_PLAN, LLAMA_TP_PLAN, head_dim, linear_shape

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
MOE_TP_PLAN: dict[str, str] = {
    **LLAMA_TP_PLAN, "mlp.gate.weight": "replicated", "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down", "mlp.shared_expert.gate_proj.weight": "linear_out",
    "mlp.shared_expert.up_proj.weight": "linear_out", "mlp.shared_expert.down_proj.weight": "linear_in",
    "mlp.shared_expert_gate.weight": "replicated"}
# LoRA on the fused experts (PEFT's target_parameters; ds_mp.models.moe.lora): per expert lora_A (E, r, in) and
# lora_B (E, out, r), cut in the split layout like the base (B of gate_up by its gate and up rows, A of down by
# its columns) or kept whole on every rank (the other factor); by experts in the whole layout, like the base
EXPERT_LORA_PLAN: dict[str, str] = {
    "mlp.experts.gate_up_proj.lora_A": "experts_replicated", "mlp.experts.gate_up_proj.lora_B": "experts_gate_up",
    "mlp.experts.down_proj.lora_A": "experts_down", "mlp.experts.down_proj.lora_B": "experts_replicated"}
MOE_LORA_PLAN: dict[str, str] = {**{k: v for k, v in LLAMA_LORA_PLAN.items() if k.startswith("self_attn.")},
                                 **EXPERT_LORA_PLAN}
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LAYOUTS = ("whole", "split")


def n_experts(cfg: Any) -> int:
    return cfg.num_local_experts if cfg.model_type == "mixtral" else cfg.num_experts


def expert_width(cfg: Any) -> int:
    """I: one expert's intermediate size."""
    return cfg.intermediate_size if cfg.model_type == "mixtral" else cfg.moe_intermediate_size


def is_sparse(cfg: Any, index: int) -> bool:
    """Whether HF builds block ``index``'s MLP as experts (its decoder layer's rule)."""
    if cfg.model_type == "mixtral":
        return True
    return (index not in cfg.mlp_only_layers and cfg.num_experts > 0
            and (index + 1) % cfg.decoder_sparse_step == 0)


def renormalises(cfg: Any) -> bool:
    """Whether the top-k probabilities are divided by their sum (Mixtral always; Qwen iff norm_topk_prob)."""
    return cfg.model_type == "mixtral" or bool(cfg.norm_topk_prob)


def biases(cfg: Any) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP biases) as HF builds them: Qwen3-MoE ``attention_bias`` (q/k/v
    and o), Qwen2-MoE q/k/v biases always, Mixtral none."""
    if cfg.model_type == "qwen3_moe":
        attn = bool(getattr(cfg, "attention_bias", False))
        return attn, attn, False
    return cfg.model_type == "qwen2_moe", False, False


def qk_norm(cfg: Any) -> bool:
    return cfg.model_type == "qwen3_moe"


def sparse_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP tensors (block-relative names) and their full shapes."""
    E, H, I = n_experts(cfg), cfg.hidden_size, expert_width(cfg)
    out: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (E, H), "mlp.experts.gate_up_proj": (E, 2 * I, H),
                                       "mlp.experts.down_proj": (E, H, I)}
    if cfg.model_type == "qwen2_moe":
        S = cfg.shared_expert_intermediate_size
        out.update({"mlp.shared_expert.gate_proj.weight": (S, H), "mlp.shared_expert.up_proj.weight": (S, H),
                    "mlp.shared_expert.down_proj.weight": (H, S), "mlp.shared_expert_gate.weight": (1, H)})
    return out


def expert_lora_shapes(cfg: Any, index: int, r: int, targeted: Any) -> dict[str, tuple[int, ...]]:
    """Block ``index``'s expert LoRA factors (block-relative names) and their full shapes: for each fused
    tensor ``(E, out, in)`` that ``targeted(name)`` accepts, ``lora_A`` (E, r, in) and ``lora_B`` (E, out, r);
    none in a dense layer."""
    if not is_sparse(cfg, index):
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for name in EXPERTS:
        if targeted(name):
            E, n_out, n_in = sparse_shapes(cfg)[name]
            out[name + ".lora_A"], out[name + ".lora_B"] = (E, r, n_in), (E, n_out, r)
    return out


def param_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter (HF name) and its full shape; ``lm_head.weight`` only when untied."""
    C, V = cfg.hidden_size, cfg.vocab_size
    qkv_bias, o_bias, _ = biases(cfg)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, C)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for m in ATTENTION:
            out[p + m + ".weight"] = linear_shape(cfg, m)
            if (o_bias if m == "self_attn.o_proj" else qkv_bias):
                out[p + m + ".bias"] = (linear_shape(cfg, m)[0],)
        if qk_norm(cfg):
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (head_dim(cfg),)
        if is_sparse(cfg, i):
            out.update({p + n: s for n, s in sparse_shapes(cfg).items()})
        else:
            for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                out[p + m + ".weight"] = linear_shape(cfg, m)
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (C,)
    out["model.norm.weight"] = (C,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    return out


__all__ = ["ATTENTION", "EXPERTS", "EXPERT_LORA_PLAN", "LAYOUTS", "MOE_LORA_PLAN", "MOE_TP_PLAN", "SHARED", "biases",
           "expert_lora_shapes", "expert_width", "is_sparse", "n_experts", "param_shapes", "qk_norm", "renormalises",
           "sparse_shapes"]
