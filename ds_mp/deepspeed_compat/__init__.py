"""Every use of a private DeepSpeed name, each with the DeepSpeed behaviour it relies on.

ds_mp subclasses DeepSpeed's ``PipelineEngine`` and ``PipelineModule`` here only, as adapters
(``engine_adapter.py``, ``pipeline_module.py``) whose overrides of DeepSpeed's private hooks
(``_exec_*``, ``_train_schedule``, ``_aggregate_total_loss``; ``_build``, ``_partition_layers``,
``_synchronize_tied_weights``) translate them into public methods of ds_mp's subclasses; the
override lists are derived from the adapter classes (:func:`check_overrides`).  Every private
attribute ds_mp *reads, writes or calls* goes through an accessor below.  :func:`check` verifies every assumption
against the installed DeepSpeed and fails with a message that names the broken one; it
runs when an engine is built, so an incompatible DeepSpeed fails there, not mid-step.

Measured against DeepSpeed 0.19.x (``pyproject.toml`` pins ``<0.20``).
"""
from __future__ import annotations

from ds_mp.deepspeed_compat.optimizers import (flat_group_params, skipping_flat_groups, master_grad, FLAT_PARTITIONS,
    flat_partitions, full_flat_state, set_flat_state, LP_GROUPS, flat_state_extras, flat_state_keys,
    set_flat_state_extras, ZERO2_ASSUMPTIONS, check_zero2, zero2_close_backward, zero2_close_step,
    zero2_partition_grads, zero2_full_grad, zero2_set_full_grad, fp16_slot, slot_view, SCALER_FIELDS,
    loss_scaler_state, set_loss_scaler_state, master_weights, FLAT_LP_GROUPS, flat_fragments)
from ds_mp.deepspeed_compat.pipeline import (ASSUMPTIONS, ENGINE_ATTRIBUTES, Assumption, DeepSpeedIncompatible,
    check, check_engine, checkpointable_flags, inference_schedule, instruction_handlers, layer_spec_arguments, set_global_grad_norm, uses_bf16_optimizer, copy_bf16_grads_to_master,
    reserve_pipe_buffers, reset_forward_outputs, computing_loss, tied_weights, next_batch,
    pipe_buffers, forget_partitioned_shapes, send_whole_activations,
    unapplied_loss_scale, output_hook_managers)
from ds_mp.deepspeed_compat.shm import release_shm_workspace, skip_shm_comm_unless_asked
from ds_mp.deepspeed_compat.p2p import activation_messages, grad_messages, stage_rank
from ds_mp.deepspeed_compat.internals import (neighbours, set_neighbours, announce_every_shape, set_computing_loss, received_grad, set_received_grad,
    release_loss_graph, set_train_loss, drop_bf16_grads, bf16_fp32_gradients, zero_gradient_for_reduction, use_activation_checkpoint,
    local_layers, running_layers, stage_bounds, tied_parameter_ids, has_tied_comms, batch_fn_done, set_step_counters)

__all__ = ["release_shm_workspace", "skip_shm_comm_unless_asked", "ASSUMPTIONS", "ENGINE_ATTRIBUTES", "Assumption", "DeepSpeedIncompatible", "check", "check_engine", "checkpointable_flags", "inference_schedule", "instruction_handlers", "layer_spec_arguments", "activation_messages", "grad_messages", "stage_rank",
           "set_global_grad_norm", "uses_bf16_optimizer", "copy_bf16_grads_to_master",
           "reserve_pipe_buffers", "reset_forward_outputs", "computing_loss", "tied_weights",
           "next_batch", "pipe_buffers", "forget_partitioned_shapes", "send_whole_activations",
           "unapplied_loss_scale", "output_hook_managers", "neighbours", "set_neighbours",
           "announce_every_shape", "set_computing_loss", "batch_fn_done", "set_step_counters",
           "received_grad", "set_received_grad", "release_loss_graph", "set_train_loss", "drop_bf16_grads", "bf16_fp32_gradients",
           "zero_gradient_for_reduction", "use_activation_checkpoint", "local_layers", "running_layers", "stage_bounds",
           "tied_parameter_ids", "has_tied_comms",
           "flat_group_params", "skipping_flat_groups", "master_grad", "FLAT_PARTITIONS",
           "flat_partitions", "full_flat_state", "set_flat_state", "LP_GROUPS", "flat_state_extras",
           "flat_state_keys", "set_flat_state_extras", "ZERO2_ASSUMPTIONS", "check_zero2",
           "zero2_close_backward", "zero2_close_step", "zero2_partition_grads", "zero2_full_grad",
           "zero2_set_full_grad", "fp16_slot", "slot_view", "SCALER_FIELDS", "loss_scaler_state",
           "set_loss_scaler_state", "master_weights", "FLAT_LP_GROUPS", "flat_fragments", "check_overrides"]


def check_overrides(adapter: type | None = None) -> list[str]:
    """The private DeepSpeed names the adapters override, each checked against DeepSpeed
    (``engine_adapter.check_overrides`` and ``pipeline_module.check_overrides``, imported when called:
    they load DeepSpeed's pipeline engine and module); ``adapter``: only that class (or subclass) of one."""
    from ds_mp.deepspeed_compat import engine_adapter, pipeline_module

    if adapter is None:
        return engine_adapter.check_overrides() + pipeline_module.check_overrides()
    if issubclass(adapter, pipeline_module.PipelineModule):
        return pipeline_module.check_overrides(adapter)
    return engine_adapter.check_overrides(adapter)
