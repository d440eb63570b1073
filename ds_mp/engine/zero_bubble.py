"""Engine side of ZB-H1: the split backward (B = input gradient, W = weight gradient).

Imported by the engine when the ``zb-h1`` schedule is selected (its spec names :func:`attach` as its runtime).

**B** runs DeepSpeed's own backward handler (``BackwardPass``: partitioned-gradient restore,
loss scaling by gradient accumulation and fp16/ZeRO, bf16 bookkeeping) inside a torch function
mode (:class:`_InputOnlyBackward`: scoped to the call and the thread, nothing is replaced) that
answers the handler's ``Tensor.backward`` with an input-only backward: the
autograd graph is walked once to find, for every parameter, the nodes where it meets the path
from the stage input to the output ("intermediates"); ``torch.autograd.grad`` then computes
only ``dX`` of the stage input (what ``SendGrad`` sends), keeping the graph and recording the
gradients arriving at those intermediates.  Parameters' gradients are not touched.

**W** continues from the recorded intermediates to the parameters (``torch.autograd.grad``
from those gradient edges, graph freed) and adds the results into ``.grad``; for bf16 the
low-precision gradients are then moved into DeepSpeed's fp32 master gradients, as its
backward handler does after every backward.  Since ∂L/∂θ = Σ over the intermediates of
(recorded gradient) · ∂(intermediate)/∂θ, B + W give the gradients of one full backward.

The graph walk and the two partial backwards are torch's own
(``torch.distributed.pipelining._backward``: ``construct_reverse_graph``, ``get_param_groups``,
``stage_backward_weight``; torch 2.13 pinned).  The first stage has no input gradient: its B
keeps the received output gradient and its W is DeepSpeed's whole backward.

Activation checkpointing: DeepSpeed's checkpoints (both kinds) refuse ``torch.autograd.grad``,
so the module switches to torch's non-reentrant checkpoint with DeepSpeed's model-parallel RNG
tracker restored for the recomputation (:func:`checkpoint`); B and W each recompute the
checkpointed forward.

With TP > 1 the column-parallel linear's backward is one custom autograd node computing dX (and
starting its all-reduce) and dW; B marks every such node with the gradients each pass needs
(:func:`_split_fused_nodes`), so B computes and all-reduces only dX, W only dW and db: the fused
backward's work is done once, as in 1F1B.

Two DeepSpeed behaviours the split must not trip over (each has a test that fails without its
guard, ``tests/test_zero_bubble.py``): every ``RecvGrad`` writes into the same gradient buffer,
and autograd hands a gradient on uncopied through residual adds, so B copies the received
gradient before recording anything (PP = 3); and DeepSpeed's forward hooks the stage outputs to
scale their gradient by 1/GAS outside its own backward, so B removes them once they ran, before
W can re-enter an output node (TP × PP = 2 × 2: the LM head's node returns the logits).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ds_mp import deepspeed_compat as compat
from ds_mp.deepspeed_compat.torch_private import (construct_reverse_graph, get_grad_fn_or_grad_acc, get_param_groups,
                                                  reverse_closure, stage_backward_weight)
from ds_mp.schedules.zero_bubble import BackwardInput, BackwardWeight
from ds_mp.engine_view import RuntimeEngine


class ZeroBubbleState:
    """ZB-H1's runtime: the B and W handlers (``instructions``) and the work a B left for its W,
    per pipe buffer (``pending``): the parameter groups with their recorded gradients (later
    stages), or the received output gradient (first stage)."""

    def __init__(self, engine: RuntimeEngine) -> None:
        self.engine = engine
        self.pending: dict[int, Any] = {}
        if engine.module.activation_checkpoint_interval > 0:  # DeepSpeed's checkpoints refuse torch.autograd.grad
            compat.use_activation_checkpoint(engine.module, checkpoint)

    def backward_input(self, buffer_id: int) -> None:
        e = self.engine
        if e.is_first_stage():  # nothing to send back: the whole backward runs as W
            # a copy: the next RecvGrad overwrites DeepSpeed's gradient buffer in place
            g = compat.received_grad(e)
            self.pending[buffer_id] = (g.clone() if isinstance(g, torch.Tensor) else None if g is None
                                       else [t.clone() for t in g])
            return
        weights = _weights(e)
        with _InputOnlyBackward(e, buffer_id, weights) as b:
            e.run_backward(buffer_id)
        self.pending[buffer_id] = b.groups
        if e.is_last_stage():  # W starts at the recorded gradients: let the graph above them go now
            drop_output_hooks(compat.pipe_buffers(e)["outputs"][buffer_id])
            compat.pipe_buffers(e)["outputs"][buffer_id] = None  # the logits (DeepSpeed drops the others')
            compat.release_loss_graph(e)

    def backward_weight(self, buffer_id: int) -> None:
        with self.engine.micro_layout(buffer_id):  # activation checkpointing recomputes the forward in W too
            self._backward_weight(buffer_id)

    instructions = {BackwardInput: "backward_input", BackwardWeight: "backward_weight"}

    def _backward_weight(self, buffer_id: int) -> None:
        e, work = self.engine, self.pending.pop(buffer_id)
        if e.is_first_stage():
            compat.set_received_grad(e, work)  # the output gradient B received
            e.run_backward(buffer_id)
            return
        bf16 = compat.uses_bf16_optimizer(e)
        if bf16:
            compat.drop_bf16_grads(e)
        stage_backward_weight(_weights(e), work)
        if bf16:  # into the fp32 master gradients, then cleared: a later B's epilogue must not add them again
            compat.copy_bf16_grads_to_master(e)
            compat.drop_bf16_grads(e)


def attach(engine: RuntimeEngine) -> ZeroBubbleState:
    """The runtime of a ZB-H1 engine (made by its spec, ``config.registry.ScheduleSpec.runtime``)."""
    return ZeroBubbleState(engine)


def checkpoint(function: Any, *args: Any) -> Any:
    """Activation checkpointing that ``torch.autograd.grad`` accepts (torch's non-reentrant
    checkpoint), recomputing with the RNG streams of the forward: torch restores the default
    generator, the context below DeepSpeed's model-parallel tracker (TP-local dropout).  Each
    backward graph task (B, then W) recomputes the segment."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    tracker, saved = get_cuda_rng_tracker(), {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved.update({k: v.clone() for k, v in tracker.get_states().items()})
        yield

    class Recompute:  # entered once per recomputation (B's and W's): a reusable context manager
        def __enter__(self) -> None:
            self.now = tracker.get_states()
            tracker.set_states({k: v.clone() for k, v in saved.items()})

        def __exit__(self, *exc: Any) -> None:
            tracker.set_states(self.now)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=lambda: (forward(), Recompute()))


def _stage_inputs(engine: RuntimeEngine, buffer_id: int) -> list[torch.Tensor]:
    inputs = compat.pipe_buffers(engine)["inputs"][buffer_id]
    inputs = inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def input_backward(outputs: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
                   weights: list[torch.Tensor]) -> list[dict]:
    """B: ``inputs[i].grad += ∂(Σ outputs·grads)/∂inputs[i]``; returns the parameter groups whose
    ``"grads"`` hold the gradients that reached each group's intermediates (W's starting point).
    The graph is kept (W walks it); the output side is released by the caller dropping ``outputs``."""
    pairs = [(o, torch.ones_like(o) if g is None else g) for o, g in zip(outputs, grads)
             if o.grad_fn is not None or o.requires_grad]
    roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
    root_nodes = [get_grad_fn_or_grad_acc(o) for o in roots]
    reverse = construct_reverse_graph(root_nodes)
    input_nodes = [get_grad_fn_or_grad_acc(x) for x in inputs]
    groups = get_param_groups(input_nodes, [get_grad_fn_or_grad_acc(w) for w in weights], reverse)
    fused = _split_fused_nodes({*reverse, *root_nodes}, reverse_closure(input_nodes, set(), reverse)[0])
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def record(grad_outputs: tuple, group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(record))
    try:
        dx = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(inputs, dx):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    for group in groups:  # intermediates no gradient reached (an unused branch) have no W work
        kept = [(n, g) for n, g in zip(group["intermediates"], group["grads"]) if g is not None]
        group["intermediates"], group["grads"] = [n for n, _ in kept], [g for _, g in kept]
    for node in fused:  # W: the other side
        node.split_grads = tuple(not x for x in node.split_grads)
    return groups


def _split_fused_nodes(nodes: set, input_closure: set) -> list[Any]:
    """Split the fused dX/dW backwards between B and W (``ds_mp.tensor_parallel.mappings.needed_grads``).

    Every custom-Function node of the graph that declares its edges (``ctx.edge_args``) gets
    ``split_grads``: for each edge, whether its gradient flows into the input closure (the nodes
    between the stage input and the outputs) — what B needs; after B it is flipped to W's side,
    the complement: W starts at the intermediates, and a gradient it would send back into the
    closure is never used (it reaches no weight of the group, or an intermediate whose recorded
    gradient replaces it).  Native nodes need none of this: autograd computes only the outputs a
    pass uses, a custom Function whatever its backward returns.  Returns the marked nodes."""
    marked = []
    for node in nodes:
        if node is not None and hasattr(node, "edge_args"):
            node.split_grads = tuple(fn is not None and fn in input_closure for fn, _ in node.next_functions)
            marked.append(node)
    return marked


class _InputOnlyBackward(TorchFunctionMode):
    """Inside (this thread, this ``with`` block only): a ``Tensor.backward`` call (as DeepSpeed's
    handler makes it) runs :func:`input_backward` on the buffer's stage inputs instead; calls with
    ``retain_graph`` (all outputs but the last) are gathered and run together with the last one.
    After the block ``groups`` holds W's starting point.

    A ``TorchFunctionMode`` is torch's own scoped interception (``Tensor.backward`` asks the mode
    stack before it runs): nothing is replaced, other threads and code after the block see torch's
    ``backward``.  Every other torch function passes through unchanged."""

    def __init__(self, engine: RuntimeEngine, buffer_id: int, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.engine, self.buffer_id, self.weights = engine, buffer_id, weights
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.groups: list[dict] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            return func(*args, **kwargs)
        self._backward(*args, **kwargs)
        return None

    def _backward(self, tensor: torch.Tensor, gradient: Any = None, retain_graph: bool | None = None,
                  create_graph: bool = False, inputs: Any = None) -> None:  # noqa: ARG002 - backward's signature
        if isinstance(gradient, (tuple, list)):  # DeepSpeed hands a one-tensor output its gradient as a tuple
            (gradient,) = gradient
        # A copy: DeepSpeed receives every gradient into the same buffer, and autograd passes it on
        # uncopied (residual adds), so the gradients recorded for W could alias it.
        self.calls.append((tensor, None if gradient is None else gradient.clone()))
        if retain_graph:
            return
        outs, grads = [t for t, _ in self.calls], [g for _, g in self.calls]
        self.calls.clear()
        self.groups = input_backward(outs, grads, _stage_inputs(self.engine, self.buffer_id), self.weights)
        drop_output_hooks(outs)


def drop_output_hooks(outputs: Any) -> None:
    """Remove the backward hooks DeepSpeed's forward put on a stage's outputs (its
    ``OutputBackwardHookManager``s, kept in the tensor's ``_backward_hook_managers``; DeepSpeed
    0.19).  They scale an output's gradient by 1/gradient-accumulation unless the running graph
    task is the engine's own backward; B ran them once.  W re-enters the graph at recorded
    gradients, and where a weight's consumer is the output node itself (the TP LM head: a single
    custom autograd node returns the logits) the hook would fire again in W's graph task and halve
    (1/GAS) that weight's gradient."""
    for t in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
        for manager in compat.output_hook_managers(t):
            manager.remove_hooks()


def _weights(engine: RuntimeEngine) -> list[torch.Tensor]:
    return [p for p in engine.module.parameters() if p.requires_grad]


__all__ = ["ZeroBubbleState", "attach", "input_backward"]
