"""Optimisation maths: LAMB, initialisation of a whole HF model, the LR range test."""

from ds_mp.optim.init import init_gpt2_weights
from ds_mp.optim.lamb import Lamb, param_groups_no_decay
from ds_mp.optim.lr_find import LRFindResult, lr_find

__all__ = ["Lamb", "param_groups_no_decay", "init_gpt2_weights", "lr_find", "LRFindResult"]
