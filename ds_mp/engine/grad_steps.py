"""The gradient half of a ds_mp pipeline step, as a mixin of :class:`~ds_mp.engine.pipeline_engine.DsMpPipelineEngine`:
the tied-weight and DP reductions (with the gradient-noise probe), the NaN/Inf-skipping optimizer step,
and the global gradient norm and clipping that fp32 without ZeRO computes itself (DeepSpeed's counts
untagged parameters on pipeline stage 0 only).  Split from the engine by concern; it reads only the
engine's own attributes (``module``, ``topology``, ``noise_scale``, DeepSpeed's hooks)."""
from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.engine import grads, zero2


class GradientSteps:
    """Gradient reduction, the optimizer step and norms of a :class:`DsMpPipelineEngine`."""

    # --- gradients --------------------------------------------------------------------
    def reduce_tied_gradients(self) -> None:
        """Sum the tied ``wte``'s gradient over its tied group (first and last stage).

        DeepSpeed's own handler reads every tied weight's gradient (its fp32 master gradient
        under bf16); LoRA freezes the embedding, which then has neither: skip a frozen weight."""
        if zero2.partitions_gradients(self):  # ZeRO-2: in _exec_reduce_grads, after the partitions
            return
        bf16 = compat.uses_bf16_optimizer(self)
        for _, weight, group, _ in compat.tied_weights(self.module):
            if not weight.requires_grad:
                continue
            grad = compat.master_grad(weight) if bf16 else weight.grad
            if grad is not None:
                dist.all_reduce(grad, group=group)

    def reduce_gradients(self) -> None:
        """The DP gradient reduction of a step (ReduceGrads, with the SP sum and noise probe)."""
        if zero2.partitions_gradients(self):  # reduced per backward; the step's partitions made final
            zero2.close_step(self)
            return
        probe = self.noise_scale
        measure = probe is not None and probe.due(self.global_steps + 1)
        if measure:  # |G_small|² of this replica before the DP all-reduce, |G_big|² after (or the step's norm)
            probe.before(self.reduction_grad_norm() ** 2, self.device)
        if self.topology.grad_size > 1 or compat.uses_bf16_optimizer(self) or self.zero_optimization_stage() > 0:
            self.deepspeed_reduce_gradients()
        # else: one replica and the gradients already sit in p.grad: DeepSpeed's reduction would
        # flatten every gradient into buckets, all-reduce over a group of one and copy back (two
        # memcpys of the whole gradient per step, a no-op in value; gradient_predivide_factor
        # scales by f and back by f / 1).  bf16 and ZeRO keep it: their reduce also moves the
        # gradients into the optimizer's own buffers.
        self._noise_b_small = None
        if measure:
            b_small = self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps()
            if self._fp32_grads() or compat.uses_bf16_optimizer(self):
                probe.after(self.reduction_grad_norm() ** 2, b_small)
            else:  # ZeRO: the reduced gradients sit in DP partitions; their norm is the step's (_exec_optimizer_step)
                self._noise_b_small = b_small

    def optimizer_step(self, lr_kwargs: Any = None) -> None:
        """Skip the update (weights stay finite) when any gradient is NaN/Inf anywhere.

        fp32 without ZeRO (``p.grad`` holds the reduced gradients): ds_mp's global norm is
        computed every step (one all-reduce over TP × PP; DP replicas agree), reported through
        DeepSpeed's ``get_global_grad_norm()`` also when clipping is off, reused for clipping,
        and a non-finite norm is the NaN verdict.  bf16/ZeRO: one fused finiteness check over
        every rank (their optimizers compute and report the norm themselves).  fp16 keeps
        DeepSpeed's own loss-scaler overflow handling.
        """
        if self.fp16_enabled():
            return self.deepspeed_optimizer_step(lr_kwargs)
        if self._fp32_grads():
            norm = self.global_grad_norm()
            self.last_grad_norm = norm
            compat.set_global_grad_norm(self, norm)
            self.last_step_nonfinite = not math.isfinite(norm)
        else:
            if zero2.partitions_gradients(self):  # ZeRO-2 keeps no .grad: its partitions
                held = zero2.partition_gradients(self)
            elif compat.uses_bf16_optimizer(self):  # the fp32 master gradients: with bf16.immediate_grad_update
                held = [compat.master_grad(p) for p in self.module.parameters()]  # .grad is gone by now
            else:
                held = [p.grad for p in self.module.parameters()]
            self.last_step_nonfinite = grads.any_nonfinite_tensors(held, self.device)
        if self.last_step_nonfinite:
            self.nonfinite_steps += 1
            self.zero_grad()
            return
        self.deepspeed_optimizer_step(lr_kwargs)
        if self._noise_b_small:  # ZeRO's norm of the reduced gradients, before clipping
            self.noise_scale.after(float(self.get_global_grad_norm()) ** 2, self._noise_b_small)

    def _fp32_grads(self) -> bool:
        """True when the optimizer steps ``p.grad`` directly (no bf16/fp16 master copy, no ZeRO)."""
        return not (self.bfloat16_enabled() or self.fp16_enabled() or self.zero_optimization())

    # --- norms ------------------------------------------------------------------------------
    def reduction_grad_norm(self) -> float:
        """:func:`ds_mp.engine.grads.reduction_grad_norm` of this engine's gradients."""
        return grads.reduction_grad_norm(self.module, self.topology, self.optimizer, self.device,
                                         bf16=compat.uses_bf16_optimizer(self), zero=bool(self.zero_optimization()))

    def global_grad_norm(self) -> float:
        """‖g‖₂ over the whole model: each TP shard once, each replicated or tied tensor
        once, all stages (DP replicas hold identical reduced gradients)."""
        return grads.global_grad_norm(self.module, self.topology, self.device)

    def clip_fp32_gradients(self) -> None:
        """fp32, no ZeRO: clip with ds_mp's global norm of this step (DeepSpeed's fp32
        ``clip_grad_norm_`` counts untagged parameters on pipeline stage 0 only)."""
        grads.clip_(self.module.parameters(), self.last_grad_norm, self.gradient_clipping())


__all__ = ["GradientSteps"]
