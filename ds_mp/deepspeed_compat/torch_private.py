"""torch's private split backward (``torch.distributed.pipelining._backward``, torch 2.13), which
ZB-H1's B and W passes are built on: the one place ds_mp imports a private torch module.

``construct_reverse_graph`` / ``get_param_groups`` / ``reverse_closure`` find, for every
parameter, the autograd nodes where it meets the path from the stage input to the output;
``stage_backward_weight`` continues a backward from gradients recorded there to the parameters.
A torch without them fails at import with one line naming the module and the fix.
"""
from __future__ import annotations

try:
    from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc as get_grad_fn_or_grad_acc,
                                                         construct_reverse_graph, get_param_groups, reverse_closure,
                                                         stage_backward_weight)
except ImportError as e:  # pragma: no cover - depends on the installed torch
    import torch

    raise ImportError(f"torch {torch.__version__}: torch.distributed.pipelining._backward lacks a function ds_mp's "
                      f"ZB-H1 relies on ({e}); install the torch pinned in pyproject.toml") from e

__all__ = ["get_grad_fn_or_grad_acc", "construct_reverse_graph", "get_param_groups", "reverse_closure",
           "stage_backward_weight"]
