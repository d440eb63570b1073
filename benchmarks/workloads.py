"""Workloads shared by the benchmarks: the model shape (GPT-2, or a Llama-family model with
``model_type``), data, memory accounting, and the per-rank setups for plain HF and ds_mp (each
returns an object with ``step()``).

Everything runs inside a harness worker (:mod:`benchmarks.common`), one process per rank.
"""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    n_layer: int = 8
    n_embd: int = 512
    n_head: int = 8
    vocab: int = 8192
    seq: int = 256
    n_positions: int = 1024
    model_type: str = "gpt2"  # or "llama" / "qwen2" / "mistral" with the three fields below
    n_kv_head: int = 0  # key/value heads (0 = n_head)
    intermediate_size: int = 0  # SwiGLU width (0 = 4 × n_embd)
    tie_word_embeddings: bool = True

    def describe(self) -> str:
        kv = f" ({self.n_kv_head} key/value), SwiGLU {self.intermediate_size}" if self.model_type != "gpt2" else ""
        return (f"{'GPT-2' if self.model_type == 'gpt2' else self.model_type} {self.n_layer} layers × {self.n_embd} "
                f"hidden, {self.n_head} heads{kv}, vocab {self.vocab}, seq {self.seq}, fp32, SGD, dropout 0")


FULL = Shape()
QUICK = Shape(n_layer=4, n_embd=256, n_head=8, vocab=4096, seq=128, n_positions=256)
LR = 1e-4  # small enough that a few hundred steps stay finite; timing does not depend on it


def hf_model(shape: dict, seed: int = 0) -> Any:
    """A fresh ``GPT2LMHeadModel``, or the shape's Llama-family ``…ForCausalLM`` (HF config as ds_mp
    builds an inline shape's), identical on every rank for the same seed, dropout 0."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from ds_mp.config import InlineModel
    from ds_mp.models.family import inline_config

    s = Shape(**shape)
    torch.manual_seed(seed)
    if s.model_type != "gpt2":
        return AutoModelForCausalLM.from_config(inline_config(InlineModel(
            n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, vocab_size=s.vocab, n_positions=s.n_positions,
            model_type=s.model_type, n_kv_head=s.n_kv_head, intermediate_size=s.intermediate_size,
            tie_word_embeddings=s.tie_word_embeddings))).train()
    cfg = GPT2Config(n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, vocab_size=s.vocab,
                     n_positions=s.n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def batch(shape: dict, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of ``[rows, seq]`` random tokens (labels = ids, HF shifts)."""
    s = Shape(**shape)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab, (rows, s.seq), generator=g)
    return ids, ids.clone()


def state_bytes(params: Any, optimizer: Any) -> int:
    """Bytes of parameters + gradients (one per trainable parameter, as fp32 SGD keeps) +
    optimizer state tensors, each storage counted once."""
    seen, total = set(), 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size() * (2 if p.requires_grad else 1)
    for state in getattr(optimizer, "state", {}).values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Bench:
    """Base of every benchmark setup: ``step()`` plus a profiler view of it."""

    def step(self) -> float:
        raise NotImplementedError

    def profile(self, steps: int = 1, rows: int = 25) -> str:
        """torch.profiler table (ops by self CPU time) over ``steps`` steps on this rank."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                self.step()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


class HFBench(Bench):
    """One process: the shape's HF model (:func:`hf_model`) + ``torch.optim.SGD``, one full batch per step."""

    def __init__(self, rank: int, world: int, shape: dict, rows: int) -> None:
        self.model = hf_model(shape)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.ids, self.labels = batch(shape, rows)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(input_ids=self.ids, labels=self.labels).loss
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def memory(self) -> dict:
        return {"state_bytes": state_bytes(self.model.parameters(), self.opt), "max_rss_mib": max_rss_mib()}


def setup_hf(rank: int, world: int, shape: dict, rows: int) -> HFBench:
    return HFBench(rank, world, shape, rows)


def ds_mp_config(shape: dict, *, tp: int = 1, pp: int = 1, micro: int, gas: int = 1,
                 schedule: str = "1f1b", tp_extra: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "ds_mp": {"tensor_parallel": {"size": tp, **(tp_extra or {})}, "pipeline": {"stages": pp, "schedule": schedule},
                      "data": {"seq_len": Shape(**shape).seq}}}


class DsMpBench(Bench):
    """ds_mp through ``ds_mp.initialize``; a step is ``engine.train_batch`` over ``gas``
    micro-batches of ``micro`` rows (the same rows every step)."""

    def __init__(self, rank: int, world: int, shape: dict, micro: int, gas: int = 1, tp: int = 1, pp: int = 1,
                 schedule: str = "1f1b", tp_extra: dict | None = None) -> None:
        import ds_mp

        cfg = ds_mp_config(shape, tp=tp, pp=pp, micro=micro, gas=gas, schedule=schedule, tp_extra=tp_extra)
        self.engine, self.opt, _, _ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        ids, labels = batch(shape, micro * gas)
        self.micro = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, micro * gas, micro)]

    def step(self) -> float:
        return float(self.engine.train_batch(iter(self.micro)))

    def memory(self) -> dict:
        return {"state_bytes": state_bytes(self.engine.module.parameters(), self.opt), "max_rss_mib": max_rss_mib()}


def setup_ds_mp(rank: int, world: int, **kwargs: Any) -> DsMpBench:
    return DsMpBench(rank, world, **kwargs)


def shape_dict(quick: bool) -> dict:
    return asdict(QUICK if quick else FULL)
