"""ZB-V at PP = 4, projected: the simulator fed op costs traced here at PP = 2.

This machine has 2 cores, so PP = 4 cannot be measured; the issue asks what it would project.
Two CPU ranks train the peers benchmark's GPT-2 (6 × 256, vocab 4096, seq 256; M = 4 micro-batches
of 2 rows, fp32 SGD, one thread per rank) with ``"schedule": "zb-v"`` and record every instruction
(``engine.record_trace``).  Each op's cost is the median over the traced steps and micro-batches of
``VForward`` / ``VBackwardInput`` / ``VBackwardWeight`` on rank 1, whose two chunks hold blocks only
(the uniform V split [1, 2, 2, 1]: rank 0's chunks carry the embedding and the head).  A PP = 4 stage
is taken to be two such chunks (stage costs F, B, W = twice rank 1's chunk costs) and
:func:`ds_mp.schedules.zb_v.projection` simulates every schedule at the same work: 1F1B and
interleaved run B + W as one backward, ZB-H1 and ZB-V split it.  A projection, not a measurement:
the embedding and head, p2p, the engine's per-instruction work and the optimizer step are left out
(the simulator fed traced op times predicted 0.82 of a traced zb-v step at PP = 2).

    python -m benchmarks.zb_v_projection            # writes benchmarks/results/zb_v_projection.json
    python -m benchmarks.zb_v_projection --quick    # GPT-2 6 × 128, seq 128; prints only
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from typing import Any

from benchmarks.common import load_avg, machine, spawn_once

FULL = {"n_layer": 6, "n_embd": 256, "n_head": 8, "vocab": 4096, "seq": 256}
QUICK = {"n_layer": 6, "n_embd": 128, "n_head": 4, "vocab": 2048, "seq": 128}
ROWS, M, KINDS = 2, 4, {"VForward": "F", "VBackwardInput": "B", "VBackwardWeight": "W"}


def _rank(rank: int, world: int, port: int, shape: dict, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel

    import ds_mp

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                                       vocab_size=shape["vocab"], n_positions=shape["seq"], resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": M, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "ds_mp": {"pipeline": {"stages": 2, "schedule": "zb-v"}, "data": {"seq_len": shape["seq"]},
                     "training": {"output_dir": out}}}
    engine, *_ = ds_mp.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (steps + 1, M, ROWS, shape["seq"]), generator=g)
    ops: dict[str, list[float]] = {}
    for i in range(steps + 1):  # the first step warms up, untraced
        engine.record_trace(i > 0)
        engine.train_batch(iter([(x, x) for x in ids[i]]))
    for name, _, start, end in engine.trace:
        kind, _, unit = name.partition("@")
        if kind in KINDS and unit:
            ops.setdefault(f"{KINDS[kind]}{unit.split('.')[1]}", []).append(end - start)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(ops, f)


def run(quick: bool, out_dir: str) -> dict:
    from ds_mp.schedules.zb_v import projection

    shape, steps = (QUICK, 2) if quick else (FULL, 6)
    with tempfile.TemporaryDirectory() as tmp:
        load0 = load_avg()
        spawn_once(_rank, 2, shape, steps, tmp, what="zb-v trace ranks", timeout=1800)
        traced = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                traced.append(json.load(f))
    chunk = {r: {k: statistics.median(v) for k, v in traced[r].items()} for r in range(2)}
    stage = {k: chunk[1][f"{k}0"] + chunk[1][f"{k}1"] for k in "FBW"}  # rank 1: two chunks of blocks
    rows = []
    for m in (4, 8, 16):
        t = projection(4, m, stage["F"], stage["B"], stage["W"])
        rows.append({"M": m, **{k: t["1f1b"] / v for k, v in t.items() if k != "1f1b"}})
    return {"shape": {**shape, "rows": ROWS, "micro_batches": M, "traced_steps": steps},
            "chunk_costs_s": chunk, "stage_costs_s": stage, "pp4_over_1f1b": rows,
            "load": [load0, load_avg()], "machine": machine()}


def report(result: dict) -> str:
    s = result["stage_costs_s"]
    keys = [k for k in result["pp4_over_1f1b"][0] if k != "M"]
    lines = [f"stage costs (s, rank 1's two chunks): F {s['F']:.4f}  B {s['B']:.4f}  W {s['W']:.4f}; "
             f"load {result['load'][0]:.1f} -> {result['load'][1]:.1f}",
             "| PP = 4 | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| M = {row['M']} | " + " | ".join(f"{row[k]:.2f}×" for k in keys) + " |"
              for row in result["pp4_over_1f1b"]]
    return "\n".join(lines)


def main(argv: list[str]) -> Any:
    quick = "--quick" in argv
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    result = run(quick, out_dir)
    if not quick:
        with open(os.path.join(out_dir, "zb_v_projection.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(report(result))


if __name__ == "__main__":
    main(sys.argv[1:])
