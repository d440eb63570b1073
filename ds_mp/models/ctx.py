"""The per-forward context every layer reads: TP rank/size/group, sequence parallelism, context
parallelism (CP rank/size/group/impl), shapes, dropout, LoRA, the family, and the running
micro-batch's layout.  Below both the families and the
pipeline (it imports neither), so a family's layers and the family-free pipeline share it."""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ds_mp.context_parallel.attention import allgather_attention, ulysses_attention
from ds_mp.context_parallel.rules import DEFAULT_IMPL, balanced_for
from ds_mp.models.family import Family, family_of
from ds_mp.tensor_parallel import padded_vocab_size
from ds_mp.tensor_parallel.random import parallel_region_rng
from ds_mp.topology import Topology


class Ctx:
    """What every layer needs: TP rank/size/group, SP flag, CP rank/size/impl, shapes, the family.
    Passed explicitly.

    Context parallelism (``topology.cp`` > 1): every activation holds this CP rank's ``T/cp`` tokens
    of each row (the full-row indices ``layout.q_index``; ``ds_mp.context_parallel.shard``), and the
    engine always sets a :class:`~ds_mp.models.batch.Layout` (full-row positions and documents), so
    the attention has one code path; ``cp_impl`` names the exchange (``ulysses`` | ``allgather``,
    ``ds_mp.context_parallel.attention``).  At cp = 1 nothing changes."""

    def __init__(self, topology: Topology, hf_config: Any, sequence_parallel: bool,
                 vocab_pad_multiple: int, cp_impl: str = DEFAULT_IMPL) -> None:
        self.topology, self.hf = topology, hf_config
        self.family: Family = family_of(hf_config)
        self.tp_rank, self.tp = topology.tp_rank, topology.tp
        self.sp = sequence_parallel and self.tp > 1
        self.cp_rank, self.cp = topology.cp_rank, topology.cp
        self.cp_balanced = balanced_for(cp_impl)  # raises on an unknown impl
        self.cp_impl = cp_impl
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

    @property
    def cp_group(self) -> Any:
        """The ranks that split this rank's rows (None at cp = 1)."""
        return self.topology.cp_group if self.cp > 1 else None

    def cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor | None, *,
                     windowed: bool = True, dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        """Attention of this CP rank's tokens over the whole row (``ds_mp.context_parallel.attention``):
        ``q`` ``(B, h, T/C, hd)`` and ``k``/``v`` ``(B, h_kv, T/C, hd)`` rotated at
        ``layout.local_positions()``; query head j reads key/value head ``kv_index[j]``, or
        ``j // (h / h_kv)`` when ``kv_index`` is None (``grouped_kv``); the layout's mask
        (``windowed``: with its window), additive in q's dtype (ulysses: the full row's, cached on the
        layout, or on a plain causal row none, SDPA's ``is_causal``; allgather: each chunk's built per
        call, ``Layout.run_mask``, and again in backward).  Returns ``(B, h, T/C, hd)``."""
        lay, Tl = self.layout, q.shape[2]
        if lay is None or lay.q_index is None or len(lay.q_index) != Tl:
            raise RuntimeError(f"context parallelism: the engine must set a Layout with q_index of this rank's "
                               f"{Tl} tokens before the forward")
        T, kw = lay.docs.shape[1], {"group": self.cp_group, "cp": self.cp, "cp_rank": self.cp_rank,
                                    "dropout_p": dropout_p, "scale": scale}
        if self.cp_impl == "allgather":
            return allgather_attention(q, k, v, kv_index, functools.partial(lay.run_mask, 2, windowed=windowed,
                                                                             dtype=q.dtype), **kw)
        mask = None if lay.causal_only(windowed) else lay.mask(T, T, windowed, q.dtype)
        return ulysses_attention(q, k, v, kv_index, mask, **kw)

    def dropout_rng(self) -> Any:
        """Dropout on sequence-sharded activations must differ per TP rank."""
        return parallel_region_rng() if self.sp else contextlib.nullcontext()


__all__ = ["Ctx"]
