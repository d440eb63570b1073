"""LoRA on the tensor-parallel layers, sharded consistently with the frozen base weight.

LoRA (Hu et al. 2021, as PEFT implements it for GPT-2's ``Conv1D`` with ``fan_in_fan_out``):

    y = x W + b + s · dropout(x) Aᵀ Bᵀ,      A: (r, in), B: (out, r), s = alpha / r.

ds_mp stores both factors in the ``Conv1D`` layout of the base, ``lora_A = Aᵀ`` (in, r) and
``lora_B = Bᵀ`` (r, out), so they shard with the same :func:`~ds_mp.tensor_parallel.sharding.shard`
kinds as the base weight:

* column-parallel base (``W = [W_1 … W_p]``, ``qkv`` per head for ``c_attn``): ``lora_A``
  replicated, ``lora_B`` split like ``W`` along ``out`` (``column`` / ``qkv``).  Rank r computes
  ``u = dropout(x) lora_A`` (identical on every rank) and ``y_r += s · u lora_B_r``: exactly its
  output columns.  ``u`` passes through ``copy_to_tp`` (f), so in backward the ranks' partial
  ``dU`` (each from its own columns) are summed: ``dA`` is the full gradient on every rank and
  ``dx`` gets the full LoRA term once, before the base layer's own f.
* row-parallel base (``W = [W_1; …; W_p]``, input ``x_r`` = rank r's slice of ``x``): ``lora_A``
  split like ``W`` along ``in`` (``row``), ``lora_B`` replicated.  ``u = Σ_r dropout(x_r) lora_A_r``
  through ``reduce_from_tp`` (g: one all-reduce of an (…, r) tensor), then ``y += s · u lora_B``
  after the base's all-reduce.  ``dU = s · dy lora_Bᵀ`` is replicated, so each rank's ``dA_r`` is
  its rows of the full gradient.

Only the factors train: the caller freezes the base.  Sequence parallelism is refused by the
config check (the replicated factor would see a slice of tokens per rank).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ds_mp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, tp_parameter
from ds_mp.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from ds_mp.tensor_parallel.random import parallel_region_rng

__all__ = ["lora_init", "LoRAColumnParallelLinear", "LoRARowParallelLinear"]


def lora_init(n_in: int, n_out: int, r: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Full ``(lora_A, lora_B)`` = ``(Aᵀ, Bᵀ)`` with PEFT's default init: A ~ kaiming_uniform(a=√5)
    = U(−1/√in, 1/√in), B = 0 (so training starts exactly at the base model)."""
    bound = 1.0 / math.sqrt(n_in)
    a = (torch.rand(r, n_in, generator=generator) * 2 - 1) * bound
    return a.t().contiguous(), torch.zeros(r, n_out)


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` + LoRA; ``lora_A`` (in, r) replicated, ``lora_B`` (r, out/p)
    sharded with the base's ``kind`` (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Any, rank: int, size: int, *,
                 lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, dropout: float = 0.0,
                 kind: str = "column", n_head: int = 0) -> None:
        super().__init__(weight, bias, group, rank, size, kind=kind, n_head=n_head)
        self.lora_A = tp_parameter(lora_A, "replicated", rank, size)
        self.lora_B = tp_parameter(lora_B, kind, rank, size, n_head=n_head)
        self.scaling, self.lora_dropout = scaling, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        u = F.dropout(x, self.lora_dropout, self.training) @ self.lora_A  # same mask on every TP rank
        return y + (copy_to_tp(u, self.group) @ self.lora_B) * self.scaling


class LoRARowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` + LoRA; ``lora_A`` (in/p, r) sharded by rows, ``lora_B`` (r, out)
    replicated (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Any, rank: int, size: int, *,
                 lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, dropout: float = 0.0) -> None:
        super().__init__(weight, bias, group, rank, size)
        self.lora_A = tp_parameter(lora_A, "row", rank, size)
        self.lora_B = tp_parameter(lora_B, "replicated", rank, size)
        self.scaling, self.lora_dropout = scaling, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        with parallel_region_rng():  # each rank drops its own slice of the input
            xd = F.dropout(x, self.lora_dropout, self.training)
        u = reduce_from_tp(xd.reshape(-1, xd.shape[-1]) @ self.lora_A, self.group).view(*x.shape[:-1], -1)
        return y + (u @ self.lora_B) * self.scaling
