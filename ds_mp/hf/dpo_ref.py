"""The reference log-probs and the evaluation of :class:`ds_mp.hf.dpo.DPOTrainer`, through ds_mp's engine.

Every pass here is one ``engine.eval_batch`` over ``gradient_accumulation_steps`` micro-batches per DP
replica in the training shape (``2 · per_device_train_batch_size`` rows of ``seq_len``), whose per-row
values (``engine.step_rows()``: policy and reference completion log-prob sums, every replica's) come
to every rank.  A *reference pass* is such a pass on the reference weights:

* ``adapters_off`` (``peft_config``): the policy engine with its LoRA path switched off (the base
  model, as TRL's ``use_adapter(model, None)``); no memory beyond the pass's activations;
* ``initial`` (a full fine-tune, or a ``PeftModel`` passed whole): the policy engine before its first
  step (so only precomputed; memory: two float columns per pair in the dataset);
* ``ref_model``: a second engine built from the ``ref_model`` with the same layout and config
  (:func:`reference_engine`); each rank holds its shard of the reference weights (1/(TP·PP) of the
  model, replicated over DP) for the trainer's life, so a dataset passed to ``evaluate()`` after
  training still gets its reference; no optimizer state is ever allocated for it (it never steps).

Passes are collective: every rank makes the same number, replica d reading batches d, d + DP, …
(:func:`plan`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ds_mp.engine_view import EngineView
from ds_mp.hf.compat import trl_hash_module_off
from ds_mp.hf.preference import micro_batch_means, pair_stats, pairs_loss, preference_rows
from ds_mp.hf.rows import empty_rows


@contextlib.contextmanager
def trl_builds_no_reference(args: Any) -> Iterator[None]:
    """Around ``trl.DPOTrainer.__init__``: TRL loads no second model and wraps none in DeepSpeed
    (``precompute_ref_log_probs`` is True for its constructor, whose precompute ds_mp defers), and
    does not hash the model's weights for its precompute cache (``hash_module``: ds_mp keeps no
    cache, and a model on the meta device has no weights to hash).  Restored after."""
    if args is None:
        yield
        return
    flag = args.precompute_ref_log_probs
    args.precompute_ref_log_probs = True
    try:
        with trl_hash_module_off():
            yield
    finally:
        args.precompute_ref_log_probs = flag


def reference_engine(trainer: Any, ref_model: Any) -> Any:
    """The engine of a user's ``ref_model`` (None without one): built like the policy's, same layout
    and DeepSpeed JSON (its ``"ds_mp"`` block, the loss included), evaluated only."""
    if ref_model is None:
        return None
    import ds_mp
    from ds_mp.hf.args import deepspeed_dict
    from ds_mp.hf.model_sync import model_and_source

    from ds_mp.hf.dpo import router_aux_config

    model, source = model_and_source(ref_model)
    raw = deepspeed_dict(trainer.args, model.config, trainer.ds_mp_rows_per_item)
    raw.pop("optimizer")  # evaluated only: no optimizer, no master copies
    with router_aux_config(model, False, 0.0):  # TRL's reference forward asks for no router logits
        engine, _, _, _ = ds_mp.initialize(model=source, config=raw)
    return engine


@contextlib.contextmanager
def _reference_weights(trainer: Any) -> Iterator[Any]:
    """The engine whose forward is the reference model (the LoRA path off for ``adapters_off``)."""
    if trainer._ds_mp_ref_engine is not None:
        yield trainer._ds_mp_ref_engine
    elif trainer._ds_mp_reference == "adapters_off":
        from ds_mp.engine.reference import lora_disabled

        with lora_disabled(trainer.ds_mp_engine):
            yield trainer.ds_mp_engine
    else:
        yield trainer.ds_mp_engine


def _pass_logps(engine: EngineView, micro_batches: list[dict]) -> torch.Tensor:
    """One ``eval_batch`` over this replica's ``micro_batches``: every replica's rows' completion
    log-prob sums (``step_rows()["logps"]``, replica-major)."""
    engine.eval_batch(iter(micro_batches), num_micro_batches=len(micro_batches))
    return engine.step_rows()["logps"].cpu()


def fill_reference(trainer: Any, rows: list[dict]) -> None:
    """Set ``ref_logps`` of this replica's step ``rows`` (in place) from a reference pass over them
    (:func:`ds_mp.engine.reference.ref_log_probs`)."""
    from ds_mp.engine.reference import ref_log_probs

    with _reference_weights(trainer) as engine:
        got = ref_log_probs(engine, rows)
    R = rows[0]["labels"].shape[0]
    for k, r in enumerate(rows):
        r["ref_logps"] = got[k * R:(k + 1) * R].to(r["ref_logps"].device, r["ref_logps"].dtype)


@dataclass(frozen=True)
class Slot:
    """One micro-batch of a pass: pairs ``start … start+count-1`` of the dataset, from batch
    ``batch`` (an eval step; -1: a filling micro-batch without pairs)."""

    batch: int
    start: int
    count: int


def plan(count: int, per_batch: int, pairs: int, dp: int, n: int) -> list[list[Slot]]:
    """Every replica's micro-batches over a dataset of ``count`` pairs read in order in batches of
    ``per_batch`` (batch i on replica i mod ``dp``), each batch cut into micro-batches of ``pairs``,
    filled to the same whole number of passes of ``n`` on every replica (the same on every rank)."""
    batches = [(i, s, min(per_batch, count - s)) for i, s in enumerate(range(0, count, per_batch))]
    mine = [[Slot(i, s + j, min(pairs, c - j)) for i, s, c in batches[d::dp] for j in range(0, c, pairs)]
            for d in range(dp)]
    passes = max(-(-len(m) // n) for m in mine)
    return [m + [Slot(-1, 0, 0)] * (passes * n - len(m)) for m in mine]


def _passes(trainer: Any, dataset: Any, per_batch: int) -> Iterator[tuple[list[Slot], list[dict]]]:
    """Each pass of :func:`plan` over ``dataset``: (every replica's slots, replica-major, as
    ``step_rows`` orders them; this replica's micro-batches, collated by TRL's collator)."""
    engine, topo = trainer.ds_mp_engine, trainer.ds_mp_topology
    pairs, seq_len, n = trainer.args.per_device_train_batch_size, engine.ds_mp_config.data.seq_len, engine.micro_batches
    table = plan(len(dataset), per_batch, pairs, topo.dp, n)

    def rows(slot: Slot) -> dict:
        feats = [dataset[k] for k in range(slot.start, slot.start + max(slot.count, 1))]
        batch = preference_rows(trainer.data_collator(feats), pairs, seq_len)
        return batch if slot.batch >= 0 else empty_rows(batch)
    for p in range(len(table[0]) // n):
        yield [s for m in table for s in m[p * n:(p + 1) * n]], [rows(s) for s in table[topo.dp_rank][p * n:(p + 1) * n]]


def with_reference_columns(trainer: Any, dataset: Any) -> Any:
    """``dataset`` with TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns (every pair's
    reference completion log-prob sums; collective, the same dataset on every rank)."""
    if dataset is None or len(dataset) == 0:
        return dataset
    pairs = trainer.args.per_device_train_batch_size
    ref = torch.zeros(len(dataset), 2, dtype=torch.float32)
    for slots, rows in _passes(trainer, dataset, pairs):
        with _reference_weights(trainer) as engine:
            logps = _pass_logps(engine, rows)
        for j, slot in enumerate(slots):
            got = logps[j * 2 * pairs:(j + 1) * 2 * pairs]
            ref[slot.start:slot.start + slot.count, 0] = got[:slot.count]
            ref[slot.start:slot.start + slot.count, 1] = got[pairs:pairs + slot.count]
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        if name in dataset.column_names:
            dataset = dataset.remove_columns(name)
    dataset = dataset.add_column("ref_chosen_logps", ref[:, 0].tolist())
    return dataset.add_column("ref_rejected_logps", ref[:, 1].tolist())


def raw_aux(carry: Any, carries: list[torch.Tensor]) -> list[float]:
    """HF's ``outputs.aux_loss`` (without the coefficient: TRL's ``aux_loss`` metric) of each carry, a
    micro-batch's or an eval step's pooled sums (``ds_mp.models.carry``); a carry without a kept token
    (a filling micro-batch) left out."""
    import dataclasses

    raw = dataclasses.replace(carry, coef=1.0)
    return [float(raw.loss(c)) for c in carries if float(c[-1]) > 0]


def evaluate_pairs(trainer: Any, dataset: Any) -> tuple[dict[str, float], int]:
    """(``loss`` and TRL's DPO metrics over ``dataset``, this replica's eval steps).  As TRL on one
    process: eval step i is ``per_device_eval_batch_size`` pairs, its loss the spec's mean over its
    pairs (:func:`pairs_loss`, from the rows), ``loss`` the pair-weighted mean over steps, each metric
    the mean over steps of the step's pair mean.  A MoE with TRL's aux loss on (a carry): each step's
    ``coef · aux`` over its whole ``[chosen; rejected]`` forward (its micro-batches' carries summed, the
    sums being linear) is added to its loss, and ``aux_loss`` is the mean over steps of its aux, as TRL
    logs it.  Collective."""
    topo, per_step = trainer.ds_mp_topology, trainer.args.per_device_eval_batch_size
    pairs = trainer.args.per_device_train_batch_size
    steps = -(-len(dataset) // per_step)
    stats = [torch.zeros(7, dtype=torch.float64) for _ in range(steps)]
    rows_of: list[list[torch.Tensor]] = [[] for _ in range(steps)]  # (chosen, rejected) × (logps, ref, count)
    carry = getattr(trainer.ds_mp_engine.module, "carry", None)
    pooled: list[torch.Tensor | None] = [None] * steps
    for slots, rows in _passes(trainer, dataset, per_step):
        if trainer._ds_mp_per_step:
            fill_reference(trainer, rows)
        trainer.ds_mp_engine.eval_batch(iter(rows), num_micro_batches=len(rows))
        got = {k: v.double().cpu() for k, v in trainer.ds_mp_engine.step_rows().items()}
        carries = trainer.ds_mp_engine.step_carries()  # (dp · M, size), replica-major as slots
        for j, slot in enumerate(slots):
            if slot.batch < 0:
                continue
            if carries is not None:
                c = carries[j].double().cpu()
                pooled[slot.batch] = c if pooled[slot.batch] is None else pooled[slot.batch] + c
            cut = slice(j * 2 * pairs, (j + 1) * 2 * pairs)
            has = got["targets"][cut] > 0
            real = has.chunk(2)[0] | has.chunk(2)[1]
            stats[slot.batch] += pair_stats(got["logps"][cut], got["ref_logps"][cut], real, trainer.beta)
            rows_of[slot.batch].append(torch.stack([got[k][cut].view(2, pairs)[:, real] for k in
                                                    ("logps", "ref_logps", "targets")]))
    spec, total, weight = trainer.ds_mp_engine.module.loss_spec, 0.0, 0
    for step, parts in enumerate(rows_of):
        if parts:
            x = torch.cat(parts, dim=2)  # (3, 2, n): [logps, ref, count] × [chosen, rejected] × pairs
            n = x.shape[2]
            term = 0.0 if pooled[step] is None else float(carry.loss(pooled[step]))
            total = total + n * (pairs_loss(spec, x[0].reshape(-1), x[1].reshape(-1), x[2].reshape(-1)) + term)
            weight = weight + n
    values = {"loss": total / weight if weight else float("nan"), **micro_batch_means(stats)}
    if carry is not None:
        aux = raw_aux(carry, [c for c in pooled if c is not None])
        values["aux_loss"] = sum(aux) / len(aux) if aux else float("nan")
    return values, len(range(topo.dp_rank, steps, topo.dp))


__all__ = ["trl_builds_no_reference", "reference_engine", "fill_reference", "with_reference_columns",
           "evaluate_pairs", "plan", "Slot"]
