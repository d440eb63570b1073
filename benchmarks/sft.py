"""Packed vs padded supervised fine-tuning, and the document mask's cost, at TP=2 and PP=2.

    python -m benchmarks.run --only sft        (or python -m benchmarks.sft)

Data (what every machine has): every function of this Python's standard library with a
docstring becomes a pair ``signature + docstring -> body``; 1-3 pairs of one module make a
multi-turn chat (user: "Write the body of: ...", assistant: the body), so lengths run from a few
dozen tokens to far over a row, like instruction data. A byte-level BPE with ChatML is trained on
them; ``prepare_sft_data`` stores the chats (loss on the assistant turns); rows of ``SEQ`` tokens.

Configurations (GPT-2, 2 ranks × 1 thread each, ``ROWS`` rows of ``SEQ`` tokens per step, a cycle
of steps repeated; SGD at lr 0 so the weights stay the initial ones). The documents are those of
``STEPS_CYCLE × ROWS`` seeded packed rows in every configuration:

    {tp2,pp2}_packed   those best-fit-decreasing rows, ((input_ids, position_ids), labels): document mask
    {tp2,pp2}_padded   the same documents one per row, padded (more steps per cycle, same batch shape)
    {tp2,pp2}_causal   the packed rows as (input_ids, labels): plain causal attention, same tokens

Reported, each with its 90% bootstrap interval: target tokens/s of packed over padded (target
>= 1.8x) and the step time of packed over causal (the document mask's cost; target <= 1.15x).
target tokens/s = the cycle's mean target tokens per step / the median step time. "Same loss": the
target-weighted mean of one untimed pass's step losses, packed and padded, over the same documents
(their per-token loss at the initial weights) side by side.
"""
from __future__ import annotations

import ast
import os
import random
import shutil
import sys
import tempfile
import textwrap
from dataclasses import asdict
from typing import Any

from benchmarks.common import Config, bar_chart, load_span, run_side_by_side, speedup, summarize, table
from benchmarks.workloads import Bench, Shape, hf_model

DESCRIPTION = "SFT at TP=2 and PP=2: packed vs padded target tokens/s, document mask vs plain causal attention"
PACKED_TARGET, MASK_TARGET = 1.8, 1.15
SEQ, ROWS, STEPS_CYCLE = 1024, 4, 3
SHAPE = Shape(n_layer=4, n_embd=256, n_head=8, vocab=4096, seq=SEQ, n_positions=SEQ)
QUICK = Shape(n_layer=2, n_embd=128, n_head=4, vocab=2048, seq=256, n_positions=256)


def stdlib_chats(max_chats: int, seed: int = 0) -> list[dict]:
    """Multi-turn chats of (signature + docstring -> body) pairs from the stdlib's functions."""
    from ds_mp.data import stdlib_files

    rng = random.Random(seed)
    chats = []
    for path in stdlib_files():
        try:
            src = open(path, encoding="utf-8").read()
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines, pairs = src.splitlines(), []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and len(node.body) > 1:
                first = node.body[1].lineno - 1  # the first statement after the docstring
                head = textwrap.dedent("\n".join(lines[node.lineno - 1:first])).rstrip()
                body = textwrap.dedent("\n".join(lines[first:node.end_lineno])).rstrip()
                if body.strip() and head:
                    pairs.append((head, body))
        while pairs and len(chats) < max_chats:
            k = min(len(pairs), rng.randint(1, 3))
            msgs = []
            for head, body in pairs[:k]:
                msgs += [{"role": "user", "content": f"Write the body of:\n{head}"},
                         {"role": "assistant", "content": body}]
            chats.append({"messages": msgs})
            pairs = pairs[k:]
        if len(chats) >= max_chats:
            break
    return chats


def build_dataset(root: str, vocab: int, max_chats: int) -> str:
    from ds_mp.data import prepare_sft_data, train_tokenizer
    from ds_mp.data.sft_format import CHATML, CHATML_TOKENS

    chats = stdlib_chats(max_chats)
    tok = train_tokenizer((f"{m['role']}\n{m['content']}" for c in chats for m in c["messages"]), vocab - 2)
    tok.add_special_tokens({"additional_special_tokens": CHATML_TOKENS})
    tok.chat_template = CHATML
    tok.save_pretrained(os.path.join(root, "tok"))
    prepare_sft_data(chats, os.path.join(root, "data"), os.path.join(root, "tok"), "chat", val_fraction=0,
                     show_progress=False)
    return os.path.join(root, "data")


class SftBench(Bench):
    """ds_mp on a cycle of steps of ``ROWS`` rows, repeated. The cycle's documents are those of
    ``STEPS_CYCLE × ROWS`` seeded packed rows in every mode: ``packed`` trains those rows,
    ``padded`` the same documents one per row (the last step topped up with empty rows, which hold
    no target), ``causal`` the packed rows without position_ids (attention crosses documents)."""

    def __init__(self, rank: int, world: int, shape: dict, data: str, mode: str, tp: int = 1, pp: int = 1) -> None:
        import numpy as np
        import torch

        import ds_mp
        from ds_mp.data import SftDataset, SftRows, TokenDataset

        seq = shape["seq"]
        micro, gas = (ROWS, 1) if pp == 1 else (1, ROWS)
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
               "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "gradient_clipping": 0.0,
               "steps_per_print": 10**9, "wall_clock_breakdown": False,
               "ds_mp": {"tensor_parallel": {"size": tp}, "pipeline": {"stages": pp, "schedule": "1f1b"},
                         "data": {"seq_len": seq}}}
        self.engine, *_ = ds_mp.initialize(model=hf_model(shape), config=cfg)
        ds = SftDataset(TokenDataset(data))
        packed = SftRows(ds, seq, packing=True, seed=0)
        chosen = np.random.default_rng(0).permutation(len(packed.rows))[:STEPS_CYCLE * ROWS]
        rows, ids = packed, chosen
        if mode == "padded":  # the same documents, one per row (document d is row d when packing is off)
            rows, ids = SftRows(ds, seq, packing=False, seed=0), np.concatenate([packed.rows[r] for r in chosen])
        self.cycle, self.targets = [], []
        for s in range(0, len(ids), ROWS):
            (x, pos), labels = rows.batch(ids[s:s + ROWS], seq)
            empty = ROWS - len(x)  # rows of nothing but padding (no target)
            x = torch.cat([x, torch.full((empty, seq), ds.pad_id)])
            pos = torch.cat([pos, torch.arange(seq).expand(empty, seq)])
            labels = torch.cat([labels, torch.full((empty, seq), -100)])
            self.targets.append(rows.counts(ids[s:s + ROWS])[0])
            parts = [((x[i:i + micro], pos[i:i + micro]), labels[i:i + micro]) for i in range(0, ROWS, micro)]
            self.cycle.append(parts if mode != "causal" else [(a, lab) for (a, _), lab in parts])
        self.n = 0

    def step(self) -> float:
        loss = float(self.engine.train_batch(iter(self.cycle[self.n % len(self.cycle)])))
        self.n += 1
        return loss

    def stats(self) -> dict:
        """Target tokens per step (mean over the cycle) and the per-token loss of the cycle's documents
        (one untimed pass; SGD at lr 0 leaves the weights as they were)."""
        losses = [float(self.engine.train_batch(iter(step))) for step in self.cycle]
        return {"targets_per_step": sum(self.targets) / len(self.targets), "steps_per_cycle": len(self.cycle),
                "cycle_loss": sum(l * t for l, t in zip(losses, self.targets)) / sum(self.targets)}


def setup(rank: int, world: int, **kw: Any) -> SftBench:
    return SftBench(rank, world, **kw)


def run(quick: bool, out_dir: str) -> dict:
    shape = asdict(QUICK if quick else SHAPE)
    tmp = tempfile.mkdtemp(prefix="sft-bench-")
    try:
        return _run(quick, out_dir, shape, build_dataset(tmp, shape["vocab"], 400 if quick else 3000))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(quick: bool, out_dir: str, shape: dict, data: str) -> dict:
    from ds_mp.data import SftDataset, SftRows, TokenDataset

    plans = {m: SftRows(SftDataset(TokenDataset(data)), shape["seq"], packing=m, seed=0).report for m in (True, False)}
    layouts = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}
    cfgs = [Config(f"{lay}_{mode}", "benchmarks.sft:setup", 2, 1, {"shape": shape, "data": data, "mode": mode, **kw})
            for lay, kw in layouts.items() for mode in ("packed", "padded", "causal")]
    repeats, steps = (2, 1) if quick else (6, 2)
    stats: dict[str, dict] = {}

    def collect(groups: dict) -> None:
        for name, g in groups.items():
            stats[name] = g.call("stats")[0]  # rank 0 consumes the data in both layouts

    times, _ = run_side_by_side(cfgs, repeats, steps, extra=collect)
    res = summarize(times, {n: stats[n]["targets_per_step"] for n in times})
    ratios, rows, summary = {}, [], []
    for lay in layouts:
        p, d, c = (res[f"{lay}_{m}"] for m in ("packed", "padded", "causal"))
        gain = speedup(d["step_times_s"], p["step_times_s"],
                       stats[f"{lay}_packed"]["targets_per_step"] / stats[f"{lay}_padded"]["targets_per_step"])
        cost = speedup(c["step_times_s"], p["step_times_s"])  # causal time / packed time
        mask_cost = type(cost)(1 / cost.value, 1 / cost.hi, 1 / cost.lo)  # packed time / causal time
        ratios[f"{lay}_packed_vs_padded_target_tokens"] = gain.value
        ratios[f"{lay}_mask_vs_causal_step_time"] = mask_cost.value
        summary += [f"{lay}: packed vs padded target tokens/s {gain} (target >= {PACKED_TARGET}x: "
                    f"{gain.verdict(PACKED_TARGET)}); same documents' loss packed "
                    f"{stats[f'{lay}_packed']['cycle_loss']:.4f} vs padded {stats[f'{lay}_padded']['cycle_loss']:.4f}",
                    f"{lay}: document mask vs plain causal step time {mask_cost} (target <= {MASK_TARGET}x: "
                    f"{mask_cost.verdict(MASK_TARGET, at_least=False)})"]
        ratios[f"{lay}_intervals"] = {"packed_vs_padded": gain.as_dict(), "mask_vs_causal": mask_cost.as_dict()}
        for m in ("packed", "padded", "causal"):
            r, s = res[f"{lay}_{m}"], stats[f"{lay}_{m}"]
            rows.append([f"{lay}_{m}", f"{r['median_s']:.2f}", f"{s['targets_per_step']:.0f}",
                         f"{r['tokens_per_s']:.0f}", f"±{r['iqr_rel']:.0%}", f"{s['cycle_loss']:.4f}", load_span(r)])
    summary.append(f"rows of {shape['seq']}: packed {plans[True]['rows']} rows, padding "
                   f"{plans[True]['padding_fraction']:.1%}; padded {plans[False]['rows']} rows, padding "
                   f"{plans[False]['padding_fraction']:.1%} ({plans[True]['documents']} chats, "
                   f"{plans[True]['truncated']} truncated to a row)")
    summary.append("intervals are 90% bootstrap intervals over the timed steps; 2-core machine shared with other jobs")
    for line in summary:
        print("  " + line)
    labels = [f"{lay} {k}" for lay in layouts for k in ("packed/padded", "mask/causal")]
    values = [ratios[f"{lay}_{k}"] for lay in layouts for k in ("packed_vs_padded_target_tokens",
                                                                  "mask_vs_causal_step_time")]
    plot = bar_chart(os.path.join(out_dir, "sft.png"), labels, values,
                     "SFT: packed/padded target tokens/s; document-mask/causal step time", "ratio")
    return {"workload": f"{Shape(**shape).describe()}, {ROWS} rows per step, stdlib chats", "configs": res,
            "stats": stats, "plans": {str(k): v for k, v in plans.items()},
            "ratios": {k: v for k, v in ratios.items() if not isinstance(v, dict)},
            "intervals": {k: v for k, v in ratios.items() if isinstance(v, dict)},
            "summary": summary, "repeats": repeats, "steps_per_repeat": steps, "plots": [os.path.basename(plot)],
            "tables": [table("SFT step time, target tokens/s and loss", ["config", "median step s", "targets/step",
                                                                          "target tokens/s", "step-time IQR",
                                                                          "cycle loss", "load before → after"], rows)]}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "sft", *sys.argv[1:]]))
