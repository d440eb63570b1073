"""TeraPipe planner accuracy: where the planned slicing ranks among measured candidate slicings.

For each shape (sequence L, micro-batch B, stages K, micro-batches per step M) one group of K
ranks (``ScheduleBench``) is built once and:

1. profiles the engine the way ``slices: "auto"`` does (``measure_cost_model``: for every
   batch-slice size the knapsack may use — powers of two below B, and B — every stage's
   t(i, 0) table and context samples, plus the p2p time per slice on the gloo link) and plans
   with ``plan_for(..., batch_slices="auto")`` at granularity g = L / ``POSITIONS`` — the time
   profiling took is reported;
2. **screens** the candidates: every composition of L into multiples of g (2^(L/g − 1) token
   slicings; exhaustive when ≤ ``MAX_CANDIDATES``, else every uniform slicing + a seeded random
   sample; 16 with ``--quick``), each run as one batch-slice and, for B > 1, also with every equal batch split;
   one timed step each, round-robin over ``SCREEN_ROUNDS`` rounds;
3. **confirms** the ``FINALISTS`` fastest candidates of the screen, the best uniform one, the
   plan, and the plan again under another name (an A/A pair: their ratio is the run-to-run
   noise) in ``CONFIRM_ROUNDS`` interleaved rounds of ``CONFIRM_STEPS`` steps.

Reported per shape, from the confirmation rounds: planned step time over the best measured
candidate's, and over the best uniform slicing's (``speedup`` ratios with 90% bootstrap
intervals), the A/A noise, the plan's rank in the screen, and the planner's predicted gain.
Done when planned / best ≤ ``TARGET_VS_BEST`` in every shape and planned / best uniform ≤
1 + noise.  The model is small (GPT-2 6 × 256, vocab 2048) so a few hundred steps fit in ~15
minutes (``--quick``: 2 shapes, ~4 minutes), yet compute, not the engine's per-slice overhead,
dominates a step.
"""
from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import Config, interleave, speedup, summarize, table
from benchmarks.terapipe import ScheduleBench, Variant, started
from benchmarks.workloads import Shape

DESCRIPTION = "TeraPipe planner accuracy: planned slicing vs every measured candidate slicing (PP 2/3, M 1/4)"
TARGET_VS_BEST = 1.03
POSITIONS = 8            # the sequence is cut at multiples of L / POSITIONS: 2^7 = 128 token slicings
MAX_CANDIDATES = 40      # per shape (16 with --quick); more are sampled (uniform ones always kept)
FINALISTS = 4


@dataclass(frozen=True)
class Case:
    seq: int
    batch: int     # micro-batch rows B
    stages: int    # K
    micro: int     # micro-batches per step M (one flush)

    @property
    def name(self) -> str:
        return f"L{self.seq}_B{self.batch}_pp{self.stages}_M{self.micro}"


MODEL = dict(n_layer=6, n_embd=256, n_head=8, vocab=2048)  # compute, not per-slice overhead, dominates
FULL = [Case(1024, 1, 2, 1), Case(2048, 1, 2, 1), Case(512, 8, 2, 1), Case(1024, 1, 3, 1), Case(512, 2, 2, 4),
        Case(1024, 2, 3, 4)]
QUICK = [Case(512, 1, 2, 1), Case(512, 2, 3, 4)]


class PlannerBench(ScheduleBench):
    """A TeraPipe pipeline that also measures its cost model and plans like ``slices: "auto"``."""

    def plan(self, granularity: int) -> tuple[list, dict, dict]:
        """Collective: (the auto plan, the cost model as a dict, profiling times)."""
        from ds_mp.schedules.terapipe.planner import plan_for, profile_sizes
        from ds_mp.engine.terapipe_profile import measure_cost_model

        e = self.engine
        cost, took = measure_cost_model(e, self.seq, granularity,
                                        profile_sizes(e.train_micro_batch_size_per_gpu(), "auto"))
        plan = plan_for(cost, e.train_micro_batch_size_per_gpu(), self.seq, e.num_stages, "auto", granularity,
                        e.micro_batches)
        return plan, cost.to_dict(), took


def setup_planner_bench(rank: int, world: int, **kwargs: Any) -> PlannerBench:
    return PlannerBench(rank, world, **kwargs)


def compositions(L: int, g: int) -> list[list[int]]:
    """Every slicing of L into multiples of g (the last slice takes L mod g)."""
    cuts = list(range(g, L, g))
    out = []
    for mask in itertools.product((0, 1), repeat=len(cuts)):
        pos = [0] + [c for c, m in zip(cuts, mask) if m] + [L]
        out.append([b - a for a, b in zip(pos[:-1], pos[1:])])
    return out


def candidates(case: Case, g: int, limit: int, seed: int = 0) -> dict[str, list]:
    """name -> plan [(rows, token slices)]: token slicings × equal batch splits, sampled to
    ``limit`` (every uniform token slicing with every split kept)."""
    from ds_mp.schedules.terapipe.planner import uniform_slices

    B, L = case.batch, case.seq
    splits = [n for n in range(1, B + 1) if B % n == 0]
    token = compositions(L, g)
    uniform = [uniform_slices(L, m) for m in range(1, L // g + 1) if L % m == 0 and (L // m) % g == 0]
    every = [(n, s) for s in token for n in splits]
    keep = [(n, s) for s in uniform for n in splits]
    rest = [x for x in every if x not in keep]
    random.Random(seed).shuffle(rest)
    chosen = keep + rest[:max(0, limit - len(keep))]
    return {label(n, s): [(B // n, list(s))] * n for n, s in chosen}


def label(n: int, slices: list[int]) -> str:
    return f"{n}x[{'+'.join(map(str, slices))}]"


def is_uniform(plan: list) -> bool:
    return all(len(set(s)) == 1 for _, s in plan) and len({(b, tuple(s)) for b, s in plan}) == 1


def run_case(case: Case, quick: bool) -> dict:
    from ds_mp.schedules.terapipe.planner import cost_model_from_dict, predicted_time_joint

    shape = asdict(Shape(**MODEL, seq=case.seq, n_positions=case.seq))
    g = case.seq // POSITIONS
    cfg = Config(case.name, "benchmarks.terapipe_planner:setup_planner_bench", case.stages, 1,
                 {"shape": shape, "micro": case.batch, "gas": case.micro})
    screen_rounds, confirm_rounds, confirm_steps = (1, 4, 1) if quick else (2, 6, 2)
    with started([cfg]) as groups:
        grp = groups[case.name]
        t0 = time.perf_counter()
        plan, cost_dict, took = grp.call("plan", g)[0]
        profile_s = time.perf_counter() - t0
        plan = [(b, list(s)) for b, s in plan]
        cands = candidates(case, g, 16 if quick else MAX_CANDIDATES)
        planned_name = next((n for n, p in cands.items() if p == plan), None)
        if planned_name is None:
            planned_name = "planned"
            cands[planned_name] = plan
        print(f"  {case.name}: plan {plan} (profiled in {profile_s:.1f}s: compute {took['compute_profile_s']:.1f}s, "
              f"p2p {took['p2p_profile_s']:.1f}s); screening {len(cands)} candidates", flush=True)
        screen = interleave([Variant(grp, n, "terapipe", p) for n, p in cands.items()], screen_rounds, 1)
        smed = {n: min(w for w, _ in t) for n, t in screen.items()}  # load only adds time: the fastest step
        ranked = sorted(smed, key=smed.get)
        uniform = [n for n in ranked if is_uniform(cands[n])]
        finalists = list(dict.fromkeys(ranked[:FINALISTS] + uniform[:1] + [planned_name]))
        runs = [Variant(grp, n, "terapipe", cands[n]) for n in finalists]
        runs.append(Variant(grp, "planned_again", "terapipe", plan))
        times = interleave(runs, confirm_rounds, confirm_steps)
    res = summarize(times, {n: case.seq * case.batch * case.micro for n in times})
    wall = {n: [w for w, _ in t] for n, t in times.items()}
    med = {n: r["median_s"] for n, r in res.items() if n != "planned_again"}
    best = min(med, key=med.get)
    best_u = min((n for n in med if is_uniform(cands[n])), key=med.get)
    vs_best = speedup(wall[planned_name], wall[best])        # > 1: the plan is slower than the best
    vs_uniform = speedup(wall[planned_name], wall[best_u])
    noise = speedup(wall[planned_name], wall["planned_again"])
    noise_rel = max(abs(noise.lo - 1), abs(noise.hi - 1))
    cost = cost_model_from_dict(cost_dict)  # per batch-slice size (BatchTableCostModel)
    bc, whole = cost, cost.models[case.batch]
    pred = {n: predicted_time_joint(cands[n], case.stages, bc, case.micro) for n in med}
    return {"case": asdict(case), "granularity": g, "plan": plan, "planned": planned_name, "best": best,
            "best_uniform": best_u, "candidates": len(cands), "screen_rank": ranked.index(planned_name) + 1,
            "planned_over_best": vs_best.as_dict(), "planned_over_best_uniform": vs_uniform.as_dict(),
            "aa_noise": noise.as_dict(), "noise_rel": noise_rel, "profile_s": profile_s, "profile_took": took,
            "p2p_share_of_longest_slice": whole.p2p(case.seq) / whole.alone(case.seq),
            "predicted_gain_vs_best_uniform": pred[best_u] / pred[planned_name],
            "median_s": med, "predicted_s": pred, "configs": res, "cost_model": cost_dict,
            "met": vs_best.value <= TARGET_VS_BEST and vs_uniform.value <= 1 + noise_rel,
            "strings": {"vs_best": str(vs_best), "vs_uniform": str(vs_uniform), "noise": str(noise)}}


def run(quick: bool, out_dir: str) -> dict:
    cases = QUICK if quick else FULL
    out = [run_case(c, quick) for c in cases]
    rows = [[r["case"]["seq"], r["case"]["batch"], r["case"]["stages"], r["case"]["micro"], str(r["plan"]),
             f"{r['screen_rank']}/{r['candidates']}", r["best"], r["strings"]["vs_best"], r["best_uniform"],
             r["strings"]["vs_uniform"], r["strings"]["noise"], f"{r['predicted_gain_vs_best_uniform']:.3f}×",
             f"{r['profile_s']:.0f}", f"{r['p2p_share_of_longest_slice']:.1%}", "met" if r["met"] else "NOT met"]
            for r in out]
    worst = max(out, key=lambda r: r["planned_over_best"]["value"])
    ratios = {}
    for r in out:
        n = Case(**r["case"]).name
        ratios[f"{n}_planned_over_best"] = r["planned_over_best"]["value"]
        ratios[f"{n}_planned_over_best_uniform"] = r["planned_over_best_uniform"]["value"]
        ratios[f"{n}_aa_noise"] = r["aa_noise"]["value"]
    summary = [f"planned slicing within {TARGET_VS_BEST - 1:.0%} of the best measured candidate in "
               f"{sum(r['planned_over_best']['value'] <= TARGET_VS_BEST for r in out)}/{len(out)} shapes "
               f"(worst {Case(**worst['case']).name}: {worst['strings']['vs_best']} the best's step time)",
               f"never slower than the best uniform slicing by more than the A/A noise: "
               f"{sum(r['planned_over_best_uniform']['value'] <= 1 + r['noise_rel'] for r in out)}/{len(out)} shapes",
               "profiling (stage table + context samples + p2p per link) took "
               + ", ".join(f"{Case(**r['case']).name} {r['profile_s']:.0f}s" for r in out),
               f"done when: every shape met — {'met' if all(r['met'] for r in out) else 'NOT met'}"]
    over = [Case(**r["case"]).name for r in out if r["case"]["stages"] > (os.cpu_count() or 1)]
    if over:
        summary.append(f"{', '.join(over)}: more single-thread ranks than the {os.cpu_count()} cores, so stages "
                       "share processors; the planner's T = M·Σt + (K − 1)·max t assumes one processor per stage "
                       "and over-slices there")
    for line in summary:
        print("  " + line)
    return {"workload": f"GPT-2 {MODEL['n_layer']} × {MODEL['n_embd']}, vocab {MODEL['vocab']}, fp32, SGD; "
                        f"slicings at granularity L/{POSITIONS}", "cases": out, "ratios": ratios,
            "summary": summary, "repeats": "screen 1–2 + confirm 4–6", "steps_per_repeat": "1–2", "plots": [],
            "tables": [table("planned slicing vs measured candidates (step time ratios, > 1 = the plan is slower)", [
                "L", "B", "PP", "M", "plan [(rows, slices)]", "plan's screen rank", "best measured",
                "planned / best", "best uniform", "planned / best uniform", "A/A noise (plan / plan)",
                "predicted best uniform / plan", "profiling s", "p2p share of t(L, 0)", "verdict"], rows)]}
