"""The step driven by ``ds_mp.hf.Trainer`` against ds_mp's own loop (``engine.train_batch`` on
ready micro-batches, as ``launch/train.py`` runs it), same engine, layout and data, at TP = 2 and at
PP = 2 (1F1B) in one run.

    python -m benchmarks.hf_trainer            (python -m benchmarks.hf_trainer --quick: small)
    python -m benchmarks.run --only hf_trainer (writes results/hf_trainer.json and RESULTS.md)

Per layout, two CPU ranks (gloo, 1 thread each) train a GPT-2 shape on fixed-length rows
(micro-batch ``ROWS`` × ``SEQ``, ``GA`` micro-batches per step, AdamW). Blocks alternate on the same
engine: a block of ``STEPS`` direct ``train_batch`` calls and ``trainer.train()`` for ``STEPS`` steps
(the Trainer's whole step: data loader, collation, fixed rows, callbacks, the stop flag's per-step
all-reduce, logging every step); the direct block runs first in even repeats, the Trainer block in
odd ones (the first block of a repeat ran slower/faster for warm-up reasons, an order bias); the
first step of each block is dropped. Trainer step time = the interval between successive
``on_step_end`` callbacks (everything between two steps). Reported per layout: median Trainer step /
median direct step with a 90% bootstrap interval (target ≤ 1.05×), over all repeats and per order
(direct first / Trainer first: the two should agree; if they do not, the order still biases the
result). The layouts run one after the other; the load average is recorded around each.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import load_avg, machine, spawn_once, speedup, table

DESCRIPTION = "ds_mp.hf.Trainer step vs ds_mp's own train_batch loop, TP=2 and PP=2, same engine and data"
SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 2048}
ROWS, SEQ, GA = 4, 256, 4
LAYOUTS = {"tp2": {"tensor_parallel": {"size": 2}}, "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b"}}}


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, steps: int, repeats: int, layout: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from transformers import TrainerCallback, TrainingArguments

    from ds_mp.hf import Trainer

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": row, "labels": row} for row in
            torch.randint(0, SHAPE["vocab"], (ROWS * GA * steps, SEQ), generator=g).tolist()]

    def collate(batch: list[dict]) -> dict:
        return {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 0}, "ds_mp": {**LAYOUTS[layout], "data": {"seq_len": SEQ}}}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=ROWS, gradient_accumulation_steps=GA,
                             max_steps=steps, learning_rate=1e-4, optim="adamw_torch", logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, deepspeed=ds)
    trainer = Trainer(model=model_dir, args=args, train_dataset=data, data_collator=collate, callbacks=[Clock()])
    engine = trainer.ds_mp_engine
    micro = [collate(data[i:i + ROWS]) for i in range(0, len(data), ROWS)]
    direct, driven, first = [], [], []
    for r in range(repeats):  # repeat r runs the Trainer block first when r is odd: no order bias
        trainer_first = r % 2 == 1
        blocks = ("trainer", "direct") if trainer_first else ("direct", "trainer")
        for block in blocks:
            if block == "direct":
                times = []
                for s in range(steps):
                    t0 = time.perf_counter()
                    engine.train_batch(iter(micro[s * GA:(s + 1) * GA]))
                    times.append(time.perf_counter() - t0)
                direct.append(times[1:])
            else:
                ends.clear()
                trainer.train()
                driven.append([b - a for a, b in zip(ends, ends[1:])])
        first.append("trainer" if trainer_first else "direct")
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump({"direct": direct, "trainer": driven, "first": first}, f)


def _measure(model_dir: str, tmp: str, steps: int, repeats: int, layout: str) -> dict:
    """One layout's step times (2 spawned ranks) and their ratios."""
    load0 = load_avg()
    spawn_once(_rank, 2, model_dir, tmp, steps, repeats, layout, what=f"hf_trainer {layout} ranks", timeout=1800)
    with open(os.path.join(tmp, "times.json")) as f:
        times = json.load(f)
    flat = {k: [t for block in times[k] for t in block] for k in ("direct", "trainer")}
    by_order = {}
    for order in ("direct", "trainer"):
        picked = [r for r, f in enumerate(times["first"]) if f == order]
        by_order[order] = speedup([t for r in picked for t in times["trainer"][r]],
                                  [t for r in picked for t in times["direct"][r]])
    return {"times": times, "ratio": speedup(flat["trainer"], flat["direct"]), "by_order": by_order,
            "median": {k: sorted(v)[len(v) // 2] for k, v in flat.items()}, "count": {k: len(v) for k, v in flat.items()},
            "load": [load0, load_avg()]}


def run(quick: bool, out_dir: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    steps, repeats = (3, 2) if quick else (6, 6)  # even: both orders equally often
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=SHAPE["n_layer"], n_embd=SHAPE["n_embd"], n_head=SHAPE["n_head"],
                                   vocab_size=SHAPE["vocab"], n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)).save_pretrained(os.path.join(tmp, "model"))
        for layout in LAYOUTS:
            got[layout] = _measure(os.path.join(tmp, "model"), tmp, steps, repeats, layout)
    rows = [[layout.upper(), f"{g['median']['direct']:.3f}", f"{g['median']['trainer']:.3f}", str(g["ratio"]),
             str(g["by_order"]["direct"]), str(g["by_order"]["trainer"]), g["count"]["trainer"],
             f"{g['load'][0]:.1f} -> {g['load'][1]:.1f}"] for layout, g in got.items()]
    return {"tables": [table("Trainer-driven step vs ds_mp's own loop (engine.train_batch), 2 CPU ranks",
                             ["layout", "own loop median step s", "Trainer median step s", "Trainer / own loop",
                              "direct block first", "Trainer block first", "steps timed each", "1-min load"],
                             rows)],
            "summary": [f"{layout.upper()}: Trainer step / own loop {g['ratio']} (target <= 1.05x: "
                        f"{g['ratio'].verdict(1.05, at_least=False)}); load {g['load'][0]:.1f} -> {g['load'][1]:.1f}"
                        for layout, g in got.items()],
            "ratios": {f"{layout}_trainer_over_own_loop": g["ratio"].as_dict() for layout, g in got.items()} |
                      {f"{layout}_{k}_block_first": v.as_dict() for layout, g in got.items()
                       for k, v in g["by_order"].items()},
            "times": {layout: g["times"] for layout, g in got.items()},
            "workload": f"GPT-2 {SHAPE['n_layer']} x {SHAPE['n_embd']}, vocab {SHAPE['vocab']}, {ROWS} rows x {SEQ} "
                        f"tokens, GA {GA}, AdamW; TP=2 and PP=2 (1F1B), 2 CPU ranks",
            "repeats": repeats, "steps_per_repeat": steps,
            "shape": {**SHAPE, "rows": ROWS, "seq": SEQ, "ga": GA}, "machine": machine()}


if __name__ == "__main__":
    from benchmarks.run import main

    sys.exit(main(["--only", "hf_trainer", *sys.argv[1:]]))
