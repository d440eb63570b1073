"""The loss's per-row values of a step, from the last stage to every rank (the reader of
:meth:`ds_mp.losses.spec.LossSpec.rows`).

A spec that names ``row_keys`` (DPO: each row's policy and reference log-probs) has its bound
``loss_fn`` record the rows of every micro-batch it computes; the engine starts a fresh record at
each step (``train_batch`` / ``eval_batch``, :func:`start`).  :func:`step_rows` then hands them, as
one ``(rows,)`` tensor per key on ``engine.device``, to every rank: the stage that computed the loss
(the last stage; ZB-V's rank 0) broadcasts them along its pipeline, and the DP replicas' rows are
gathered in replica order (replica 0's micro-batches, then replica 1's, …), each replica's in
micro-batch order.  Collective over the whole world; every TP rank computes the same rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_mp.engine_view import RuntimeEngine


def start(engine: RuntimeEngine) -> None:
    """A step begins: record its rows if the spec has any (else record nothing: the LM loss)."""
    engine.module.loss_fn.recorded = [] if engine.module.loss_spec.row_keys else None


def step_rows(engine: RuntimeEngine) -> dict[str, torch.Tensor]:
    """The last step's rows, ``{key: (dp · M · B,) float32}`` on every rank (module docstring);
    ``{}`` for a spec without ``row_keys``.  Collective: every rank calls it after the same step."""
    spec, topo = engine.module.loss_spec, engine.topology
    keys = spec.row_keys
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
    if engine.num_stages > 1:  # the stage that computed the loss is the one that recorded
        holds = torch.tensor([float(bool(recorded))], device=engine.device)
        every = [torch.zeros_like(holds) for _ in range(engine.num_stages)]
        dist.all_gather(every, holds, group=topo.pp_group)
        src = topo.pp_ranks()[int(torch.cat(every).argmax())]
        dist.broadcast(mine, src=src, group=topo.pp_group)
    if topo.dp > 1:
        parts = [torch.zeros_like(mine) for _ in range(topo.dp)]
        dist.all_gather(parts, mine, group=topo.dp_group)
        mine = torch.cat(parts, dim=1)
    return dict(zip(keys, mine))


__all__ = ["start", "step_rows"]
