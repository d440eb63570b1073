"""Optimisation helpers: LAMB, warm-up + cosine schedule, GPT-2 init, lr range test."""

from ds_mp.optim.init import init_gpt2_weights
from ds_mp.optim.lamb import Lamb, param_groups_no_decay
from ds_mp.optim.lr_find import LRFindResult, lr_find
from ds_mp.optim.schedule import MEGATRON_GPT2, WarmupCosineLR, warmup_cosine

__all__ = [
    "Lamb",
    "param_groups_no_decay",
    "warmup_cosine",
    "WarmupCosineLR",
    "MEGATRON_GPT2",
    "init_gpt2_weights",
    "lr_find",
    "LRFindResult",
]
