"""The module maths of Ouroboros on ds_mp's pipeline layers: which layers form each module G_m on
a ring rank, the optimizer groups that follow them, replaying a forward under its captured RNG
state, and the small tensor helpers of the delayed backward (used by ``engine/ouroboros.py``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn

from ds_mp import deepspeed_compat as compat
from ds_mp.schedules.ouroboros.timetable import config_split, ring_layout
from ds_mp.tensor_parallel.random import rng_state, set_rng_state


@contextlib.contextmanager
def replayed(state: dict | None) -> Iterator[None]:
    """Run the body on the captured RNG ``state`` (every stream ds_mp draws dropout from); the
    ambient streams are left as they were."""
    if state is None:
        yield
        return
    ambient = rng_state()
    set_rng_state(state)
    try:
        yield
    finally:
        set_rng_state(ambient)


def leaf(x: Tensor) -> Tensor:
    return x.detach().requires_grad_(x.is_floating_point())


def accumulate(total: list[Tensor] | None, grads: tuple[Tensor, ...] | list[Tensor]) -> list[Tensor]:
    """total + grads elementwise (in place into total); ``grads`` as a list when total is None."""
    if total is None:
        return list(grads)
    for acc, g in zip(total, grads):
        acc.add_(g)
    return total


class ModuleLayers(nn.Module):
    """The pipeline layers of one module G_m as one ``nn.Module`` (a tied layer is a partial over
    the tied module), so ``torch.func.functional_call`` can run them on other weights."""

    def __init__(self, funcs: list) -> None:
        super().__init__()
        owners: dict[int, nn.Module] = {}
        for f in funcs:
            module = f if isinstance(f, nn.Module) else f.args[0]
            owners.setdefault(id(module), module)
        self.owners = nn.ModuleList(owners.values())
        self.funcs = list(funcs)

    def forward(self, x: Any) -> Tensor:
        for f in self.funcs:
            x = f(x)
        return x


class SampleLayouts:
    """The attention layouts (``ds_mp.models.batch.Layout`` or None per micro-batch) of the samples
    still in flight: a delayed replay of sample s attends as its forward did, iterations later."""

    def __init__(self, ctx: Any, keep: int) -> None:
        self.ctx, self.keep = ctx, keep  # samples older than the newest - keep are done on every module
        self.by_sample: dict[int, list] = {}

    def record(self, s: int, layouts: list) -> None:
        if s not in self.by_sample:
            self.by_sample[s] = list(layouts)
            for old in [k for k in self.by_sample if k < s - self.keep]:
                del self.by_sample[old]

    def of(self, s: int, j: int | None, rows: list[int]) -> Any:
        """Micro-batch j's layout of sample s, or (j None) the micro-batches' rows concatenated."""
        from ds_mp.models.batch import Layout

        layouts = self.by_sample.get(s) or [None] * len(rows)
        if j is not None:
            return layouts[j] if j < len(layouts) else None
        given = [lay for lay in layouts if lay is not None]
        if not given:
            return None
        T, dev = given[0].positions.shape[1], given[0].positions.device
        plain = [lay or Layout(torch.arange(T, device=dev).expand(n, T), torch.zeros(n, T, dtype=torch.long, device=dev))
                 for lay, n in zip(layouts, rows)]  # a micro-batch without one: one document per row
        return Layout(torch.cat([lay.positions for lay in plain]), torch.cat([lay.docs for lay in plain]), self.ctx.window)

    def state_dict(self) -> list:
        return [[s, [None if lay is None else (lay.positions.cpu(), lay.docs.cpu()) for lay in layouts]]
                for s, layouts in self.by_sample.items()]

    def load_state_dict(self, state: list, device: Any) -> None:
        from ds_mp.models.batch import Layout

        self.by_sample = {s: [None if lay is None else Layout(lay[0].to(device), lay[1].to(device), self.ctx.window)
                              for lay in layouts] for s, layouts in state}


def module_ranges(net: Any, cfg: Any, stage_id: int) -> dict[int, tuple[int, int]]:
    """Module index m -> the range [a, b) of the local layers of ``net`` (ring rank ``stage_id``'s
    pipeline layers) that forms G_m: ring rank 0 holds [the family's lead layers (GPT-2: wte, wpe),
    G_0 blocks, G_{K-1} blocks, its tail layers (norm, head)], rank r the blocks of G_r."""
    K, n = cfg.pipeline.stages + 1, len(compat.local_layers(net))
    if stage_id == 0:
        n0 = net.family.lead_layers + len(config_split(cfg, net.ds_mp_ctx.hf)[0])
        return {0: (0, n0), K - 1: (n0, n)}
    return {ring_layout(K)[stage_id][0]: (0, n)}


def param_group_keys(net: Any, cfg: Any, stage_id: int) -> dict[int, tuple[int, ...]]:
    """id(parameter) -> the modules G_m holding it (two for the tied V on ring rank 0).

    The optimizer's parameter groups are split by this key, so a module still in warm-up (no
    gradient yet) is a group of its own that the update can leave out whole: DeepSpeed's bf16
    optimizer steps one flat fp32 partition per group, with one Adam step counter per group.
    """
    keys: dict[int, list[int]] = {}
    for m, (a, b) in sorted(module_ranges(net, cfg, stage_id).items()):
        for p in ModuleLayers(compat.local_layers(net)[a:b]).parameters():
            keys.setdefault(id(p), []).append(m)
    return {k: tuple(v) for k, v in keys.items()}


Holders = dict[int, list[tuple[int, int]]]  # id(p) -> [(module index, position in its parameters())]


def grad_holders(modules: Iterable[nn.Module] | dict) -> Holders:
    """Where each parameter sits in the modules holding it (two entries for the tied V).
    ``modules``: index -> module or parameter list (or a list of modules).  Built once."""
    items = modules.items() if isinstance(modules, dict) else enumerate(modules)
    out: Holders = {}
    for m, module in items:
        params = list(module.parameters()) if isinstance(module, nn.Module) else module
        for i, q in enumerate(params):
            out.setdefault(id(q), []).append((m, i))
    return out


def module_grad_sum(p: nn.Parameter, holders: Holders, grads: dict[int, list[Tensor]],
                    tie_scale: float) -> Tensor | None:
    """Step 4's gradient of ``p``: Σ over the modules holding p of their gradient (zero for a
    module in warm-up, i.e. absent from ``grads``), times ``tie_scale`` when two modules hold p
    (the tied V); None when no module holding p has a gradient yet.  ``grads``: module index ->
    gradients in ``parameters()`` order; ``holders`` from :func:`grad_holders`.  The sum is
    formed in place in the first module's gradient tensor (``grads`` is consumed)."""
    where = holders[id(p)]
    real = [grads[m][i] for m, i in where if m in grads]
    if not real:
        return None
    total = real[0]
    for g in real[1:]:
        total += g
    return total.mul_(tie_scale) if len(where) == 2 else total


__all__ = ["Holders", "grad_holders", "module_grad_sum", "replayed", "leaf", "accumulate", "ModuleLayers", "SampleLayouts", "module_ranges", "param_group_keys"]
