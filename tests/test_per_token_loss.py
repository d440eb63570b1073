"""The loss is per target token over the global batch, whatever the split (TRL's invariance test):
20 SGD steps on one stream of packed SFT batches of 8 rows, as 8 × 1, 4 × GA 2, DP 2, PP 2 (1F1B)
and PP 2 TeraPipe, give the same losses; DeepSpeed's mean of micro-batch means (``loss.normalization
= "micro_batch"``) does not (its losses depend on the split: the bug this default mends)."""
from __future__ import annotations

import torch

from dist_utils import run_ranks
from helpers import ds_config, tiny_gpt2
from sft_data import pack, documents

V, SEQ, ROWS, STEPS, LR = 97, 16, 8, 20, 0.2
INVARIANT = 1e-5  # fp32, 20 steps: the splits sum the same token losses in another order (measured ≤ 1e-6)


def stream() -> list:
    """STEPS global batches of ROWS packed rows (prompts masked, documents of 2-8 tokens)."""
    out = []
    for s in range(STEPS):
        (ids, pos), labels = pack(documents(24, V, seed=500 + s, lengths=(2, 8)), ROWS, SEQ)[0]
        out.append((ids, pos, labels))
    return out


def split(batch: tuple, micro: int, parts: slice = slice(None)) -> list:
    """The global batch as micro-batches of ``micro`` rows (``parts``: this replica's)."""
    ids, pos, labels = batch
    return [((ids[r:r + micro], pos[r:r + micro]), labels[r:r + micro]) for r in range(0, ROWS, micro)][parts]


LAYOUTS = {  # name: (world, micro, gas, pp, extra ds_mp keys)
    "8x1": (1, 8, 1, 1, {}), "4xGA2": (1, 4, 2, 1, {}),
    "dp2": (2, 4, 1, 1, {}), "pp2": (2, 4, 2, 2, {}),
    "pp2_terapipe": (2, 4, 2, 2, {"schedule": "terapipe", "terapipe": {"slices": [6, 10]}}),
}


def _rank(rank: int, world: int, normalization: str) -> dict:
    import ds_mp

    out = {}
    for name, (w, micro, gas, pp, extra) in LAYOUTS.items():
        if w != world:
            continue
        extra = dict(extra)
        schedule = extra.pop("schedule", "1f1b")
        cfg = ds_config(pp=pp, micro=micro, gas=gas, lr=LR, seq=SEQ, schedule=schedule,
                        loss={"normalization": normalization}, **extra)
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(n_layer=2, n_embd=32, vocab=V), config=cfg)
        dp = world // pp
        mine = slice(engine.topology.dp_rank * gas, (engine.topology.dp_rank + 1) * gas) if dp > 1 else slice(None)
        out[name] = [float(engine.train_batch(iter(split(b, micro, mine)))) for b in stream()]
    return out


def _losses(normalization: str) -> dict:
    out: dict = {}
    for world in (1, 2):
        out.update(run_ranks(_rank, world, world, normalization, timeout=400)[0])
    return out


def test_per_token_loss_is_invariant_to_the_split() -> None:
    losses = _losses("tokens")
    base = losses["8x1"]
    for name, got in losses.items():
        assert max(abs(a - b) for a, b in zip(got, base)) <= INVARIANT, f"{name}: {got} vs 8x1 {base}"
    assert base[-1] < base[0]


def test_mean_of_micro_batch_means_depends_on_the_split() -> None:
    """The opt-in ``micro_batch`` normalization is DeepSpeed's: 8 × 1 and 4 × GA 2 differ on masked data."""
    losses = run_ranks(_rank, 1, 1, "micro_batch", timeout=400)[0]
    assert max(abs(a - b) for a, b in zip(losses["8x1"], losses["4xGA2"])) > 1e-3
