"""Reference log-probs without a second model: a forward-only pass on the training engine.

DPO needs, for every row, the reference model's sum of completion-token log-probs (the spec's
``ref_logps`` extra, ``ds_mp.losses.dpo``).  :func:`ref_log_probs` runs the engine's own
``eval_batch`` (no graph, dropout off, the training batch shape, any schedule that has an
``eval_batch``) on a step's micro-batches and reads each row's policy log-prob back from the loss's
recorded rows (:func:`ds_mp.engine.rows.step_rows`).  Which weights answer is the caller's choice:

* a **full fine-tune**: call it before the first step, on every batch the run will read (the
  initial weights are the reference; the launcher and the Trainer's ``precompute_ref_log_probs``
  store the values with the data), costing one forward per batch and no memory beyond training's;
* **LoRA**: inside :func:`lora_disabled` the same engine is the base model (every LoRA branch scaled
  by 0: ``y = x W + b + 0``, exactly the base layer), so it can run per step as TRL's PEFT path does;
* a **separate reference model**: an engine of its own, built like the policy's (same TP × PP
  layout, so it costs one more shard of the weights per rank, without optimizer state).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ds_mp.engine_view import RuntimeEngine


@contextlib.contextmanager
def lora_disabled(engine: RuntimeEngine) -> Iterator[None]:
    """Inside, every LoRA layer of the engine's stage adds nothing (its ``scaling`` is 0; restored
    on exit): the forward is the base model's, bit for bit (PEFT's ``disable_adapter``)."""
    layers = [m for m in engine.module.modules() if hasattr(m, "lora_A") and hasattr(m, "scaling")]
    saved = [m.scaling for m in layers]
    for m in layers:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            m.scaling = s


@torch.no_grad()
def ref_log_probs(engine: RuntimeEngine, micro_batches: list[dict[str, Any]],
                  every_replica: bool = False) -> torch.Tensor:
    """Each row's sum of completion-token log-probs under the engine's current forward, for this
    rank's DP replica's ``micro_batches`` (dicts with ``input_ids`` and ``labels``, ``[chosen;
    rejected]`` rows): ``(M · B,)`` float32 on ``engine.device``, micro-batch after micro-batch,
    equal on every rank of the replica (``every_replica``: every replica's, ``(dp · M · B,)``
    replica after replica, on every rank).  Collective (every rank calls it with its replica's
    micro-batches of one step; ``M`` may differ from the run's accumulation steps).  The spec must
    record ``logps`` rows (DPO's); its ``ref_logps`` extra is filled with zeros for this pass."""
    if "logps" not in engine.module.loss_spec.row_keys:
        raise ValueError(f"ref_log_probs: the {engine.module.loss_spec.name!r} loss records no per-row log-probs; "
                         "use the 'dpo' loss")
    fed = [{**mb, "ref_logps": torch.zeros(mb["input_ids"].shape[0])} for mb in micro_batches]
    engine.eval_batch(iter(fed), num_micro_batches=len(fed))
    logps = engine.step_rows()["logps"]
    if every_replica:
        return logps
    n = logps.numel() // engine.topology.dp
    d = engine.topology.dp_rank
    return logps[d * n:(d + 1) * n]


__all__ = ["lora_disabled", "ref_log_probs"]
