"""The mixture-of-experts families' HF names: Llama's (``model.layers.<i>.…``), with the two ways a
checkpoint stores the experts:

* transformers 5 (what ``save_pretrained`` writes): ``mlp.experts.gate_up_proj`` (E, 2I, H) and
  ``mlp.experts.down_proj`` (E, H, I), the names ds_mp trains and exports;
* the Hub's per-expert keys: Qwen's ``mlp.experts.<e>.{gate,up,down}_proj.weight`` and Mixtral's
  ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate, up, down; its router
  ``block_sparse_moe.gate.weight``), which :func:`expert_part` maps onto the fused tensors (the
  reader fuses them as transformers' ``conversion_mapping`` does, reading only a rank's shard).

Names only."""
from __future__ import annotations

import re

from ds_mp.models.llama import hf_adapter as llama
from ds_mp.models.llama.hf_adapter import ignored, layer_prefix, plan_key

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def canonical_name(name: str) -> str:
    """Mixtral's Hub prefix ``block_sparse_moe.`` is transformers 5's ``mlp.``."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def hf_name(prefix: str, name: str) -> str:
    """Llama's, with the experts' LoRA factors (``mlp.experts.lora.gate_up_proj.lora_A`` in ds_mp's layer) named
    after the tensor they adapt: ``model.layers.<i>.mlp.experts.gate_up_proj.lora_A``."""
    return llama.hf_name(prefix, name.replace("mlp.experts.lora.", "mlp.experts."))


def expert_part(name: str) -> tuple[str, int, str] | None:
    """A Hub per-expert key (canonical) as ``(fused tensor name, expert, "gate"|"up"|"down")``; None
    for any other name.  gate and up are the two halves of ``gate_up_proj`` (rows ``[0, I)`` and
    ``[I, 2I)`` of expert e's ``(2I, H)``), down is ``down_proj[e]`` ``(H, I)``."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    part = PARTS[m.group(3)]
    return m.group(1) + ("down_proj" if part == "down" else "gate_up_proj"), int(m.group(2)), part


__all__ = ["PARTS", "canonical_name", "expert_part", "hf_name", "ignored", "layer_prefix", "plan_key"]
