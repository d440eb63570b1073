"""``ds-mp plan --config X.json [--profile]``: TeraPipe's slicing plan and its predicted speedups."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ds_mp.config import ConfigError, load_config, parse_config, read_json
from ds_mp.schedules.terapipe.cost_model import (BatchTableCostModel, as_batch_cost, fit_table_cost_model,
                                                 load_cost_model)
from ds_mp.schedules.terapipe.planner import plan_for, predicted_time_joint, profile_sizes, uniform_slices
from ds_mp.engine.terapipe_profile import profile_blocks, profile_path


def plan_from_config(config: str | dict, profile: bool = False) -> dict:
    """Plan TeraPipe slicing for a DeepSpeed JSON; print and return the scheme and predictions.

    ``profile=True`` times a stage's blocks here (:func:`profile_blocks`) at every batch-slice
    size the plan may use (``profile_sizes``) and saves the cost model to the profile path
    first; otherwise the saved cost model is used.  Returns ``plan``
    ([[rows, token slices], …]), ``predicted_time`` and the same for no slicing and the best
    uniform slicing, with ``speedup_vs_no_slicing`` / ``speedup_vs_uniform`` (ratios of times).
    """
    raw = read_json(config)
    parsed = parse_config(raw.get("ds_mp", {}))
    cfg, raw = load_config(raw, world_size=parsed.tp * parsed.pp)  # one replica: DP does not matter
    B, L, K = raw.get("train_micro_batch_size_per_gpu", 1), cfg.data.seq_len, cfg.pp
    n, g, path = cfg.terapipe.batch_slices, cfg.terapipe.granularity, profile_path(cfg)
    if profile:
        t0 = time.perf_counter()
        fits = {b: fit_table_cost_model(profile_blocks(cfg, b)) for b in profile_sizes(B, n)}
        cost, err = BatchTableCostModel({b: m for b, (m, _) in fits.items()}), max(e for _, e in fits.values())
        took = time.perf_counter() - t0
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        cost.save(path, {"micro_batch": B, "seq_len": L, "pp": K, "batch_sizes": cost.sizes,
                         "compute_profile_s": round(took, 3),
                         "p2p": "not measured (one process; training's auto profile measures it)"})
        print(f"profiled {path} in {took:.1f}s (fit mean relative error {err:.1%}; p2p not measured on one "
              "process: the profile taken at start-up by slices='auto' includes it)")
    elif not os.path.isfile(path):
        raise ConfigError(f"ds_mp.terapipe.profile: no cost model at {path!r}; run with --profile "
                          "or set ds_mp.terapipe.profile")
    else:
        cost = load_cost_model(path)
    M = raw.get("gradient_accumulation_steps", 1)
    bc, known = as_batch_cost(cost, B)

    def time_of(p: list) -> float:
        return predicted_time_joint(p, K, bc, micro_batches=M)

    plan = plan_for(cost, B, L, K, n, g, micro_batches=M)
    whole = [(B, [L])]
    uniform = min(([(B, uniform_slices(L, m))] for m in range(1, math.ceil(L / g) + 1)), key=time_of)
    equal = min((plan_for(cost, B, L, K, k, g, micro_batches=M) for k in range(1, B + 1)
                 if B % k == 0 and (known is None or B // k in known)),
                key=time_of)  # the best plan with equal batch-slices (of a profiled size)
    t, t0, tu, te = (time_of(p) for p in (plan, whole, uniform, equal))
    out = {"plan": [[b, s] for b, s in plan], "stages": K, "seq_len": L, "micro_batch": B, "micro_batches": M,
           "profile": path, "predicted_time": t, "no_slicing_time": t0, "best_uniform": [[b, s] for b, s in uniform],
           "best_uniform_time": tu, "best_equal_split": [[b, s] for b, s in equal], "best_equal_split_time": te,
           "speedup_vs_no_slicing": t0 / t, "speedup_vs_uniform": tu / t, "speedup_vs_equal_split": te / t}
    print(f"terapipe plan for K={K} stages, a step of {M} micro-batch(es) of {B} x {L} tokens: {out['plan']}\n"
          f"  predicted {t * 1e3:.3f} ms/step; {t0 / t:.2f}x vs no slicing ({t0 * 1e3:.3f} ms), "
          f"{tu / t:.2f}x vs best uniform {out['best_uniform']} ({tu * 1e3:.3f} ms), "
          f"{te / t:.2f}x vs best equal batch split {out['best_equal_split']} ({te * 1e3:.3f} ms)")
    return out


def plan_cli(argv: list[str]) -> int:
    """``ds-mp plan --config X.json [--profile]``: the slicing plan and its predicted speedups."""
    ap = argparse.ArgumentParser(prog="ds-mp plan", description="TeraPipe slicing plan for a DeepSpeed JSON")
    ap.add_argument("--config", required=True, help="DeepSpeed JSON with a ds_mp block")
    ap.add_argument("--profile", action="store_true", help="time a stage's blocks here and save the cost model")
    args = ap.parse_args(argv)
    try:
        plan_from_config(args.config, profile=args.profile)
    except ConfigError as e:
        print(f"ds-mp plan: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["plan_from_config", "plan_cli"]
