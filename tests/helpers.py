"""Shared test fixtures: tiny GPT-2 models, configs, single-process HF references."""
from __future__ import annotations

import copy
from typing import Any

import torch


def tiny_gpt2(seed: int = 0, n_layer: int = 4, n_embd: int = 48, n_head: int = 4, vocab: int = 203,
              n_positions: int = 64, dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def batches(n: int, micro: int, seq: int, vocab: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (micro, seq), generator=g)
        out.append((ids, ids.clone()))
    return out


def ds_config(tp: int = 1, pp: int = 1, micro: int = 2, gas: int = 2, lr: float = 0.05, clip: float = 0.0,
              schedule: str = "1f1b", optimizer: str = "SGD", seq: int = 16, bf16: bool = False, zero: int = 0,
              **ds_mp: Any) -> dict:
    """A DeepSpeed JSON with a ``"ds_mp"`` block (``ds_mp``: its extra sections or keys); ``bf16``
    turns DeepSpeed's bf16 on, ``zero`` > 0 its ZeRO stage (with SGD and client optimizers allowed,
    DeepSpeed's rule for untested optimizers under ZeRO)."""
    opt = {"type": optimizer, "params": {"lr": lr}}
    if optimizer.lower() in ("adam", "adamw"):
        opt["params"]["torch_adam"] = True
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": opt, "gradient_clipping": clip, "steps_per_print": 10**9,
           "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp, "schedule": schedule},
                     "data": {"seq_len": seq}}}
    for k, v in ds_mp.items():
        cfg["ds_mp"].setdefault(k, {}).update(v) if isinstance(v, dict) else cfg["ds_mp"].__setitem__(k, v)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if zero:
        cfg["zero_optimization"] = {"stage": zero}
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def hf_reference(model, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], lr: float = 0.05,
                 clip: float = 0.0, optimizer: str = "SGD", eps: float = 1e-8) -> tuple[list[float], Any]:
    """Single-process HF training: per step, mean loss over the micro-batches (GAS); ``eps`` is
    Adam's (a weight comparison wants one comparable to the gradients: test_ouroboros.ADAM_ATOL)."""
    model = copy.deepcopy(model).train()
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "SGD"
           else torch.optim.Adam(model.parameters(), lr=lr, eps=eps))
    losses, _ = train_one_process(model, steps, opt, clip)
    return losses, model


def train_one_process(model: Any, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], opt: Any,
                      clip: float = 0.0) -> tuple[list[float], list[float]]:
    """Train ``model`` in place on one process: per step, the per-token loss of its micro-batches
    (HF's token-loss sums over the step's target count: ds_mp's ``loss.normalization = "tokens"``)
    and the pre-clip global norm from torch's ``clip_grad_norm_`` (0 when ``clip`` is off), then
    ``opt.step()``."""
    losses, norms = [], []
    for micro_batches in steps:
        opt.zero_grad()
        total, count = 0.0, sum(targets(labels) for _, labels in micro_batches)
        for ids, labels in micro_batches:
            if targets(labels) == 0:
                continue
            loss = model(input_ids=ids, labels=labels).loss * (targets(labels) / count)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip > 0 else 0.0)
        opt.step()
        losses.append(total)
    return losses, norms


def targets(labels: torch.Tensor) -> int:
    """Targets HF's loss counts in ``labels``: its shift (labels[:, 1:]) without the ignored -100."""
    return int((labels[:, 1:] != -100).sum())


def step_loss(model: Any, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """HF's per-token loss of one step's micro-batches (no gradient): token-loss sums / target count."""
    count = sum(targets(labels) for _, labels in micro_batches)
    with torch.no_grad():
        return sum(float(model(input_ids=ids, labels=labels).loss) * targets(labels)
                   for ids, labels in micro_batches if targets(labels)) / count


def randomise_lora_b(model: Any, seed: int, scale: float = 0.05) -> Any:
    """Draw every LoRA B factor from N(0, scale²) (PEFT initialises B = 0, which would leave A's
    gradient zero in the first step); returns ``model``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model
