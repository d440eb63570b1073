"""Layout-free training checkpoints: save at one TP × PP × DP, resume at any other.

``<root>/<tag>/`` is a sharded directory (:mod:`ds_mp.checkpoint.sharded`) with, besides
the model files,

* ``optim-ppSS-tpRR.safetensors``: each parameter's optimizer state under
  ``"<HF name>::<key>"`` (SGD ``momentum_buffer``, Adam ``exp_avg``/``exp_avg_sq``/``step``).
  A state tensor shaped like the parameter shard is cut by the parameter's own TP rule,
  so it reshards exactly like the weight; other tensors (``step``) are replicated;
  non-tensor entries go to the file's JSON metadata.
* ``trainer_state.pt``: optimizer hyper-parameters per group, the JSON's ``optimizer.params``
  (what the user changed since wins on resume: :mod:`~ds_mp.checkpoint.hparams`), LR scheduler
  state, the engine's step/sample counters and the caller's ``client_state`` (from global rank 0;
  tensors and plain values only: loaded with ``weights_only=True``).

Only DP replica 0 writes (replicas are identical); every rank loads and cuts its own
shard.  The save is atomic: ranks write into ``<tag>.tmp``, rank 0 renames it to ``<tag>``
after every rank reported success, and only then replaces the ``latest`` pointer.
Every file is listed with its size and CRC32C in ``ds_mp_manifest.json``
(:mod:`~ds_mp.checkpoint.integrity`), written last; a load checks each file it reads against
it first, and fails on every rank if it fails on any (no rank is left in a collective).

DeepSpeed's own ``engine.save_checkpoint`` is not used: its pipeline checkpoints keep one
file per layer per model-parallel rank and the optimizer state per model-parallel rank in
flat parameter order, and it re-splits only Megatron-named tensors when the degree changes.
With bf16 or ZeRO (DeepSpeed's flat-buffer optimizers) the model files hold the fp32
master weights and the optimizer files the fp32 state, gathered per parameter from the DP
partitions (``deepspeed.utils.safe_get_full_fp32_param`` and the fragment maps, see
``deepspeed_compat``) and set back the same way on load, so these checkpoints are
layout-free too (and interchangeable with fp32 ones for the same torch optimizer).
Nothing is unpickled beyond ``weights_only=True``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.atomic import commit_dir, fresh_dir, write_text_atomic
from ds_mp.checkpoint.hparams import apply_config_hparams, changed_hparams
from ds_mp.checkpoint.integrity import file_entries, load_torch, write_manifest
from ds_mp.checkpoint.latest import LATEST, damaged_latest, latest_tag, read_latest, resolve_checkpoint, tags as _tags
from ds_mp.checkpoint.sharded import (CheckpointError, ShardedReader, expected_shapes, lora_shapes,
                                      layout_kind, make_meta, shard_file, write_meta)
from ds_mp.checkpoint.schedule_state import layout_of, load_schedule_state, schedule_file, schedule_state
from ds_mp.models.pipeline import hf_param_name
from ds_mp.engine_view import EngineView

TRAINER_STATE = "trainer_state.pt"
__all__ = ["save_checkpoint", "load_checkpoint", "everywhere", "TRAINER_STATE", "NATIVE", "LATEST", "read_latest",
           "damaged_latest", "latest_tag", "resolve_checkpoint"]  # the latest pointer's names live in .latest


NATIVE = "ds_mp_native.json"  # marked the DeepSpeed-format checkpoints of older ds_mp (refused)


def _optimizer(engine: EngineView) -> torch.optim.Optimizer | None:
    return engine.optimizer


def _is_native(engine: EngineView) -> bool:
    """bf16/fp16/ZeRO wrap the optimizer in DeepSpeed's flat-buffer classes (fp32 master
    weights and optimizer state partitioned over DP in flat buffers)."""
    return engine.optimizer is not None and not isinstance(engine.optimizer, torch.optim.Optimizer)


def _base_optimizer(engine: EngineView) -> torch.optim.Optimizer | None:
    """The torch optimizer doing the update (the one a bf16/ZeRO wrapper holds)."""
    opt = engine.optimizer
    return opt.optimizer if _is_native(engine) else opt


def _params(engine: EngineView) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) for every parameter of this rank's stage."""
    return [(hf_param_name(n, engine.module), p) for n, p in engine.module.named_parameters()]


def _lora_meta(engine: EngineView) -> dict | None:
    """``{"r", "alpha", "target_modules"}`` (+ ``"target_parameters"`` when it adapts fused tensors) of a
    LoRA engine (its factors are saved and resumed like any parameter), None without LoRA."""
    lora = engine.module.ds_mp_ctx.lora
    if lora is None:
        return None
    meta = {"r": lora.r, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
    return {**meta, "target_parameters": list(lora.target_parameters)} if lora.target_parameters else meta


def everywhere(what: str, fn: Callable[[], Any], gather: bool = False) -> Any:
    """Run ``fn`` on this rank, then raise on every rank if it failed on any (collective: one
    ``all_gather_object``); ranks failing alike are listed once.  Returns ``fn``'s result, or
    with ``gather`` every rank's (in rank order).  ``fn`` itself must enter no collective: a
    rank that failed before it would leave its peers waiting there."""
    try:
        result, error, local = fn(), "", None
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        result, error, local = None, f"{type(e).__name__}: {e}", e
    outcomes = [(error, result if gather else None)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [("", None)] * dist.get_world_size()
        dist.all_gather_object(outcomes, (error, result if gather else None))
    failed: dict[str, list[str]] = {}
    for r, (e, _) in enumerate(outcomes):
        if e:
            failed.setdefault(e, []).append(str(r))
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(
            f"rank{'s' * (len(rs) > 1)} {','.join(rs)}: {e}" for e, rs in failed.items())) from local
    return [res for _, res in outcomes] if gather else result


def _rank_tensors(engine: EngineView, opt: Any) -> tuple[dict, dict, dict]:
    """This rank's (model, optimizer state, non-tensor extras) by HF name, in ds_mp's
    layout-free format.  For bf16/ZeRO the model tensors are the fp32 master weights and the
    state is gathered from the DP partitions (collective over each parameter's DP group:
    every DP rank calls it)."""
    topo, native = engine.topology, _is_native(engine)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    extras: dict[str, dict[str, Any]] = {}
    for name, p in _params(engine):
        slot = compat.fp16_slot(p, opt) if native and p.requires_grad else None
        if slot is not None:  # fp16 without ZeRO: the fp32 copy the torch optimizer steps, replicated
            holder, offset = slot
            master = compat.slot_view(holder, offset, p)
            entries = {k: compat.slot_view(v, offset, p) if torch.is_tensor(v) and v.shape == holder.shape else v
                       for k, v in opt.optimizer.state.get(holder, {}).items()}
        elif native and p.requires_grad:  # frozen (LoRA's base): no master, no state; the module weight
            from deepspeed.utils import safe_get_full_fp32_param

            master = safe_get_full_fp32_param(p)  # collective over the DP group
            entries = {k: compat.full_flat_state(p, opt, k) for k in compat.flat_state_keys(p, opt)}
            entries.update(compat.flat_state_extras(p, opt))
        else:
            master = p
            entries = dict(opt.state.get(p, {})) if opt is not None and not native else {}
        if name == engine.module.family.head_and_embedding()[1] and topo.pp_rank != 0:
            continue  # the tied copy on the last stage is identical; stored once on stage 0
        model[name] = master.detach().float().cpu().contiguous() if native else master.detach().cpu().contiguous()
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"{name}::{key}"] = value.detach().cpu().contiguous()
            else:
                extras.setdefault(name, {})[key] = value
    return model, state, extras


def _write_rank_files(tmp: str, topo: Any, tensors: tuple[dict, dict, dict], has_optimizer: bool) -> list[str]:
    """Write this rank's model (and optimizer) file; returns their paths."""
    from safetensors.torch import save_file

    model, state, extras = tensors
    paths = [shard_file(tmp, "model", topo.pp_rank, topo.tp_rank)]
    save_file(model, paths[0], metadata={"format": "pt"})
    if has_optimizer:
        paths.append(shard_file(tmp, "optim", topo.pp_rank, topo.tp_rank))
        save_file(state, paths[1], metadata={"format": "pt", "extras": json.dumps(extras)})
    return paths


def _trainer_state(engine: EngineView, opt: torch.optim.Optimizer | None, client_state: dict) -> dict:
    """``opt``: the torch optimizer doing the update (for bf16/ZeRO the wrapped one)."""
    topo, sched = engine.topology, engine.lr_scheduler
    return {"optimizer": type(opt).__name__ if opt is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt else [],
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "layout": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "cp": topo.cp},
            "loss_scaler": compat.loss_scaler_state(engine.optimizer), "client_state": client_state,
            "optimizer_hparams": getattr(engine, "optimizer_hparams", None)}  # the JSON's (checkpoint.hparams)


def _matching_groups(base: torch.optim.Optimizer, saved: list[dict], path: str,
                     decay_change: tuple | None = None) -> list[tuple[dict, dict]]:
    """Pair each engine parameter group with the saved hyper-parameters it resumes.

    The same number of groups pairs them in order.  Otherwise (schedules split groups their
    own way: Ouroboros keeps one group per module) each engine group takes the saved group with
    its weight decay, whose hyper-parameters (lr, betas, ...) every group shares; a weight decay
    the config changed (``decay_change``: its (saved, current) JSON values) is looked up as saved."""
    if len(saved) == len(base.param_groups):
        return list(zip(base.param_groups, saved))
    old_of = lambda wd: decay_change[0] if decay_change and wd == decay_change[1] else wd  # noqa: E731
    by_decay = {g.get("weight_decay"): g for g in reversed(saved)}
    missing = [g.get("weight_decay") for g in base.param_groups if old_of(g.get("weight_decay")) not in by_decay]
    if missing:
        raise CheckpointError(f"{path}: saved parameter groups have weight decay {sorted(by_decay)}, the engine's "
                              f"{sorted({g.get('weight_decay') for g in base.param_groups})}; resume with the same "
                              "optimizer config")
    return [(g, by_decay[old_of(g.get("weight_decay"))]) for g in base.param_groups]


def save_checkpoint(engine: EngineView, ckpt_root: str, tag: str, client_state: dict | None = None,
                    update_latest: bool = True) -> str:
    """Collective: write ``<ckpt_root>/<tag>`` and point ``<ckpt_root>/latest`` at it.

    ``client_state`` (data position, RNG states, ...) is taken from global rank 0 and
    returned by :func:`load_checkpoint`.  ``ckpt_root`` must be a filesystem every
    writing rank sees (rank 0 creates and renames the directory the others write into).
    Returns the checkpoint directory.
    """
    if not tag or "/" in tag or os.sep in tag or tag == LATEST or tag.endswith(".tmp"):
        raise CheckpointError(f"save_checkpoint: tag {tag!r} must be a plain name (no '/', not "
                              f"'{LATEST}', not ending in '.tmp'), e.g. 'step100'")
    opt, topo = _optimizer(engine), engine.topology
    final = os.path.join(os.path.abspath(ckpt_root), tag)
    tmp = final + ".tmp"

    def prepare() -> None:
        if topo.rank == 0:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            fresh_dir(tmp)

    tensors = _rank_tensors(engine, opt)  # collective for bf16/ZeRO (DP gathers), before any write

    def write() -> dict:
        """This rank's files; returns their manifest entries (read back while still cached)."""
        written = _write_rank_files(tmp, topo, tensors, opt is not None) if topo.grad_rank == 0 else []  # one copy
        extra = schedule_state(engine)
        if extra is not None:  # work a schedule keeps in flight across steps (Ouroboros), per rank
            torch.save({"layout": layout_of(engine), "state": extra}, schedule_file(tmp, topo))
            written.append(schedule_file(tmp, topo))
        if topo.rank == 0:
            meta = make_meta(engine.hf_config, topo.tp, compat.stage_bounds(engine.module),
                             engine.module.ds_mp_ctx.padded_vocab, has_optimizer=opt is not None,
                             layers=engine.module.layer_names, lora=_lora_meta(engine),
                             expert_layout=engine.module.ds_mp_ctx.expert_layout)
            write_meta(tmp, meta)
            torch.save(_trainer_state(engine, _base_optimizer(engine), client_state or {}),
                       os.path.join(tmp, TRAINER_STATE))  # meta, config.json, this: checksummed in commit
        return file_entries(written)

    def commit() -> None:
        if topo.rank == 0:  # the manifest last: every rank's entries, and rank 0's own files read here
            write_manifest(tmp, {name: e for rank_entries in written for name, e in rank_entries.items()})
            commit_dir(tmp, final, overwrite=True)
            if update_latest:
                write_text_atomic(os.path.join(os.path.dirname(final), LATEST), tag + "\n")

    everywhere(f"save_checkpoint({final!r}): preparing", prepare)
    written = everywhere(f"save_checkpoint({final!r}): writing", write, gather=True)
    everywhere(f"save_checkpoint({final!r}): committing", commit)
    return final


def _verify_reads(engine: EngineView, reader: ShardedReader, path: str) -> None:
    """Check, before the engine is touched, the whole of every file this rank will read: the
    saved shards overlapping its own (weights, and optimizer state of trainable parameters),
    ``trainer_state.pt`` and its schedule file.  A rank never reads a byte it has not
    checked; the cost is that a file of which it needs a slice is read whole (see
    :mod:`~ds_mp.checkpoint.integrity`)."""
    if reader.manifest is None:
        return
    topo, trains = engine.topology, engine.optimizer is not None
    family, padded = engine.module.family, engine.module.ds_mp_ctx.padded_vocab
    layout = engine.module.ds_mp_ctx.expert_layout
    files = {os.path.join(path, TRAINER_STATE)}
    for name, p in _params(engine):  # the shards the load below reads, with the same cut
        meta = {"n_head": family.heads(name, engine.hf_config), "padded_vocab": padded}
        files |= reader.files_of_shard(name, layout_kind(family, name, layout), topo.tp_rank, topo.tp, **meta,
                                       state=trains and p.requires_grad)
    for extra in (schedule_file(path, topo), schedule_file(path, topo, tp_rank=0)):  # its own, or TP rank 0's
        if os.path.isfile(extra):
            files.add(extra)
    reader.verify_files(files)


def load_checkpoint(engine: EngineView, ckpt_root: str, tag: str | None = None, verify: bool = True) -> dict:
    """Load weights, optimizer, scheduler and counters saved at any layout; return client_state.

    Each rank reads only the slices of the saved TP shards that overlap its own (TP rank,
    padded vocab) shard; optimizer state follows the same rule.  Collective: if the load
    fails on any rank it raises on every rank.  With ``verify`` (default) each rank first
    checks the CRC32C of every file it will read data from (whole files, against the
    manifest; see :mod:`~ds_mp.checkpoint.integrity`), before it changes the engine;
    ``verify=False`` skips the checks (a checkpoint too large to read twice).
    """
    where = os.path.join(ckpt_root, tag) if tag else f"{ckpt_root} ({LATEST})"
    return everywhere(f"load_checkpoint({where})", lambda: _load(engine, ckpt_root, tag, verify))


def _open_checked(engine: EngineView, ckpt_root: str, tag: str | None, verify: bool) -> tuple[str, ShardedReader]:
    """The checkpoint directory and its reader, refused with one line where it cannot resume this
    engine (missing, an old format, another model shape or LoRA, weights only, unreadable)."""
    opt = _optimizer(engine)
    pointed, tag = tag is None, tag or latest_tag(ckpt_root)
    path = os.path.join(ckpt_root, tag)
    if not os.path.isdir(path):
        found = ", ".join(_tags(ckpt_root)[-5:]) or "none"
        raise CheckpointError(f"{os.path.join(ckpt_root, LATEST)} names {tag!r}, but {path} does not exist; the "
                              f"checkpoint was removed or not copied: pass tag= one that exists (found: {found})"
                              if pointed else f"{path}: checkpoint directory not found; check ckpt_root and tag "
                              f"(found: {found})")
    if os.path.exists(os.path.join(path, NATIVE)):
        raise CheckpointError(f"{path}: a DeepSpeed-format bf16/ZeRO checkpoint of an older ds_mp; this ds_mp "
                              "reads only its layout-free format: resume it with the ds_mp that wrote it, or "
                              "start from its exported HF weights (runs/x/hf) with init_from")
    reader = ShardedReader(path, verify=verify)
    if expected_shapes(reader.config) != expected_shapes(engine.hf_config):
        raise CheckpointError(f"{path}: saved model shape (n_layer={reader.config.num_hidden_layers}, n_embd="
                              f"{reader.config.hidden_size}, vocab={reader.config.vocab_size}) differs from the engine's; "
                              "resume with the same model")
    saved, have = reader.lora, _lora_meta(engine)
    if (lora_shapes(reader.config, saved) != lora_shapes(engine.hf_config, have)  # the same factors, same scaling
            or (saved or {}).get("alpha") != (have or {}).get("alpha")):
        raise CheckpointError(f"{path}: saved with ds_mp.lora {saved or 'off'}, the engine has {have or 'off'}; "
                              "resume with the same LoRA r, alpha, target_modules and target_parameters")
    if opt is not None and not reader.meta.get("has_optimizer"):
        raise CheckpointError(f"{path}: holds weights only (no optimizer state); start from it with "
                              "ds_mp.training.init_from instead of resuming")
    _verify_reads(engine, reader, path)
    return path, reader


def _restore_state(p: torch.nn.Parameter, weight: torch.Tensor, state: dict, opt: Any, native: bool) -> None:
    """``p``'s fp32 master and optimizer state from its checkpoint shard, wherever the optimizer
    keeps them: fp16's fp32 copy, DeepSpeed's flat partitions (bf16/ZeRO), or ``opt.state``."""
    slot = compat.fp16_slot(p, opt) if native else None
    if slot is not None:  # fp16 without ZeRO: into the fp32 copy its torch optimizer steps
        holder, offset = slot
        compat.slot_view(holder, offset, p).copy_(weight.float())
        held = opt.optimizer.state[holder]
        for key, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                if key not in held:
                    held[key] = torch.zeros_like(holder)
                compat.slot_view(held[key], offset, p).copy_(v.float())
            else:
                held[key] = v.clone() if torch.is_tensor(v) else v
        return
    if native:  # fp32 master + state into this DP rank's fragments of the flat partitions
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(p, weight.float())
        for key, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                compat.set_flat_state(p, opt, key, v.float())
        compat.set_flat_state_extras(p, opt, {k: v for k, v in state.items()
                                              if not (torch.is_tensor(v) and v.shape == p.shape)})
        return
    state = {k: v.to(p.device) if torch.is_tensor(v) and v.shape == p.shape else v for k, v in state.items()}
    opt.state.pop(p, None)
    if state:
        opt.state[p] = state


def _load(engine: EngineView, ckpt_root: str, tag: str | None, verify: bool) -> dict:
    """:func:`load_checkpoint` on this rank; enters no collective (it runs inside ``everywhere``)."""
    opt, topo = _optimizer(engine), engine.topology
    path, reader = _open_checked(engine, ckpt_root, tag, verify)
    trainer = load_torch(os.path.join(path, TRAINER_STATE), reader.manifest)
    base = _base_optimizer(engine)
    if base is not None and trainer["optimizer"] != type(base).__name__:
        raise CheckpointError(f"{path}: saved with optimizer {trainer['optimizer']}, the engine has "
                              f"{type(base).__name__}; resume with the same optimizer config")
    changed = changed_hparams(trainer.get("optimizer_hparams"), getattr(engine, "optimizer_hparams", None))
    groups = ([] if base is None else
              _matching_groups(base, trainer["param_groups"], path, changed.get("weight_decay")))
    family, padded = engine.module.family, engine.module.ds_mp_ctx.padded_vocab
    layout, native = engine.module.ds_mp_ctx.expert_layout, _is_native(engine)
    with torch.no_grad():  # each rank reads only the slices of its own shards
        for name, p in _params(engine):
            kind, meta = layout_kind(family, name, layout), {"n_head": family.heads(name, engine.hf_config), "padded_vocab": padded}
            weight = reader.get_shard(name, kind, topo.tp_rank, topo.tp, **meta)
            p.copy_(weight)  # a bf16 module weight: the master rounded, as DeepSpeed keeps it
            if opt is None or not p.requires_grad:  # frozen (LoRA's base): no master, no optimizer state
                continue
            _restore_state(p, weight, reader.get_state_shard(name, kind, topo.tp_rank, topo.tp, **meta), opt, native)
    built = [{k: v for k, v in group.items() if k != "params"} for group, _ in groups]  # from this run's config
    for group, saved in groups:
        group.update(saved)
    note = apply_config_hparams([(g, b) for (g, _), b in zip(groups, built)], changed, engine.lr_scheduler is not None)
    if note and topo.rank == 0:
        print(f"ds_mp: resume from {path}: {note}", file=sys.stderr)
    if trainer.get("loss_scaler") is not None:  # fp16: resume at the scale and counters it had
        compat.set_loss_scaler_state(engine.optimizer, trainer["loss_scaler"])
    if engine.lr_scheduler is not None and trainer["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
    compat.set_step_counters(engine, trainer["global_steps"], trainer["global_samples"], trainer["skipped_steps"])
    load_schedule_state(engine, path, reader.manifest, trainer.get("layout"))
    return trainer["client_state"]
