"""An unmodified HF causal LM cut into Ouroboros' modules G_0..G_{K-1}, for the single-process
reference (``ouroboros_oracle.OuroborosReference``, the tests' oracle): each family's cut (:data:`CUTS`, by
``Family.name``) says which of the HF model's own submodules sit before the first block (G_0),
after the last (G_{K-1}), and how HF calls them; the blocks are HF's decoder layers, called as
the HF model calls them.  The modules share the HF model's parameters, so a tied head is the
same ``Parameter`` in G_0 and G_{K-1}.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ds_mp.models.family import family_of


class GPT2Cut:
    """``GPT2LMHeadModel``: G_0 = wte + wpe + dropout, G_{K-1} = ln_f + logits = h V^T (V = wte, tied)."""

    @staticmethod
    def parts(model: nn.Module) -> tuple[dict, nn.ModuleList, dict]:
        t = model.transformer
        return {"wte": t.wte, "wpe": t.wpe, "drop": t.drop}, t.h, {"ln_f": t.ln_f, "wte": t.wte}

    @staticmethod
    def embed(lead: nn.ModuleDict, ids: Tensor, pos: Tensor) -> Tensor:
        return lead["drop"](lead["wte"](ids) + lead["wpe"](pos))  # (B, T, C)

    @staticmethod
    def block_kwargs(model: nn.Module, h: Tensor, pos: Tensor, block: nn.Module) -> dict:
        return {}

    @staticmethod
    def logits(tail: nn.ModuleDict, h: Tensor) -> Tensor:
        return F.linear(tail["ln_f"](h), tail["wte"].weight)  # (B, T, vocab)


class LlamaCut:
    """``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``: G_0 = embed_tokens,
    every block gets HF's rotary ``position_embeddings``, G_{K-1} = norm + lm_head (tied to
    embed_tokens or not, as HF built it)."""

    @staticmethod
    def parts(model: nn.Module) -> tuple[dict, nn.ModuleList, dict]:
        m = model.model
        return {"embed_tokens": m.embed_tokens}, m.layers, {"norm": m.norm, "lm_head": model.lm_head}

    @staticmethod
    def embed(lead: nn.ModuleDict, ids: Tensor, pos: Tensor) -> Tensor:
        return lead["embed_tokens"](ids)  # (B, T, C)

    @staticmethod
    def block_kwargs(model: nn.Module, h: Tensor, pos: Tensor, block: nn.Module) -> dict:
        return {"position_embeddings": model.model.rotary_emb(h, position_ids=pos)}  # (cos, sin), no parameters

    @staticmethod
    def logits(tail: nn.ModuleDict, h: Tensor) -> Tensor:
        return tail["lm_head"](tail["norm"](h))  # (B, T, vocab)


class SoftCap(nn.Module):
    """Gemma 3's ``final_logit_softcapping``: ``c · tanh(z / c)`` (identity when ``c`` is None)."""

    def __init__(self, cap: float | None) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, z: Tensor) -> Tensor:
        return z if self.cap is None else torch.tanh(z / self.cap) * self.cap


class Gemma3Cut(LlamaCut):
    """``Gemma3ForCausalLM``: G_0 = the scaled embed_tokens, every block gets its layer type's mask
    (sliding window or causal) and RoPE, G_{K-1} = norm + lm_head + the logits' soft-capping."""

    @staticmethod
    def parts(model: nn.Module) -> tuple[dict, nn.ModuleList, dict]:
        lead, layers, tail = LlamaCut.parts(model)
        return lead, layers, {**tail, "cap": SoftCap(model.config.final_logit_softcapping)}

    @staticmethod
    def block_kwargs(model: nn.Module, h: Tensor, pos: Tensor, block: nn.Module) -> dict:
        kind = model.config.layer_types[block.self_attn.layer_idx]
        kw = {"position_embeddings": model.model.rotary_emb(h, pos, kind)}
        if kind == "sliding_attention":
            kw["attention_mask"] = create_sliding_window_causal_mask(config=model.config, inputs_embeds=h,
                                                                     attention_mask=None, cache=None, position_ids=pos)
        return kw

    @staticmethod
    def logits(tail: nn.ModuleDict, h: Tensor) -> Tensor:
        return tail["cap"](tail["lm_head"](tail["norm"](h)))  # (B, T, vocab)


#: ``Family.name`` -> how to cut that family's HF model.
CUTS = {"gpt2": GPT2Cut, "llama": LlamaCut, "gemma3": Gemma3Cut}


class OuroborosModule(nn.Module):
    """G_m: [the lead modules if m == 0] -> HF blocks -> [the tail modules if m == K-1].

    Shares its submodules with the HF model it was cut from (G_0 and G_{K-1} share a tied head).
    Input: token ids (B, T) for G_0, hidden (B, T, C) otherwise.  Output: hidden (B, T, C), or
    logits (B, T, vocab) for G_{K-1}.  Reproduces the HF model's forward exactly.
    """

    def __init__(self, index: int, num_modules: int, model: nn.Module, blocks: range) -> None:
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == num_modules - 1
        self.config = model.config
        self.cut = CUTS[family_of(model.config).name]
        lead, layers, tail = self.cut.parts(model)
        self._model = [model]  # for the block arguments (rotary); a list keeps it out of the submodules
        if self.is_first:
            self.lead = nn.ModuleDict(lead)
        self.blocks = nn.ModuleList(layers[i] for i in blocks)
        if self.is_last:
            self.tail = nn.ModuleDict(tail)

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        h = self.cut.embed(self.lead, x, pos) if self.is_first else x  # (B, T, C)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=pos)
        for block in self.blocks:
            kwargs = {"attention_mask": mask, **self.cut.block_kwargs(self._model[0], h, pos, block)}
            h = block(h, position_ids=pos, **kwargs)
        return self.cut.logits(self.tail, h) if self.is_last else h


__all__ = ["CUTS", "GPT2Cut", "Gemma3Cut", "LlamaCut", "OuroborosModule"]
