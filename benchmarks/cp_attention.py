"""Context-parallel attention alone (``ds_mp.context_parallel.attention``): forward + backward of one
attention at T = 2048 on 2 CPU cores, CP = 2 (both impls) against one process.

Configurations (the same ``(1, h, T, hd)`` q and GQA k/v, one document of T tokens, SDPA with the
layout's boolean mask, as ds_mp runs a Layout):

    mask_1x1       one process × 1 thread, SDPA over the full (T, T) mask           (baseline)
    mask_1x2       one process × 2 threads
    causal_1x1     one process × 1 thread, ``is_causal`` (ds_mp's path for a row without a Layout)
    allgather_cp2  2 ranks × 1 thread: K/V all-gathered (zigzag), dK/dV reduce-scattered
    ulysses_cp2    2 ranks × 1 thread: all-to-all to a head split and back

Reported: tokens/s (attention steps) over ``mask_1x1`` and over ``mask_1x2`` with 90% bootstrap
intervals, and CPU seconds per step.  ``python -m benchmarks.run --only cp_attention``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import Config, fmt_ratio, load_span, run_side_by_side, summarize, table, tokens_ratio

DESCRIPTION = "context-parallel attention fwd+bwd, T=2048: allgather vs ulysses at CP=2 vs one process"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


class AttentionBench:
    """One attention's forward and backward on this rank's tokens (all of them at CP = 1)."""

    def __init__(self, rank: int, world: int, impl: str, seq: int, causal: bool = False) -> None:
        from ds_mp.context_parallel.shard import shard_index
        from ds_mp.context_parallel.rules import balanced_for
        from ds_mp.models.batch import Layout

        self.impl, self.world, self.rank, self.causal = impl, world, rank, causal
        g = torch.Generator().manual_seed(0)
        q, self.g = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g) for _ in range(2))
        k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g) for _ in range(2))
        self.kv_index = torch.arange(HEADS) // (HEADS // KV_HEADS)
        pos = torch.arange(seq)[None]
        idx = shard_index(seq, world, rank, balanced_for(impl)) if world > 1 else None
        lay = Layout(pos, torch.ones_like(pos), None, idx)
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.group = dist.new_group(list(range(world)))
            q, k, v, self.g = (t[:, :, idx] for t in (q, k, v, self.g))
            add = torch.float32  # the additive mask Ctx.cp_attention passes
            self.mask = lay.run_masks(2, dtype=add) if impl == "allgather" else lay.mask(seq, seq, dtype=add)
        else:
            self.mask = None if causal else lay.mask(seq, seq)
        self.q, self.k, self.v = (t.contiguous().requires_grad_() for t in (q, k, v))

    def step(self) -> None:
        from ds_mp.context_parallel.attention import allgather_attention, ulysses_attention

        q, k, v = self.q, self.k, self.v
        if self.world == 1:
            kk, vv = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=self.mask, is_causal=self.causal)
        elif self.impl == "allgather":
            y = allgather_attention(q, k, v, None, self.mask, group=self.group, cp=self.world, cp_rank=self.rank)
        else:
            y = ulysses_attention(q, k, v, None, self.mask, group=self.group, cp=self.world, cp_rank=self.rank)
        (y * self.g).sum().backward()
        for t in (q, k, v):
            t.grad = None


def setup(rank: int, world: int, **kwargs: Any) -> AttentionBench:
    return AttentionBench(rank, world, **kwargs)


def configs(quick: bool) -> tuple[list[Config], int]:
    seq = 512 if quick else 2048
    one = {"impl": "allgather", "seq": seq}
    return [Config("mask_1x1", "benchmarks.cp_attention:setup", 1, 1, one),
            Config("mask_1x2", "benchmarks.cp_attention:setup", 1, 2, one),
            Config("causal_1x1", "benchmarks.cp_attention:setup", 1, 1, {**one, "causal": True}),
            Config("allgather_cp2", "benchmarks.cp_attention:setup", 2, 1, one),
            Config("ulysses_cp2", "benchmarks.cp_attention:setup", 2, 1, {"impl": "ulysses", "seq": seq})], seq


def run(quick: bool, out_dir: str) -> dict:
    cfgs, seq = configs(quick)
    repeats, steps = (2, 1) if quick else (8, 2)
    times, _ = run_side_by_side(cfgs, repeats, steps)
    res = summarize(times, {c.name: seq for c in cfgs})
    rows, intervals = [], {}
    for c in cfgs:
        r = res[c.name]
        one, two = tokens_ratio(res, c.name, "mask_1x1"), tokens_ratio(res, c.name, "mask_1x2")
        intervals[f"{c.name}_vs_mask_1x1"], intervals[f"{c.name}_vs_mask_1x2"] = one.as_dict(), two.as_dict()
        rows.append([c.name, f"{c.ranks} × {c.threads}", f"{r['median_s'] * 1e3:.0f}", str(one), str(two),
                     f"±{r['iqr_rel']:.0%}", fmt_ratio(r["cpu_s"] / res["mask_1x1"]["cpu_s"]), load_span(r)])
    ag_vs_ul = tokens_ratio(res, "allgather_cp2", "ulysses_cp2")
    intervals["allgather_vs_ulysses"] = ag_vs_ul.as_dict()
    summary = [f"allgather CP=2 vs one process × 1 thread: {tokens_ratio(res, 'allgather_cp2', 'mask_1x1')}",
               f"ulysses CP=2 vs one process × 1 thread: {tokens_ratio(res, 'ulysses_cp2', 'mask_1x1')}",
               f"allgather vs ulysses at CP=2: {ag_vs_ul}",
               f"heads {HEADS}, key/value heads {KV_HEADS}, head_dim {HEAD_DIM}, one document of {seq} tokens",
               "intervals are 90% bootstrap intervals over the timed steps"]
    for line in summary:
        print("  " + line)
    return {"workload": f"attention fwd+bwd, 1 × {seq} tokens", "configs": res, "intervals": intervals,
            "summary": summary, "plots": [],
            "tables": [table("attention forward + backward",
                             ["config", "ranks × threads", "median ms/step", "tokens/s vs mask 1×1 [90% interval]",
                              "tokens/s vs mask 1×2 [90% interval]", "step-time IQR", "CPU s/step vs 1×1",
                              "load before → after (max)"], rows)],
            "repeats": repeats, "steps_per_repeat": steps}
