"""Preference test data and TRL 1.16's own DPO loss as the oracle (``DPOTrainer._compute_loss`` on
HF models with TRL's fused LM head, one process): shared by the DPO spec, engine and launcher tests."""
from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch

from ds_mp.losses import IGNORE, shift_labels


def pairs(n: int, vocab: int, seed: int = 0, long: int = 20) -> list[dict[str, list[int]]]:
    """``n`` tokenized pairs (TRL's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``) of very uneven
    lengths: prompts of 1 to 6 tokens, completions of 1 to ``long`` tokens, chosen and rejected of
    different lengths."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
    return [{"prompt_ids": ids(1, 6), "chosen_ids": ids(1, long), "rejected_ids": ids(1, long)} for _ in range(n)]


def collate(examples: list[dict], max_length: int | None = None, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """TRL's ``DataCollatorForPreference`` (``[chosen; rejected]`` rows, right padding, truncation
    ``keep_start`` at ``max_length``), padded on to ``pad_to`` columns if given."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    out = DataCollatorForPreference(pad_token_id=0, max_length=max_length)(examples)
    if pad_to is not None:
        extra = pad_to - out["input_ids"].shape[1]
        out = {k: torch.nn.functional.pad(v, (0, extra)) for k, v in out.items()}
    return out


def labels_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL's labels: the ids with every non-completion position -100."""
    return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)


def trl_models(policy: Any, ref: Any) -> tuple[Any, Any]:
    """Copies of the HF ``policy`` and ``ref`` with TRL's fused LM head, as its ``__init__`` patches them."""
    from trl.trainer.utils import add_fused_lm_head

    policy, ref = copy.deepcopy(policy), copy.deepcopy(ref)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    return policy, ref


def trl_loss(policy: Any, ref: Any, batch: dict[str, torch.Tensor], beta: float = 0.1,
             loss_type: tuple = ("sigmoid",), loss_weights: Any = None, label_smoothing: float = 0.0,
             patched: bool = False) -> tuple[torch.Tensor, dict[str, float], Any]:
    """TRL 1.16's ``DPOTrainer._compute_loss`` on ``batch`` (its own code, on :func:`trl_models`' copies
    of ``policy`` and ``ref``, or on them as they are if ``patched``), reference log-probs from ``ref``
    on the fly: the loss, the logged metrics and the policy the loss has its graph into."""
    from trl.trainer.dpo_trainer import DPOTrainer

    if not patched:
        policy, ref = trl_models(policy, ref)
    gather = lambda x: x  # noqa: E731 - one process
    fake = SimpleNamespace(
        model=policy, ref_model=ref, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=gather,
                                                                 gather_for_metrics=gather),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
        loss_types=list(loss_type), loss_weights=list(loss_weights or [1.0] * len(loss_type)), beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    policy.train()
    loss = DPOTrainer._compute_loss(fake, policy, dict(batch), False)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}, policy


def row_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's sum of completion-token log-probs under the HF ``model`` (torch, no TRL)."""
    targets = shift_labels(labels_of(batch))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), dim=-1)
    keep = targets != IGNORE
    return (logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum(dim=1)


__all__ = ["pairs", "collate", "labels_of", "trl_models", "trl_loss", "row_logps"]
