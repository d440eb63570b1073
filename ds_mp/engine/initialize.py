"""Wiring behind :func:`ds_mp.initialize`: distributed init, config, model, engine."""
from __future__ import annotations

import atexit
import copy
import os
from typing import TYPE_CHECKING, Any

import torch

from ds_mp import deepspeed_compat as compat
from ds_mp.config import (ConfigError, DsMpConfig, check_deepspeed_blocks, load_config, read_json, shape_of,
                          validate_model)
from ds_mp.config.resolve import OBJECT
from ds_mp.engine.optimizer import optimizer_setup
from ds_mp.models.cost_profile import PROFILE_NAME, agreed_layer_costs
from ds_mp.models.family import causal_lm_family, inline_config
from ds_mp.models.partition import LayerCosts
from ds_mp.models.pipeline import build_pipeline
from ds_mp.config.losses import configured_loss
from ds_mp.models.weights import WeightSource, fresh_source
from ds_mp.config.registry import schedule_spec
from ds_mp.topology import Topology

if TYPE_CHECKING:
    from ds_mp.engine.pipeline_engine import DsMpPipelineEngine


def init_distributed(timeout_s: float | None = None) -> None:
    """``deepspeed.init_distributed`` with a bounded collective timeout.

    The timeout (``DS_MP_TIMEOUT`` seconds, default 300) makes a dead peer fail the job
    instead of hanging it.  DeepSpeed's shared-memory all-reduce op (only used for
    inference) is JIT-compiled on first use (~1 min on a fresh machine) and leaves a 69 MB
    workspace per rank in /dev/shm; ds_mp skips it unless ``DS_MP_SHM_COMM=1`` and releases the
    workspaces of a comm started with it (``deepspeed_compat/shm.py``).
    """
    import datetime

    import deepspeed

    compat.skip_shm_comm_unless_asked()
    secs = timeout_s if timeout_s is not None else float(os.environ.get("DS_MP_TIMEOUT", "300"))
    if not torch.distributed.is_initialized():
        for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
            os.environ.setdefault(key, default)  # a plain `python script.py` is a 1-rank job
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=secs), verbose=False)
    compat.release_shm_workspace()  # a comm someone else started with the op: leave nothing in /dev/shm
    atexit.unregister(shutdown_distributed)  # once per process, however often this runs
    atexit.register(shutdown_distributed, False)  # every entry point: launch/*.py, the Python API, ds_mp.hf


def shutdown_distributed(clean: bool) -> None:
    """Tear the process groups down before the interpreter exits (a gloo group left to the
    exit-time destructors has aborted a finished rank: "terminate called without an active
    exception", SIGABRT, exit 1).  :func:`init_distributed` registers it to run at exit
    (``clean`` False) for every script; it does nothing when the group is already gone (the
    script or launch/*.py destroyed it).  ``clean``: every rank finished the same collectives, so
    a barrier is safe (at exit that is not known: a peer may have failed)."""
    if torch.distributed.is_initialized():
        if clean:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def weight_source(model: Any, cfg: DsMpConfig, seed: int) -> WeightSource:
    """Where the weights come from: a model object, an HF/ds_mp directory, or fresh init."""
    if model is not None and not isinstance(model, str):
        return WeightSource.from_model(model)
    path = model if isinstance(model, str) else (cfg.model if isinstance(cfg.model, str) else None)
    if path:
        from ds_mp.checkpoint.hf import directory_source
        from ds_mp.hub import resolve_model

        return directory_source(resolve_model(path), verify_weights=True)  # a Hub id: its cached snapshot
    # The family's init (GPT-2: N(0, 0.02), residual output projections N(0, 0.02/sqrt(2 n_layer)),
    # biases 0, LayerNorm 1/0; Llama: N(0, initializer_range), biases 0, RMSNorm 1), drawn per
    # parameter name and row block: the same full weights at every layout, and each rank creates
    # only the shards it keeps (no whole model anywhere).
    return fresh_source(inline_config(cfg.shape), seed)


def agreed_weight_source(model: Any, cfg: DsMpConfig) -> WeightSource:
    """:func:`weight_source` on every rank, agreed: a damaged or unreadable checkpoint fails on
    every rank here (its own error where it failed, a CheckpointError naming those ranks
    elsewhere), before the collectives of the model build could leave a peer waiting."""
    from ds_mp.checkpoint.integrity import CheckpointError

    try:
        src, error = weight_source(model, cfg, cfg.training.seed), None
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank has said how it went
        src, error = None, e
    if torch.distributed.get_world_size() > 1:
        said = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}")
        failed = [f"rank {r}: {e}" for r, e in enumerate(said) if e]
        if failed and error is None:
            raise CheckpointError("reading the model weights failed on other ranks: " + "; ".join(failed))
    if error is not None:
        raise error
    return src


def build_engine(model: Any = None, config: Any = None, training_data: Any = None, args: Any = None,
                 optimizer: Any = None, lr_scheduler: Any = None,
                 loaded: DsMpConfig | None = None) -> tuple[DsMpPipelineEngine, Any, Any, Any]:
    """:func:`ds_mp.initialize`: the config (``loaded``: the run's already validated block, read from
    nowhere again), the process groups, the weights, the pipeline of this rank's stage, its
    optimizer and the engine that runs the schedule."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_mp.engine.pipeline_engine import DsMpPipelineEngine
    from ds_mp.tensor_parallel.random import seed_everything

    compat.check()
    cfg, raw = config_for(model, config, args, loaded)  # every rank, before any collective
    init_distributed()
    world = torch.distributed.get_world_size()
    if world != cfg.world_size:  # the rendezvous' world, where the environment said another
        cfg = validate_model(cfg, world)
        check_deepspeed_blocks(raw, cfg)
    topology = Topology(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, rank=torch.distributed.get_rank())
    # Offset per pipeline stage (Megatron-LM: seed + 100·pp_rank) so stages (and Ouroboros' ring
    # ranks) draw different dropout masks; and per CP rank (different tokens of the same rows).
    seed_everything(cfg.training.seed, topology.tp_rank, pp_rank=topology.pp_rank, cp_rank=topology.cp_rank)
    src = agreed_weight_source(model, cfg)
    ds_dict = deepspeed_dict(raw)
    net, costs = _pipeline(src, cfg, ds_dict, topology)
    mpu = net.mpu()
    keys = schedule_spec(cfg.pipeline.schedule).group_keys(net, cfg, topology.pp_rank)  # (Ouroboros: per module)
    params, optimizer = optimizer_setup(net, ds_dict, optimizer, group_keys=keys)
    engine = DsMpPipelineEngine(args=args, model=net, optimizer=optimizer, model_parameters=params,
                                training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                config=ds_dict, config_class=DeepSpeedConfig(ds_dict, mpu),
                                ds_mp_config=cfg, topology=topology, hf_config=src.config,
                                optimizer_hparams=(raw.get("optimizer") or {}).get("params"), layer_costs=costs)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def config_for(model: Any, config: Any, args: Any, loaded: DsMpConfig | None) -> tuple[DsMpConfig, dict]:
    """The validated block and the whole JSON: ``loaded`` as it is, or :func:`load_config` of
    ``config`` (``args.deepspeed_config``) with the model named by ``model`` (a directory, Hub id or
    model object) in place of ``ds_mp.model``, against the environment's world size."""
    if config is None:
        config = getattr(args, "deepspeed_config", None)
        if config is None:
            raise ConfigError("config: pass config=PATH|dict or --deepspeed_config PATH")
    raw = read_json(config)
    if loaded is not None:
        return loaded, raw
    if model is not None and not isinstance(model, str):
        try:
            causal_lm_family(model)  # every rank, before any collective
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if isinstance(model, str) or (model is not None and hasattr(model, "config")):
        raw = copy.deepcopy(raw)
        raw.setdefault("ds_mp", {})["model"] = model if isinstance(model, str) else _inline_from_hf(model.config)
    hf_dict = model.config.to_dict() if model is not None and not isinstance(model, str) else None
    return load_config(raw, int(os.environ.get("WORLD_SIZE", "1")), hf_dict)


def deepspeed_dict(raw: dict) -> dict:
    """The JSON DeepSpeed reads: without the ``ds_mp`` block, micro-batch and accumulation defaulted
    to 1, ``train_batch_size`` dropped (DeepSpeed derives micro × accumulation × DP)."""
    ds_dict = {k: v for k, v in raw.items() if k != "ds_mp"}
    ds_dict.setdefault("train_micro_batch_size_per_gpu", 1)
    ds_dict.setdefault("gradient_accumulation_steps", 1)
    ds_dict.pop("train_batch_size", None)
    return ds_dict


def _pipeline(src: WeightSource, cfg: DsMpConfig, ds_dict: dict, topology: Topology) -> tuple[Any, LayerCosts | None]:
    """This rank's pipeline stage, laid out as the schedule's spec asks, its blocks split by
    ``pipeline.partition`` (``"cost"``: measured here, collective); returns it and the measured costs."""
    spec = schedule_spec(cfg.pipeline.schedule)
    if src.frozen and isinstance(spec.lora, str):  # the schedules that cannot train LoRA's frozen base
        raise ConfigError(f"model: {len(src.frozen)} weights have requires_grad=False (e.g. {min(src.frozen)}), which "
                          f"the {cfg.pipeline.schedule} schedule does not honour; unfreeze them or choose another schedule")
    partition = cfg.pipeline.partition
    costs = measured_costs(src, cfg, ds_dict, topology) if partition == "cost" and cfg.pp > 1 else None
    layout = spec.pipeline_layout(cfg, src.config, costs)  # (zb-v's V balances the costs per rank)
    if partition == "cost" and layout is None:  # (a ring layout has its own split)
        chunks = cfg.pp * cfg.pipeline.virtual_stages  # interleaved: balanced per chunk
        partition = costs.blocks(cfg.shape.n_layer, chunks) if costs else [cfg.shape.n_layer]
    net = build_pipeline(src, topology, partition=partition,
                         sequence_parallel=cfg.tensor_parallel.sequence_parallel,
                         overlap_comm=cfg.tensor_parallel.overlap_comm,
                         vocab_pad_multiple=cfg.tensor_parallel.vocab_pad_multiple,
                         activation_checkpoint_interval=cfg.pipeline.activation_checkpoint_interval,
                         dynamic_shape=spec.dynamic_shape(), layout=layout,
                         lora=cfg.lora, seed=cfg.training.seed, virtual_stages=cfg.pipeline.virtual_stages,
                         loss=configured_loss(cfg.loss), cp_impl=cfg.context_parallel.impl,
                         expert_layout=cfg.moe.expert_layout)
    return net, costs


def measured_costs(src: WeightSource, cfg: DsMpConfig, ds_dict: dict, topology: Topology) -> LayerCosts:
    """``"partition": "cost"``: the per-layer costs at this run's micro-batch (rows × seq_len),
    precision, TP layout and LoRA on the engine's device, agreed by every rank (collective) and
    cached in ``<training.output_dir>/partition_profile.json``."""
    from deepspeed.accelerator import get_accelerator

    dtype = (torch.bfloat16 if (ds_dict.get("bf16") or ds_dict.get("bfloat16") or {}).get("enabled")
             else torch.float16 if (ds_dict.get("fp16") or {}).get("enabled") else torch.float32)
    acc, local_rank = get_accelerator(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(acc.device_name(local_rank))
    if device.type != "cpu":
        acc.set_device(local_rank)  # before the first collective (the engine would set it later)
    return agreed_layer_costs(src, topology, cache=os.path.join(cfg.training.output_dir, PROFILE_NAME),
                              rows=int(ds_dict["train_micro_batch_size_per_gpu"]), seq=cfg.data.seq_len,
                              dtype=dtype, device=device, sequence_parallel=cfg.tensor_parallel.sequence_parallel,
                              vocab_pad_multiple=cfg.tensor_parallel.vocab_pad_multiple, lora=cfg.lora,
                              overlap_comm=cfg.tensor_parallel.overlap_comm)


def _inline_from_hf(hf: Any) -> dict:
    """The shape of an HF config of any family, as the family reads its ``config.to_dict()``."""
    shape = shape_of(hf.to_dict(), OBJECT)
    return {k: getattr(shape, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "dropout")}
