"""The step driven by ``ds_mp.hf.Trainer`` against ds_mp's own loop (``engine.train_batch`` on
ready micro-batches, as ``launch/train.py`` runs it), same engine, layout and data.

    python -m benchmarks.hf_trainer            (python -m benchmarks.hf_trainer --quick: small)

Two CPU ranks at TP = 2 (gloo, 1 thread each) train a GPT-2 shape on fixed-length rows (micro-batch
``ROWS`` × ``SEQ``, ``GA`` micro-batches per step, AdamW). Blocks alternate on the same engine: a
block of ``STEPS`` direct ``train_batch`` calls and ``trainer.train()`` for ``STEPS`` steps (the
Trainer's whole step: data loader, collation, fixed rows, callbacks, logging every step); the
direct block runs first in even repeats, the Trainer block in odd ones (the first block of a repeat
ran slower/faster for warm-up reasons, an order bias); the first step of each block is dropped. Trainer step time = the interval between successive ``on_step_end``
callbacks (everything between two steps). Reported: median Trainer step / median direct step with a
90% bootstrap interval (target ≤ 1.05×), over all repeats and per order (direct first / Trainer
first: the two should agree; if they do not, the order still biases the result).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import load_avg, machine, spawn_once, speedup, table

DESCRIPTION = "ds_mp.hf.Trainer step vs ds_mp's own train_batch loop, TP=2, same engine and data"
SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 2048}
ROWS, SEQ, GA = 4, 256, 4


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, steps: int, repeats: int) -> None:
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
          "zero_optimization": {"stage": 0}, "ds_mp": {"tensor_parallel": {"size": 2}, "data": {"seq_len": SEQ}}}
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


def run(quick: bool, out_dir: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    steps, repeats = (3, 2) if quick else (6, 6)  # even: both orders equally often
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=SHAPE["n_layer"], n_embd=SHAPE["n_embd"], n_head=SHAPE["n_head"],
                                   vocab_size=SHAPE["vocab"], n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)).save_pretrained(os.path.join(tmp, "model"))
        load0 = load_avg()
        spawn_once(_rank, 2, os.path.join(tmp, "model"), tmp, steps, repeats, what="hf_trainer ranks", timeout=1800)
        with open(os.path.join(tmp, "times.json")) as f:
            times = json.load(f)
    flat = {k: [t for block in times[k] for t in block] for k in ("direct", "trainer")}
    ratio = speedup(flat["trainer"], flat["direct"])
    by_order = {}
    for order in ("direct", "trainer"):
        picked = [r for r, f in enumerate(times["first"]) if f == order]
        by_order[order] = speedup([t for r in picked for t in times["trainer"][r]],
                                  [t for r in picked for t in times["direct"][r]])
    med = {k: sorted(v)[len(v) // 2] for k, v in flat.items()}
    return {"tables": [table("Trainer-driven step vs ds_mp's own loop (TP=2, 2 CPU ranks)",
                             ["loop", "median step s", "steps timed"],
                             [["engine.train_batch (launch/train.py's loop)", f"{med['direct']:.3f}",
                               len(flat["direct"])],
                              ["ds_mp.hf.Trainer.train()", f"{med['trainer']:.3f}", len(flat["trainer"])]])],
            "summary": [f"Trainer step / own loop: {ratio} (target <= 1.05x: {ratio.verdict(1.05, at_least=False)}); "
                        f"load {load0:.1f} -> {load_avg():.1f}",
                        f"by order: direct block first {by_order['direct']}, Trainer block first {by_order['trainer']}"],
            "ratios": {"trainer_over_own_loop": ratio.as_dict(),
                       **{f"{k}_block_first": v.as_dict() for k, v in by_order.items()}}, "times": times,
            "shape": {**SHAPE, "rows": ROWS, "seq": SEQ, "ga": GA}, "machine": machine()}


if __name__ == "__main__":
    result = run("--quick" in sys.argv, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    for t in result["tables"]:
        print(t["title"], *(" | ".join(map(str, r)) for r in t["rows"]), sep="\n")
    print("\n".join(result["summary"]))
