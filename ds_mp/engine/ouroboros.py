"""Distributed Ouroboros: K modules on K-1 ring ranks, one DeepSpeed engine per rank.

Placement (ring_layout): ring rank 0 holds G_0 and G_{K-1}, which share the tied embedding V,
ring rank r holds G_r. With DP > 1 the ring is replicated: ranks are DeepSpeed's pipe × data ×
model grid with pipe = ring rank (TP must be 1), and every rank talks only to the ranks of its own
replica. Each rank runs ``rank_steps(K, t, rank, delay)`` at iteration t (``engine.iteration``), so
the update is exactly OuroborosReference.step (the contract in ds_mp.schedules.ouroboros.algorithm):

    forward with w^t, send h; replay G_m on the stashed input of sample t - d_m with the CURRENT
    weights w^t (module_backward re-runs the forward under autograd: a deliberate recompute, so no
    graph is ever reused across an optimizer step), send delta; p.grad = sum of the module
    gradients of p (V: 1/2 (dV_o + dV_i), or the sum when delay=False); then DeepSpeed's
    ``allreduce_gradients`` (mean over the DP replicas) and ``step`` (every parameter, zero
    gradients in warm-up included).

DeepSpeed stays in charge of the optimizer and LR scheduler (built from the JSON ``optimizer`` and
``scheduler`` blocks by ``DeepSpeedEngine``; on CPU a ``"Lamb"`` block becomes ds_mp.optim.Lamb,
DeepSpeed's being CUDA-only), of DP gradient averaging, and of checkpoint files. Gradient clipping
is ds_mp's: the global norm over the whole ring (V counted once; DeepSpeed's default
``gradient_clipping`` of 1.0 applies when the key is absent), then DeepSpeed steps.

One train_batch = one Ouroboros iteration = one optimizer step. Ring rank 0 reads
``gradient_accumulation_steps`` micro-batches from ``data_iter`` and concatenates them along the
batch dimension into the iteration's batch x_t (the loss is the mean over all its tokens); other
ring ranks read nothing. fp32 only, ZeRO 0 (ds_mp.config refuses the rest).
"""
from __future__ import annotations

import copy
import math
import time
from collections import deque
from typing import Any, Iterator

import torch
import torch.distributed as dist
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine
from torch import Tensor, nn

from ds_mp.config import ConfigError, DsMpConfig
from ds_mp.schedules.ouroboros.algorithm import (RngState, build_modules, capture_rng, lm_loss, loss_backward, module_backward,
                                      module_forward)
from ds_mp.schedules.ouroboros.checkpoint import OuroborosCheckpointing
from ds_mp.schedules.ouroboros.timetable import (Backward, Forward, OptimizerStep, OuroborosSchedule, RecvAct,
                                               RecvGrad, SendAct, SendGrad, module_owner, ring_layout,
                                               split_modules)
from ds_mp.topology import Topology, build_grid


class RingStage(nn.Module):
    """One ring rank's weights under their HF names (``transformer.wte``, ``transformer.h.<i>``, ...),
    so ``state_dict()`` keys are GPT2LMHeadModel keys. ``parts`` = {m: G_m} for the modules this rank
    runs; they share these submodules (G_0 and G_{K-1} share wte) and are not registered twice."""

    def __init__(self, src: Any, K: int, ring_rank: int) -> None:
        from transformers import GPT2LMHeadModel

        super().__init__()
        hf = copy.deepcopy(src.config)
        with torch.device("meta"):  # no full-model allocation: only this rank's tensors get storage
            full = GPT2LMHeadModel(hf)
        mine, blocks = ring_layout(K)[ring_rank], split_modules(hf.n_layer, K)
        self.parts = {p.index: p for p in build_modules(full, K) if p.index in mine}
        self.transformer = nn.Module()
        for name, needed in (("wte", {0, K - 1}), ("wpe", {0}), ("drop", {0}), ("ln_f", {K - 1})):
            if needed & set(mine):
                setattr(self.transformer, name, getattr(full.transformer, name))
        self.transformer.h = nn.ModuleDict({str(i): full.transformer.h[i] for m in mine for i in blocks[m]})
        self.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(src.get(name))


class OuroborosEngine(OuroborosCheckpointing, DeepSpeedEngine):
    """``DeepSpeedEngine`` over a RingStage that runs the Ouroboros timetable (see module docstring).

    Loop interface as DsMpPipelineEngine: ``train_batch(it)`` / ``eval_batch(it)`` (the loss averaged
    over DP, on every rank), ``global_steps``, ``get_lr()``, ``topology``, ``micro_batches``,
    ``last_grad_norm``, ``last_step_nonfinite`` / ``nonfinite_steps`` (an update with a NaN/Inf
    gradient anywhere is skipped; the iteration still advances), ``trace`` / ``instruction_times()``
    (DeepSpeed's instruction names), ``save_checkpoint`` / ``load_checkpoint`` / ``save_hf``.
    ``iteration`` is t of the timetable (= global_steps unless updates were skipped).
    """

    _HANDLERS = {Forward: ("_forward", "ForwardPass"), Backward: ("_backward", "BackwardPass"),
                 SendAct: ("_send_act", "SendActivation"), RecvAct: ("_recv_act", "RecvActivation"),
                 SendGrad: ("_send_grad", "SendGrad"), RecvGrad: ("_recv_grad", "RecvGrad"),
                 OptimizerStep: ("_optimizer_step", "OptimizerStep")}

    def __init__(self, *args: Any, ds_mp_config: DsMpConfig, topology: Topology, max_grad_norm: float = 0.0,
                 **kwargs: Any) -> None:
        self.ds_mp_config, self.topology, self.max_grad_norm = ds_mp_config, topology, max_grad_norm
        self.schedule_name, self.K, self.delay = "ouroboros", topology.pp + 1, ds_mp_config.ouroboros.delay
        self.tie_scale = 0.5 if self.delay else 1.0  # g_V = tie_scale (dV_o + dV_i)
        self.iteration = 0
        self.last_grad_norm: float | None = None
        self.last_step_nonfinite, self.nonfinite_steps = False, 0
        self.trace: list[tuple[str, int, float, float]] = []  # (instruction, sample, start, end)
        self.trace_enabled = False
        super().__init__(*args, **kwargs)
        self.set_gradient_accumulation_boundary(True)  # every step() is an iteration's update
        self.micro_batches = self.gradient_accumulation_steps()  # read per train_batch, concatenated
        self.parts, self._owner = self.module.parts, module_owner(self.K)
        self._dtype = next(self.module.parameters()).dtype
        self._stash: dict[int, deque[tuple[int, Tensor, RngState]]] = {m: deque() for m in self.parts}  # G_m's inputs
        self._acts: dict[tuple[int, int], Tensor] = {}    # (m, s) -> input of G_m for sample s
        self._deltas: dict[tuple[int, int], Tensor] = {}  # (m, s) -> delta_m^s, G_m backprops it
        self._grads: dict[int, list[Tensor]] = {}
        self._loss: Tensor | None = None
        self._data_iter: Iterator | None = None

    # --- coordinates ------------------------------------------------------------------
    @property
    def ring_rank(self) -> int:
        return self.topology.pp_rank

    @property
    def ring_size(self) -> int:
        return self.topology.pp

    # --- public loop API --------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """One Ouroboros iteration (one update); returns f_t, averaged over DP, on every rank."""
        batch = self._batch(data_iter, self.micro_batches) if self.ring_rank == 0 else None
        self.module.train()
        for row in OuroborosSchedule.from_engine(self):
            for step in row:
                method, name = self._HANDLERS[type(step)]
                start = time.perf_counter()
                getattr(self, method)(step, batch)
                if self.trace_enabled:
                    self.trace.append((name, getattr(step, "sample", -1), start, time.perf_counter()))
        self.iteration += 1
        return self._share_loss(self._loss)

    def instruction_times(self) -> dict[str, float]:
        """Seconds spent per instruction name since the trace was last cleared."""
        out: dict[str, float] = {}
        for name, _, start, end in self.trace:
            out[name] = out.get(name, 0.0) + end - start
        return out

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None, num_micro_batches: int | None = None) -> Tensor:
        """Mean loss of ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches
        through the ring with the current weights; leaves the in-flight training state untouched."""
        K, r, total = self.K, self.ring_rank, torch.zeros((), device=self.device)
        n = num_micro_batches or self.micro_batches
        self.module.eval()
        for _ in range(n):
            if r == 0:
                ids, labels = self._batch(data_iter, 1)
                h = self.parts[0](ids)
                if self._owner[1] != 0:
                    self._send(h, self._owner[1], header=True)
                    h = self._recv(self._owner[K - 2])
                total += lm_loss(self.parts[K - 1](h), labels)
            else:
                self._send(self.parts[r](self._recv(r - 1)), self._owner[r + 1], header=True)
        return self._share_loss(total / n)

    # --- timetable steps --------------------------------------------------------------
    def _forward(self, st: Forward, batch: tuple[Tensor, Tensor] | None) -> None:
        m, s = st.module, st.sample
        x = batch[0] if m == 0 else self._acts.pop((m, s))
        self._stash[m].append((s, x, capture_rng(x.device)))  # the replay reuses this forward's masks
        if m < self.K - 1:  # G_{K-1} runs forward and backward as one graph in _backward
            self._acts[(m + 1, s)] = module_forward(self.parts[m], x)

    def _backward(self, st: Backward, batch: tuple[Tensor, Tensor] | None) -> None:
        m, s = st.module, st.sample
        stashed, x, rng = self._stash[m].popleft()
        assert stashed == s, f"G_{m} replays sample {s} but its oldest stash is sample {stashed}"
        if m == self.K - 1:  # forward and backward as one graph, on the ambient RNG stream
            self._loss, grad_x, self._grads[m] = loss_backward(self.parts[m], x, batch[1])
        else:
            grad_x, self._grads[m] = module_backward(self.parts[m], x, self._deltas.pop((m, s)), rng)
        if m > 0:
            self._deltas[(m - 1, s)] = grad_x

    def _send_act(self, st: SendAct, batch: Any) -> None:
        self._send(self._acts.pop((st.module + 1, st.sample)), st.peer, header=True)

    def _recv_act(self, st: RecvAct, batch: Any) -> None:
        self._acts[(st.module + 1, st.sample)] = self._recv(st.peer)

    def _send_grad(self, st: SendGrad, batch: Any) -> None:
        self._send(self._deltas.pop((st.module - 1, st.sample)), st.peer)

    def _recv_grad(self, st: RecvGrad, batch: Any) -> None:
        m = st.module - 1  # delta_m^s has the shape of G_m's output for sample s: (B, T, C)
        x = next(x for s, x, _ in self._stash[m] if s == st.sample)
        self._deltas[(m, st.sample)] = self._recv(st.peer, (*x.shape[:2], self.parts[m].config.n_embd))

    def _optimizer_step(self, st: OptimizerStep, batch: Any) -> None:
        """p.grad = sum over local modules of their gradient of p (tie_scale for the shared V);
        modules without a backward this iteration (warm-up) contribute zeros."""
        total: dict[int, Tensor] = {}
        count: dict[int, int] = {}
        for m, part in self.parts.items():
            grads = self._grads.pop(m, None)
            for i, p in enumerate(part.parameters()):
                g = grads[i] if grads is not None else torch.zeros_like(p)
                total[id(p)] = total[id(p)] + g if id(p) in total else g.clone()
                count[id(p)] = count.get(id(p), 0) + 1
        for p in self.module.parameters():
            p.grad = total[id(p)] * (self.tie_scale if count[id(p)] == 2 else 1.0)
        self.allreduce_gradients()  # DeepSpeed: mean over this module's DP replicas
        self._clip_gradients()
        self.last_step_nonfinite = not math.isfinite(self.last_grad_norm)  # same verdict on every rank
        if self.last_step_nonfinite:
            self.nonfinite_steps += 1
            self.zero_grad()
            return
        self.step()

    # --- helpers ----------------------------------------------------------------------
    def _clip_gradients(self) -> None:
        """‖g‖₂ over the whole ring (each parameter once; replicas agree after the DP mean); scale by
        max/(‖g‖+1e-6) when below 1."""
        sq = sum(p.grad.detach().double().pow(2).sum() for p in self.module.parameters())
        if self.ring_size > 1:
            dist.all_reduce(sq, group=self.topology.pp_group)
        self.last_grad_norm = norm = math.sqrt(float(sq))
        coef = self.max_grad_norm / (norm + 1e-6)
        if self.max_grad_norm > 0 and coef < 1.0:  # False for a NaN norm
            for p in self.module.parameters():
                p.grad.mul_(coef)

    def _batch(self, data_iter: Iterator | None, n: int) -> tuple[Tensor, Tensor]:
        """n micro-batches (input_ids, labels) concatenated along the batch dimension."""
        if data_iter is not None:
            self._data_iter = data_iter
        if self._data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("OuroborosEngine: pass data_iter (or training_data to ds_mp.initialize) on ring rank 0")
            self._data_iter = iter(RepeatingLoader(self.training_dataloader))
        pairs = [next(self._data_iter) for _ in range(n)]
        return tuple(torch.cat([pair[i] for pair in pairs]).to(self.device) for i in (0, 1))

    def _peer(self, ring_rank: int) -> int:
        topo = self.topology
        return topo.rank_of(tp=topo.tp_rank, pp=ring_rank, dp=topo.dp_rank)

    def _send(self, x: Tensor, ring_rank: int, header: bool = False) -> None:
        if header:  # activations announce their (B, T, C); deltas have the shape of a stashed output
            dist.send(torch.tensor(x.shape, dtype=torch.long, device=self.device), self._peer(ring_rank))
        dist.send(x.contiguous(), self._peer(ring_rank))

    def _recv(self, ring_rank: int, shape: tuple[int, ...] | None = None) -> Tensor:
        if shape is None:
            header = torch.empty(3, dtype=torch.long, device=self.device)
            dist.recv(header, self._peer(ring_rank))
            shape = tuple(header.tolist())
        buf = torch.empty(shape, dtype=self._dtype, device=self.device)
        dist.recv(buf, self._peer(ring_rank))
        return buf

    def _share_loss(self, loss: Tensor | None) -> Tensor:
        """Ring rank 0's loss, averaged over DP replicas, broadcast to the whole ring."""
        out = loss.detach().float().clone() if self.ring_rank == 0 else torch.zeros((), device=self.device)
        if self.ring_rank == 0 and self.topology.dp > 1:
            dist.all_reduce(out, group=self.topology.dp_group)
            out /= self.topology.dp
        if self.ring_size > 1:
            dist.broadcast(out, src=self._peer(0), group=self.topology.pp_group)
        return out


def _client_lamb(ds_dict: dict, stage: nn.Module) -> Any:
    """DeepSpeed's Lamb is CUDA-only: on CPU, a ``"Lamb"`` block becomes ds_mp.optim.Lamb, passed
    to DeepSpeed as a client optimizer (the ``scheduler`` block still applies)."""
    from deepspeed.accelerator import get_accelerator

    block = ds_dict.get("optimizer") or {}
    if str(block.get("type", "")).lower() != "lamb" or get_accelerator().device_name() != "cpu":
        return None
    from ds_mp.optim import Lamb

    ds_dict.pop("optimizer")
    try:
        return Lamb(stage.parameters(), **block.get("params", {}))
    except TypeError as e:
        raise ConfigError(f"optimizer.params: {e} (ds_mp.optim.Lamb takes lr, betas, eps, weight_decay, "
                          "max_trust, bias_correction)") from None


def build_ouroboros_engine(src: Any, cfg: DsMpConfig, raw: dict, topology: Topology, *, args: Any = None,
                           optimizer: Any = None, lr_scheduler: Any = None, training_data: Any = None) -> tuple:
    """``ds_mp.initialize`` for ``pipeline.schedule = "ouroboros"`` (config already validated)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    build_grid(topology)
    stage = RingStage(src, topology.pp + 1, topology.pp_rank)
    ds_dict = {k: v for k, v in raw.items() if k != "ds_mp"}
    ds_dict.setdefault("train_micro_batch_size_per_gpu", 1)
    ds_dict.setdefault("gradient_accumulation_steps", 1)
    ds_dict.pop("train_batch_size", None)  # derived: micro × accumulation × DP
    max_grad_norm = float(ds_dict.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))  # DeepSpeed's default: 1.0
    ds_dict["gradient_clipping"] = 0.0  # ds_mp clips over the whole ring instead
    optimizer = optimizer if optimizer is not None else _client_lamb(ds_dict, stage)
    engine = OuroborosEngine(args=args, model=stage, optimizer=optimizer, model_parameters=list(stage.parameters()),
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=topology.grid,
                             config=ds_dict, config_class=DeepSpeedConfig(ds_dict, topology.grid),
                             ds_mp_config=cfg, topology=topology, max_grad_norm=max_grad_norm)
    engine.hf_config = src.config
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
