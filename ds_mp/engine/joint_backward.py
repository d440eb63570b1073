"""The engine's side of the carry (``ds_mp.models.carry``): one backward for a stage whose output is a tuple
(the hidden state and the carry), and the carry's loss weight per step.

DeepSpeed's backward handler calls ``out.backward(grad, retain_graph=True)`` once per floating output of
a tuple.  Two graph tasks over one graph break DeepSpeed's reentrant activation checkpoint (its node
frees what it saved in the first task and fails in the second) and walk the shared graph twice.
:class:`JointBackward` gathers those calls and runs them as one: ``Σ_i <out_i, grad_i>`` backpropagated
once, whose gradient with respect to each ``out_i`` is ``grad_i`` exactly (a product with 1, then a sum
of disjoint terms), so every weight receives the same gradient as from the separate calls.  It is torch's
scoped interception (a ``TorchFunctionMode``, as ZB-H1's ``_InputOnlyBackward``): nothing is replaced, and
an outer mode (ZB-H1's) sees the one joint ``backward``.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch.overrides import TorchFunctionMode


class JointBackward(TorchFunctionMode):
    """Inside: ``Tensor.backward`` calls with ``retain_graph`` are held and run with the next call
    without it, as one backward of ``Σ_i (out_i · grad_i).sum()``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            return func(*args, **kwargs)
        tensor, gradient = args[0], (args[1] if len(args) > 1 else kwargs.get("gradient"))
        if isinstance(gradient, (tuple, list)):  # DeepSpeed hands a one-tensor output its gradient as a tuple
            (gradient,) = gradient
        self.calls.append((tensor, gradient))
        if kwargs.get("retain_graph") or (len(args) > 2 and args[2]):
            return None
        calls, self.calls = self.calls, []
        if len(calls) == 1:
            return func(*args, **kwargs)
        root = sum((t * g).sum() if g is not None else t.sum() for t, g in calls if t.requires_grad)
        root.backward()  # the mode is off inside its own handler: an outer mode (ZB-H1) sees this call
        return None


def joint_backward(module: Any) -> ContextManager:
    """:class:`JointBackward` where ``module`` (the pipeline stage) carries a carry, else nothing."""
    return JointBackward() if getattr(module, "carry", None) is not None else contextlib.nullcontext()


def checked_reduction(how: str) -> str:
    """``how`` if it names an aux-loss reduction over a step ("mean" or "sum")."""
    if how not in ("mean", "sum"):
        raise ValueError(f"aux_reduction: {how!r} is not 'mean' or 'sum'")
    return how


def carry_step(module: Any, micro_batches: int, how: str, training: bool = True) -> None:
    """Before a step of ``micro_batches`` (M · g: every replica's): the carry's loss weight on the stage's
    ``Ctx`` (``models.carry.CarriedLoss``): 1 for "mean", M · g for "sum" (undoing DeepSpeed's 1/M and its
    mean over the g gradient replicas); 0 in an eval step (``training`` False: its loss is the LM part, the
    carries are recorded for ``engine.step_carries()``, ``ds_mp.engine.rows``)."""
    ctx = getattr(module, "ds_mp_ctx", None)
    if ctx is not None:
        ctx.carry_weight = 0.0 if not training else float(micro_batches) if how == "sum" else 1.0


__all__ = ["JointBackward", "joint_backward", "checked_reduction", "carry_step"]
