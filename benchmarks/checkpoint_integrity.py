"""What checkpoint integrity costs: ``load_checkpoint`` with and without CRC32C verification
of a GPT-2-small-shaped training checkpoint (124 M parameters, Adam: ~1.5 GB), side by side.

    python -m benchmarks.checkpoint_integrity [--rounds 5] [--ranks 1] [--quick]

One spawned rank builds GPT-2 small (fresh init, fp32, AdamW), takes one step so the Adam
moments exist, and saves the checkpoint (``save_checkpoint``: the manifest is part of it; the
checksumming alone is timed too).  Then ``--ranks`` ranks (TP = ranks) load it ``--rounds``
times with ``verify=True`` and ``verify=False``, alternating which goes first, so drifts of a
shared machine hit both alike; wall and CPU seconds (user + system of the loading process,
far less disturbed by other jobs on a busy machine than wall time) are both kept.  At TP 2 each rank reads half of every split tensor but
verifies whole files: the worst case of "each rank verifies the files it reads".  Reported:
the ratio of median load times (verified / unverified) with a 90% bootstrap interval, the
spread of each, and the raw CRC32C throughput.  The page cache is warm (the files were just
written or read), so verification is pure extra CPU: the worst case for the ratio; from a
cold disk the verifying read also warms the cache for the load.  Writes
``results/checkpoint_integrity.json`` (``--quick``: a 4-layer model, ``results/quick/``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024, "dropout": 0.0}
QUICK = {**SMALL, "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192}


def _config(shape: dict, tp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "ds_mp": {"model": shape, "tensor_parallel": {"size": tp}, "data": {"seq_len": 32}}}


def _save(rank: int, shape: dict, root: str) -> dict:
    import ds_mp
    from ds_mp.checkpoint import save_checkpoint
    from ds_mp.checkpoint.integrity import crc32c
    from helpers import batches

    engine, *_ = ds_mp.initialize(config=_config(shape, 1))
    engine.train_batch(iter(batches(1, 1, 32, shape["vocab_size"])))
    t0 = time.perf_counter()
    path = save_checkpoint(engine, root, "bench")
    save_s = time.perf_counter() - t0
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))]
    crc_s = []
    for _ in range(3):  # the checksumming a save adds (files in the page cache, as at save)
        t0 = time.perf_counter()
        for f in files:
            crc32c(f)
        crc_s.append(time.perf_counter() - t0)
    size = sum(os.path.getsize(f) for f in files)
    return {"save_s": save_s, "checksum_all_files_s": crc_s, "bytes": size, "files": len(files),
            "crc_gb_per_s": size / min(crc_s) / 1e9}


def _load(rank: int, shape: dict, root: str, rounds: int, tp: int) -> dict:
    import torch.distributed as dist

    import ds_mp
    from ds_mp.checkpoint import load_checkpoint

    engine, *_ = ds_mp.initialize(config=_config(shape, tp))
    load_checkpoint(engine, root, "bench", verify=False)  # warm-up: page cache, allocator
    times: dict[str, list[float]] = {"verify": [], "no_verify": [], "verify_cpu": [], "no_verify_cpu": []}
    for i in range(rounds):
        for verify in ((True, False) if i % 2 == 0 else (False, True)):
            if dist.is_initialized():
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            load_checkpoint(engine, root, "bench", verify=verify)
            key = "verify" if verify else "no_verify"
            times[key].append(time.perf_counter() - t0)
            times[key + "_cpu"].append(time.process_time() - c0)  # user + system: robust to a busy machine
    return times


def main() -> None:
    from benchmarks.common import load_avg, machine, speedup
    from dist_utils import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1, help="load at TP = ranks (1 or 2)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    shape = QUICK if a.quick else SMALL
    out_dir = os.path.join(HERE, "results", "quick" if a.quick else "")
    os.makedirs(out_dir, exist_ok=True)
    load0 = load_avg()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as root:
        save = run_ranks(_save, 1, shape, root, timeout=1800)[0]
        print(f"saved {save['bytes'] / 1e9:.2f} GB in {save['files']} files in {save['save_s']:.1f}s; "
              f"CRC32C of every file {statistics.median(save['checksum_all_files_s']):.2f}s "
              f"({save['crc_gb_per_s']:.1f} GB/s)", flush=True)
        per_rank = run_ranks(_load, a.ranks, shape, root, a.rounds, a.ranks, timeout=3000)
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(a.rounds)]
               for k in ("verify", "no_verify", "verify_cpu", "no_verify_cpu")}
    ratio = speedup(slowest["verify"], slowest["no_verify"])  # median(verify) / median(no_verify)
    cpu_ratio = speedup(slowest["verify_cpu"], slowest["no_verify_cpu"])
    spread = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in slowest.items()}
    paired = sorted(v / n for v, n in zip(slowest["verify"], slowest["no_verify"]))  # same round: drift cancels
    crc_share = statistics.median(save["checksum_all_files_s"]) / spread["no_verify"]["median_s"]
    result = {
        "command": " ".join(["python -m benchmarks.checkpoint_integrity", *sys.argv[1:]]), "machine": machine(), "load_avg_1m_before_after": [load0, load_avg()],
        "note": "machine shared with four other engineers' test runs (2 cores): ratios measured side by side, "
                "rounds alternate which load goes first; warm page cache (worst case for the ratio)",
        "shape": shape, "tp_at_load": a.ranks, "checkpoint_bytes": save["bytes"], "checkpoint_files": save["files"],
        "save_s": save["save_s"], "checksum_all_files_s": save["checksum_all_files_s"],
        "crc32c_gb_per_s": save["crc_gb_per_s"],
        "save_checksum_share": statistics.median(save["checksum_all_files_s"]) / save["save_s"],
        "load_s": spread, "load_times_s": slowest,
        "verified_over_unverified": ratio.as_dict(),
        "verified_over_unverified_cpu_seconds": cpu_ratio.as_dict(),
        "verified_over_unverified_paired_by_round": {"median": statistics.median(paired), "min": paired[0],
                                                      "max": paired[-1], "all": paired},
        "checksum_all_files_over_unverified_load": crc_share,
    }
    name = "checkpoint_integrity" + ("" if a.ranks == 1 else f"_tp{a.ranks}") + ".json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(result, f, indent=2)
    print(f"load at TP {a.ranks}: verified {spread['verify']['median_s']:.2f}s "
          f"[{spread['verify']['min_s']:.2f}, {spread['verify']['max_s']:.2f}], unverified "
          f"{spread['no_verify']['median_s']:.2f}s [{spread['no_verify']['min_s']:.2f}, "
          f"{spread['no_verify']['max_s']:.2f}]; verified / unverified = {ratio}, paired by round "
          f"{statistics.median(paired):.2f}x [{paired[0]:.2f}, {paired[-1]:.2f}]; CRC of every file = "
          f"{crc_share:.1%} of an unverified load; CPU seconds verified / unverified = {cpu_ratio} (medians "
          f"{statistics.median(slowest['verify_cpu']):.2f}s / {statistics.median(slowest['no_verify_cpu']):.2f}s); "
          f"checksums at save {result['save_checksum_share']:.1%} of the save; wrote {os.path.join(out_dir, name)}")


if __name__ == "__main__":
    main()
