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


def tiny_qwen3(kv: int = 2, tied: bool = False, n_layer: int = 2, seed: int = 0, vocab: int = 1003,
               inner: int = 192, **config: Any):
    """A tiny HF ``Qwen3ForCausalLM``: hidden 96, 6 heads of head_dim 20 (not 96 / 6), q/k norms and
    every RMSNorm moved away from 1 (so a wrong cut or an unsummed gradient shows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=96, intermediate_size=inner, num_hidden_layers=n_layer, num_attention_heads=6,
                      num_key_value_heads=kv, head_dim=20, vocab_size=vocab, max_position_embeddings=64,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-5, **config)
    return _perturb_norms(Qwen3ForCausalLM(cfg).eval())


def tiny_gemma3(kv: int = 2, tied: bool = True, n_layer: int = 2, seed: int = 0, vocab: int = 1003,
                inner: int = 192, window: int = 5, layer_types: list | None = None, **config: Any):
    """A tiny HF ``Gemma3ForCausalLM``: hidden 96, 6 heads of head_dim 20, query_pre_attn_scalar 24,
    ``layer_types`` (default: sliding then full attention, ``window`` keys) with RoPE bases 10k and 1M,
    the full layers' scaled linearly by 8 (as the released 4B+ models), final logits soft-capped at 3,
    pad id 0 (its row frozen, as HF's padding_idx); norms perturbed."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    types = layer_types or ["sliding_attention", "full_attention"] * (n_layer // 2) + ["sliding_attention"] * (n_layer % 2)
    cfg = Gemma3TextConfig(hidden_size=96, intermediate_size=inner, num_hidden_layers=n_layer, num_attention_heads=6,
                           num_key_value_heads=kv, head_dim=20, query_pre_attn_scalar=24, vocab_size=vocab,
                           max_position_embeddings=64, sliding_window=window, layer_types=types,
                           final_logit_softcapping=3.0, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6}}, **config)
    return _perturb_norms(Gemma3ForCausalLM(cfg).eval())


def _perturb_norms(model: Any) -> Any:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model
