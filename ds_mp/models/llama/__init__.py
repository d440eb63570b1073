"""The Llama family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``,
``Qwen3ForCausalLM``), one folder:
``plan.py`` (the layer table, the TP and LoRA plans that build the layers and shard checkpoints,
and the shapes), ``layers.py`` (the layers, reading the plan through ``ctx.family``),
``hf_adapter.py`` (HF names), and here :class:`LlamaFamily`, which bundles them as the
:class:`~ds_mp.models.family.Family` that ``ds_mp.config.families`` registers for ``model_type``
llama, qwen2, mistral and qwen3.
"""
from __future__ import annotations

from typing import Any

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_mp.config.schema import ConfigError
from ds_mp.models.ctx import Ctx
from ds_mp.models.family import Family
from ds_mp.models.llama import hf_adapter
from ds_mp.models.llama.layers import Block, FinalNorm, LMHead, TokenEmbedding, embed_forward, head_forward
from ds_mp.models.llama.plan import (COLUMN, LLAMA_LORA_PLAN, LLAMA_TP_PLAN, ROW, STATIC_ROPE, biases, head_dim,
                                     linear_shape, padding_idx, param_shapes, pipeline_layers, qk_norm)
from ds_mp.models.weights import WeightSource


class LlamaFamily(Family):
    """The Llama family's tables (module docstring); Qwen2, Mistral and Qwen3 are the same table."""

    name = "llama"
    hf_adapter = hf_adapter  # HF names: canonical_name, layer_prefix, hf_name, plan_key, ignored
    tp_plan, lora_plan = LLAMA_TP_PLAN, LLAMA_LORA_PLAN
    lora_modules = (*COLUMN[:3], ROW[0], *COLUMN[3:], ROW[1])  # HF order within a block
    lead_layers, tail_layers, block_prefix = 1, 2, "model.layers."
    checkpointable = ("Block", "FinalNorm", "LMHead")  # not the (untied) embedding: its input is token ids

    def model_class(self, cfg: Any) -> Any:
        import transformers

        return getattr(transformers, self.architecture(cfg))

    def inline_config(self, shape: Any) -> Any:
        return self.config_from_dict(self.inline_hf(shape))

    def inline_hf(self, shape: Any) -> dict:
        """The shape as HF ``config.json`` keys (the family's config class fills the rest)."""
        return {"model_type": shape.model_type, "num_hidden_layers": shape.n_layer, "hidden_size": shape.n_embd,
                "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_kv_head or shape.n_head,
                "intermediate_size": shape.intermediate_size or 4 * shape.n_embd, "vocab_size": shape.vocab_size,
                "max_position_embeddings": shape.n_positions, "attention_dropout": shape.dropout,
                "head_dim": shape.n_embd // shape.n_head, "tie_word_embeddings": shape.tie_word_embeddings,
                "bos_token_id": 0, "eos_token_id": 0}

    def check_inline(self, shape: Any) -> None:
        """An inline shape's heads are ``n_embd / n_head`` wide (its ``head_dim``), grouped by ``n_kv_head``."""
        if shape.n_embd % shape.n_head:
            raise ConfigError(f"ds_mp.model.n_embd: {shape.n_embd} is not divisible by "
                              f"n_head={shape.n_head}; pick n_embd a multiple of n_head")
        if shape.n_kv_head < 0 or shape.n_head % (shape.n_kv_head or shape.n_head):
            raise ConfigError(f"ds_mp.model.n_kv_head: {shape.n_kv_head} does not divide n_head={shape.n_head}")

    def check_run(self, cfg: Any) -> None:
        """HF options the layers do not build (:meth:`check`), an MLP width TP splits evenly, and LoRA
        on k_proj/v_proj only where TP divides the key/value heads (otherwise the frozen projections
        are replicated and the factor cut would differ by rank)."""
        super().check_run(cfg)
        hf = self.text_config(cfg.hf_config)
        inner = hf.get("intermediate_size", 0)
        if inner % cfg.tp:
            raise ConfigError(f"ds_mp.tensor_parallel.size: {cfg.tp} does not divide intermediate_size={inner} (the "
                              "MLP is split in equal column blocks); use a TP size dividing it")
        kv = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        if cfg.lora.r and kv % cfg.tp and any(t in ("k_proj", "v_proj") for t in cfg.lora.target_modules):
            raise ConfigError(f"ds_mp.lora.target_modules: k_proj/v_proj with tensor_parallel.size={cfg.tp}, which "
                              f"does not divide the {kv} key/value heads (they are replicated); use a TP size "
                              f"dividing {kv} or LoRA on q_proj, o_proj and the MLP")

    def cost_shape(self, cfg: Any) -> dict:
        return {"n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "vocab": cfg.vocab_size,
                "model_type": cfg.model_type, "kv_heads": cfg.num_key_value_heads, "inner": cfg.intermediate_size,
                "act": cfg.hidden_act, "head_dim": getattr(cfg, "head_dim", None), "tied": cfg.tie_word_embeddings}

    def check(self, cfg: Any) -> None:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE:
            raise ValueError(f"{cfg.model_type} rope_type {rope!r} is not supported by ds_mp (its frequencies change "
                             f"with the input); supported: {', '.join(STATIC_ROPE)}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"{cfg.model_type} option use_sliding_window=True is not supported by ds_mp; set it "
                             "false (every layer full attention)")
        self.check_pad_and_heads(cfg)

    @staticmethod
    def check_pad_and_heads(cfg: Any) -> None:
        """The pad row inside the embedding and the query heads grouped evenly over the key/value heads."""
        pad, V = getattr(cfg, "pad_token_id", None), cfg.vocab_size
        if pad is not None and not -V <= pad < V:
            raise ValueError(f"{cfg.model_type} pad_token_id={pad} is not a row of the {V}-token embedding (HF's "
                             "padding_idx refuses it too); set pad_token_id to a token id below vocab_size, or null")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={cfg.num_key_value_heads}")

    def sliding_window(self, cfg: Any) -> int | None:
        """Mistral's ``sliding_window`` (HF applies it whenever it is set; Qwen2's is refused by check)."""
        return getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None

    def pipeline_layers(self, cfg: Any) -> list[str]:
        return pipeline_layers(cfg)



    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return param_shapes(cfg)

    head_dim, linear_shape, biases = staticmethod(head_dim), staticmethod(linear_shape), staticmethod(biases)
    padding_idx, qk_norm = staticmethod(padding_idx), staticmethod(qk_norm)

    def head_and_embedding(self) -> tuple[str, str]:
        return "lm_head.weight", "model.embed_tokens.weight"



    def heads(self, hf_name: str, cfg: Any) -> int:
        return cfg.num_key_value_heads if self.tp_kind(hf_name) == "kv" else cfg.num_attention_heads

    def linear_in_out(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        return weight_shape[1], weight_shape[0]  # nn.Linear: (out, in)

    def init_rule(self, hf_name: str, cfg: Any, std: float = 0.02) -> tuple[str, float]:
        if hf_name.endswith(".bias"):
            return "zeros", 0.0
        if hf_name.endswith("norm.weight"):
            return "ones", 0.0
        return "normal", cfg.initializer_range

    def block_parameters(self, cfg: Any) -> int:
        return sum(o * i for o, i in (linear_shape(cfg, m) for m in (*COLUMN, *ROW)))

    #: The layer classes and the tied embedding's two forwards :meth:`layer_spec` builds (a family on
    #: Llama's layout, e.g. Gemma 3, sets its own).
    embedding_class: type = TokenEmbedding
    head_class: type = LMHead
    norm_class: type = FinalNorm
    block_class: type = Block
    embed_forward = staticmethod(embed_forward)
    head_forward = staticmethod(head_forward)

    def layer_spec(self, prefix: str, src: WeightSource, ctx: Ctx) -> Any:
        tied, emb = ctx.hf.tie_word_embeddings, self.embedding_class
        if prefix == "embed_tokens":
            return (TiedLayerSpec("embed", emb, src, ctx, forward_fn=self.embed_forward,
                                  tied_weight_attr=["embed.weight"]) if tied else LayerSpec(emb, src, ctx))
        if prefix == "lm_head":
            return (TiedLayerSpec("embed", emb, src, ctx, forward_fn=self.head_forward,
                                  tied_weight_attr=["embed.weight"]) if tied else LayerSpec(self.head_class, src, ctx))
        if prefix == "norm":
            return LayerSpec(self.norm_class, src, ctx)
        return LayerSpec(self.block_class, src, int(prefix.split(".")[1]), ctx)


FAMILY = LlamaFamily()

__all__ = ["LLAMA_TP_PLAN", "LLAMA_LORA_PLAN", "FAMILY", "LlamaFamily", "param_shapes", "head_dim", "linear_shape",
           "biases", "padding_idx"]
