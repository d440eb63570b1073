"""The loss's per-row values of a step, and an eval step's per-micro-batch carries, from the last
stage to every rank (the readers of :meth:`ds_mp.losses.spec.LossSpec.rows` and of
``ds_mp.models.carry.CarriedLoss.carried``).

A spec that names ``row_keys`` (DPO: each row's policy and reference log-probs) has its bound
``loss_fn`` record the rows of every micro-batch it computes; a model with a carry (a MoE's router
sums, ``ds_mp.models.carry``) has its ``loss_fn`` record each micro-batch's carry in eval steps.  The
engine starts a fresh record at each step (``train_batch`` / ``eval_batch``, :func:`start`).
:func:`step_rows` then hands the rows, as one ``(rows,)`` tensor per key on ``engine.device``, and
:func:`step_carries` the carries, as one ``(micro-batches, carry size)`` tensor, to every rank: the
stage that computed the loss (the last stage; ZB-V's rank 0) broadcasts them along its pipeline, and
the DP replicas' values are gathered in replica order (replica 0's micro-batches, then replica 1's,
…), each replica's in micro-batch order.  Collective over the whole world; every TP rank computes
the same values.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_mp.engine_view import RuntimeEngine


def start(engine: RuntimeEngine, training: bool = True) -> None:
    """A step begins: record its rows if the spec has any (else record nothing: the LM loss), and, in
    an eval step (``training`` False) of a model with a carry, its carries (in a training step too where
    ``loss_fn.record_training``: ``ds_mp.hf.DPOTrainer``'s ``aux_loss`` metric)."""
    loss_fn = engine.module.loss_fn
    loss_fn.recorded = [] if engine.module.loss_spec.row_keys else None
    if hasattr(loss_fn, "carried"):
        loss_fn.carried = [] if not training or loss_fn.record_training else None


def _everywhere(engine: RuntimeEngine, mine: torch.Tensor, holds: bool) -> torch.Tensor:
    """``mine`` (``(k, n)``) of the pipeline stage that ``holds`` it, on every rank of its pipeline,
    then the DP replicas' side by side: ``(k, dp · n)`` in replica order."""
    topo = engine.topology
    if engine.num_stages > 1:  # the stage that computed the loss is the one that recorded
        flag = torch.tensor([float(holds)], device=engine.device)
        every = [torch.zeros_like(flag) for _ in range(engine.num_stages)]
        dist.all_gather(every, flag, group=topo.pp_group)
        src = topo.pp_ranks()[int(torch.cat(every).argmax())]
        dist.broadcast(mine, src=src, group=topo.pp_group)
    if topo.dp > 1:
        parts = [torch.zeros_like(mine) for _ in range(topo.dp)]
        dist.all_gather(parts, mine, group=topo.dp_group)
        mine = torch.cat(parts, dim=1)
    return mine


def step_rows(engine: RuntimeEngine) -> dict[str, torch.Tensor]:
    """The last step's rows, ``{key: (dp · M · B,) float32}`` on every rank (module docstring);
    ``{}`` for a spec without ``row_keys``.  Collective: every rank calls it after the same step."""
    keys = engine.module.loss_spec.row_keys
    if not keys:
        return {}
    recorded = engine.module.loss_fn.recorded or []
    n_rows = len(engine.step_info.layouts) * engine.step_info.shape[0]  # M micro-batches of B rows
    mine = torch.zeros(len(keys), n_rows, dtype=torch.float32, device=engine.device)
    if recorded:
        got = torch.stack([torch.cat([r[k].float() for r in recorded]) for k in keys]).to(engine.device)
        if got.shape[1] != n_rows:
            raise RuntimeError(f"loss rows: {got.shape[1]} recorded on this stage, the step has {n_rows}")
        mine = got
    return dict(zip(keys, _everywhere(engine, mine, bool(recorded))))


def step_carries(engine: RuntimeEngine) -> torch.Tensor | None:
    """The last eval step's carries (or training step's, where recorded: :func:`start`), ``(dp · M, size)`` float32 on every rank, row ``d · M + i`` replica
    d's micro-batch i (module docstring); None for a model without a carry.  Collective: every rank
    calls it after the same eval step."""
    carry = getattr(engine.module, "carry", None)
    if carry is None:
        return None
    carried = getattr(engine.module.loss_fn, "carried", None) or []
    n = len(engine.step_info.layouts)  # M micro-batches
    mine = torch.zeros(carry.size, n, dtype=torch.float32, device=engine.device)
    if carried:
        if len(carried) != n:
            raise RuntimeError(f"carries: {len(carried)} recorded on this stage, the eval step has {n} micro-batches")
        mine = torch.stack(carried, dim=1).to(engine.device)
    return _everywhere(engine, mine, bool(carried)).t().contiguous()


__all__ = ["start", "step_rows", "step_carries"]
