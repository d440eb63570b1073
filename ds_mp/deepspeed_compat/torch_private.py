"""torch's private split backward (``torch.distributed.pipelining._backward``, torch 2.13), which
ZB-H1's B and W passes are built on, and the enclosing saved-tensor hooks (autograd's private
``_top_saved_tensors_default_hooks``): the one place ds_mp imports private torch names.

``construct_reverse_graph`` / ``get_param_groups`` / ``reverse_closure`` find, for every
parameter, the autograd nodes where it meets the path from the stage input to the output;
``stage_backward_weight`` continues a backward from gradients recorded there to the parameters.
:func:`enclosing_saved_tensors_hooks` is the innermost ``saved_tensors_hooks`` pair in effect, so
hooks installed inside it (CP's ``allgather`` attention) can hand the tensors they do not rebuild to
it (the held-memory census, torch's non-reentrant activation checkpoint).
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


try:
    from torch._C._autograd import _top_saved_tensors_default_hooks
except ImportError as e:  # pragma: no cover - depends on the installed torch
    import torch

    raise ImportError(f"torch {torch.__version__}: torch._C._autograd lacks _top_saved_tensors_default_hooks, which "
                      f"CP's allgather attention relies on ({e}); install the torch pinned in pyproject.toml") from e


def enclosing_saved_tensors_hooks() -> tuple | None:
    """The innermost ``torch.autograd.graph.saved_tensors_hooks`` (pack, unpack) pair in effect, or None."""
    return _top_saved_tensors_default_hooks(False)


__all__ = ["enclosing_saved_tensors_hooks", "get_grad_fn_or_grad_acc", "construct_reverse_graph", "get_param_groups",
           "reverse_closure", "stage_backward_weight"]
