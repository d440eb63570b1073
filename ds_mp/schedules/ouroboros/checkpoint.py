"""Checkpoints and HF export for OuroborosEngine (a mixin in front of DeepSpeedEngine).

A checkpoint is DeepSpeed's own (``<dir>/<tag>/mp_rank_XX_model_states.pt`` per ring rank, written
by DP replica 0: weights under HF names, optimizer, LR scheduler, counters, ``<dir>/latest``) plus,
per ring rank and DP replica, ``ouroboros_inflight_ppRR_dpDD.pt``: the iteration t, the stashed
inputs (with the RNG state of their forward) and the deltas not yet backpropagated. Resuming therefore continues the very same sequence
of updates as an uninterrupted run (nothing is drained). The in-flight state is tied to the ring
(K) and the DP degree it was saved with; weights alone can be exported with ``save_hf``.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ds_mp.config import ConfigError


class OuroborosCheckpointing:
    """save_checkpoint / load_checkpoint with in-flight state, hf_state_dict, save_hf."""

    def _inflight_path(self, directory: str) -> str:
        topo = self.topology
        return os.path.join(directory, f"ouroboros_inflight_pp{topo.pp_rank:02d}_dp{topo.dp_rank:02d}.pt")

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, **kwargs: Any) -> bool:
        """Collective: DeepSpeed's checkpoint plus this rank's in-flight state under ``<save_dir>/<tag>``."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        done = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                       save_latest=save_latest, **kwargs)
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        state = {"K": self.K, "delay": self.delay, "iteration": self.iteration,
                 "stash": {m: [(s, x.cpu(), rng) for s, x, rng in q] for m, q in self._stash.items()},
                 "deltas": {key: d.cpu() for key, d in self._deltas.items()}}
        torch.save(state, self._inflight_path(os.path.join(save_dir, tag)))
        dist.barrier()
        return done

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[str | None, dict | None]:
        """Collective: DeepSpeed's load (``tag=None``: the ``latest`` one), then the in-flight state.
        Returns DeepSpeed's ``(path, client_state)``; path is None when there was nothing to load."""
        path, client_state = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is None:
            return path, client_state
        file = self._inflight_path(os.path.dirname(path))
        if not os.path.isfile(file):
            raise ConfigError(f"checkpoint {os.path.dirname(path)} has no {os.path.basename(file)}; resume "
                              "Ouroboros with the ring size and DP degree it was saved with")
        state = torch.load(file, map_location="cpu")  # RNG states stay CPU tensors
        if (state["K"], state["delay"]) != (self.K, self.delay):
            raise ConfigError(f"checkpoint {file} holds K={state['K']}, delay={state['delay']}; this engine has "
                              f"K={self.K}, delay={self.delay}: load it with the same ds_mp.ouroboros settings")
        self.iteration = state["iteration"]
        self._stash = {m: deque((s, x.to(self.device), rng) for s, x, rng in state["stash"][m]) for m in self.parts}
        self._deltas = {key: d.to(self.device) for key, d in state["deltas"].items()}
        return path, client_state

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Collective over the ring: every ring rank gets all weights by HF name, on CPU."""
        local = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        if self.ring_size == 1:
            return local
        gathered: list[Any] = [None] * self.ring_size
        dist.all_gather_object(gathered, local, group=self.topology.pp_group)
        return {k: v for part in gathered for k, v in part.items()}

    def save_hf(self, out_dir: str, tokenizer_dir: str | None = None) -> None:
        """Collective: global rank 0 writes an HF GPT-2 directory (``from_pretrained`` loads it)."""
        from ds_mp.checkpoint.hf import CheckpointError, write_hf_dir

        tensors, error = self.hf_state_dict(), [""]
        if dist.get_rank() == 0:
            try:
                write_hf_dir(tensors, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = [f"{type(e).__name__}: {e}"]
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise CheckpointError(f"save_hf to {out_dir!r} failed on rank 0: {error[0]}")
