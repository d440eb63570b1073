"""The per-forward context every layer reads: TP rank/size/group, sequence parallelism, shapes,
dropout, LoRA, the family, and the running micro-batch's layout.  Below both the families and the
pipeline (it imports neither), so a family's layers and the family-free pipeline share it."""
from __future__ import annotations

import contextlib
from typing import Any

from ds_mp.models.family import Family, family_of
from ds_mp.tensor_parallel import padded_vocab_size
from ds_mp.tensor_parallel.random import parallel_region_rng
from ds_mp.topology import Topology


class Ctx:
    """What every layer needs: TP rank/size/group, SP flag, shapes, the family. Passed explicitly."""

    def __init__(self, topology: Topology, hf_config: Any, sequence_parallel: bool,
                 vocab_pad_multiple: int) -> None:
        self.topology, self.hf = topology, hf_config
        self.family: Family = family_of(hf_config)
        self.tp_rank, self.tp = topology.tp_rank, topology.tp
        self.sp = sequence_parallel and self.tp > 1
        self.n_head, self.n_embd = hf_config.num_attention_heads, hf_config.hidden_size
        self.vocab = hf_config.vocab_size
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, vocab_pad_multiple)
        # residual, embedding and attention-probability dropout (0 where the family has none)
        self.dropout, self.embd_dropout, self.attn_dropout = self.family.dropouts(hf_config)
        self.lora: Any = None  # a ds_mp.config.LoraConfig with r > 0, or None (set by build_pipeline)
        self.seed = 0  # LoRA factors not in the weight source are initialised from this seed
        self.overlap_comm = True  # column-parallel backward overlaps the dX all-reduce with dW
        # the running micro-batch's documents/padding/window (ds_mp.models.batch.Layout), set by the engine
        # around each forward and backward; None = plain causal attention over positions 0 … T-1
        self.layout: Any = None
        self.window: int | None = self.family.sliding_window(hf_config)
        # the running micro-batch's carry (ds_mp.models.carry): side quantities its layers add to (MoE router
        # statistics), passed across stage boundaries with the hidden state; None = nothing is carried
        self.carry: Any = None
        self.carry_weight = 1.0  # the carry's loss term's weight for this step (set by the engine)
        # mixture-of-experts families: "whole" (E/TP experts per rank) or "split" (each expert's width cut
        # over TP), set by build_pipeline from ds_mp.moe.expert_layout
        self.expert_layout = "whole"

    @property
    def group(self) -> Any:
        return self.topology.tp_group if self.tp > 1 else None

    def dropout_rng(self) -> Any:
        """Dropout on sequence-sharded activations must differ per TP rank."""
        return parallel_region_rng() if self.sp else contextlib.nullcontext()


__all__ = ["Ctx"]
