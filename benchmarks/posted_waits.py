"""Time the engine spends waiting for acknowledged posted sends, against its step time.

    python -m benchmarks.posted_waits [--micro-batches 16 --steps 3]

After each receive the engine waits for the sends its peer had received before sending that
message (``ds_mp/engine/p2p.py``): they are done, so the wait should cost nothing, and
the posted sends keep their speed.  Two spawned CPU ranks (PP = 2, gloo) train a GPT-2 4 × 128
(vocab 203, micro-batches of 2 × 64) under 1F1B, ZB-H1 and interleaved (v = 2); per rank and
schedule: the seconds spent in those waits over all steps, how many there were, the step times,
and the bytes held by sends in flight at most.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SCHEDULES = ("1f1b", "zb-h1", "interleaved")


def _rank(rank: int, micro_batches: int, steps: int) -> dict:
    import ds_mp
    from ds_mp.engine.p2p import PostedSends
    from helpers import batches, ds_config, tiny_gpt2

    out, waited, received_from = {}, [0.0, 0], PostedSends.received_from

    def timed(self: PostedSends, peer: int) -> None:
        start = time.perf_counter()
        received_from(self, peer)
        waited[0] += time.perf_counter() - start
        waited[1] += 1

    PostedSends.received_from = timed
    for schedule in SCHEDULES:
        extra = {"pipeline": {"virtual_stages": 2}} if schedule == "interleaved" else {}
        cfg = ds_config(pp=2, micro=2, gas=micro_batches, lr=0.1, schedule=schedule, **extra)
        engine, *_ = ds_mp.initialize(model=tiny_gpt2(n_embd=128), config=cfg)
        engine.train_batch(iter(batches(micro_batches, 2, 64, 203, seed=99)))  # warm-up (and the compile)
        waited[:], times, peak = [0.0, 0], [], 0
        for i in range(steps):
            start = time.perf_counter()
            engine.train_batch(iter(batches(micro_batches, 2, 64, 203, seed=i)))
            times.append(time.perf_counter() - start)
            peak = max(peak, engine.posted.peak_bytes)
        out[schedule] = {"wait_s": waited[0], "waits": waited[1], "step_s": times, "peak_bytes": peak}
    return out


def main() -> None:
    from dist_utils import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    for rank, res in enumerate(run_ranks(_rank, 2, args.micro_batches, args.steps, timeout=900)):
        for schedule, r in res.items():
            share = r["wait_s"] / sum(r["step_s"])
            print(f"rank {rank} {schedule:12s} {r['waits']} waits: {1e3 * r['wait_s']:.2f} ms in all, "
                  f"{100 * share:.3f} % of {len(r['step_s'])} steps ({sum(r['step_s']):.2f} s); "
                  f"most held in flight {r['peak_bytes']} B")


if __name__ == "__main__":
    main()
