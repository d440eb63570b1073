"""ds_mp's pipeline schedules against torch.distributed.pipelining's, side by side at PP=2 on gloo.

The same Hugging Face model (GPT-2 as in the schedules benchmark, and one Qwen2 shape), the same
initial weights, rows, micro-batches and block split, 2 CPU ranks × 1 thread, SGD, fp32:

    ds_mp_1f1b, ds_mp_zb-h1, ds_mp_interleaved   ds_mp's schedules (interleaved: 2 chunks per rank)
    ds_mp_zb-v, ds_mp_zb-v_paper  ds_mp's ZB-V (V placement as torch's ZBV), bounded / the paper's deferral
    torch_1f1b                 ``Schedule1F1B``, one stage per rank
    torch_interleaved          ``ScheduleInterleaved1F1B``, 2 chunks per rank (chunks r, r + 2)
    torch_interleaved_zb       ``ScheduleInterleavedZeroBubble``, the same chunks
    torch_zbv, torch_dualpipev ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``: V placement
                               (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)

torch's stages are the HF modules themselves (embedding, blocks, final norm, LM head) cut at
ds_mp's uniform split (blocks per chunk from ``ds_mp.models.partition.stage_parts``); the tied
embedding's gradient is summed across the two ranks that hold a copy (as DeepSpeed's
``ReduceTiedGrads``), or accumulates in one parameter where one rank holds both ends (V).  The loss
is HF's (next-token cross-entropy, mean over a micro-batch's tokens; torch's ``scale_grads``
averages the micro-batches, as ds_mp's per-token loss over equal full rows).

Every configuration's first steps' losses are checked against one process running the unmodified
HF model with the same SGD (exactness, before any timing).  Times: ratios of median step times with
a bootstrap interval over rounds whose order rotates (:mod:`benchmarks.common`).  Memory: the peak
held per rank by the storage census (:class:`ds_mp.engine.memory.HeldMemory`) after every
instruction (ds_mp) or every stage compute action (torch): weights, gradients, optimizer state not
charged.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from benchmarks.common import Config, Group, bar_chart, interleave, speedup, summarize, table
from benchmarks.workloads import LR, Shape

DESCRIPTION = ("PP=2 on gloo: ds_mp's 1f1b / zb-h1 / interleaved / zb-v against torch.distributed.pipelining's 1F1B, "
               "Interleaved1F1B, InterleavedZeroBubble, ZBV, DualPipeV on the same HF GPT-2 and Qwen2")
GPT2 = Shape(n_layer=6, n_embd=256, n_head=8, vocab=4096, seq=256, n_positions=256)  # the schedules benchmark's
QWEN2 = Shape(n_layer=6, n_embd=256, n_head=8, vocab=4096, seq=256, n_positions=256, model_type="qwen2",
              n_kv_head=2, intermediate_size=704)
QUICK_SCALE = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab": 2048, "seq": 128, "n_positions": 128}
STAGES, ROWS, CHUNKS, CHECK_STEPS, GOAL = 2, 2, 2, 2, 1.05
TORCH = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}
DS_MP = {"1f1b": ("1f1b", {}), "zb-h1": ("zb-h1", {}), "interleaved": ("interleaved", {"virtual_stages": CHUNKS}),
         "zb-v": ("zb-v", {}), "zb-v_paper": ("zb-v", {"zb_max_pending_w": "paper"})}
ZBV_GOAL = 1.10  # zb-v over ds_mp's 1F1B, at ≤ 1× its largest rank's held memory (issue #44)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss: token t predicts t + 1, mean over the micro-batch's tokens."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


class Chunk(torch.nn.Module):
    """Blocks ``lo:hi`` of an HF causal LM, with the embedding in front on the first chunk and the
    final norm and LM head behind on the last: the HF modules themselves, called as HF calls them."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.gpt2 = model.config.model_type == "gpt2"
        body = model.transformer if self.gpt2 else model.model
        self.blocks = torch.nn.ModuleList((body.h if self.gpt2 else body.layers)[lo:hi])
        self.embed = (torch.nn.ModuleList([body.wte, body.wpe]) if self.gpt2 else body.embed_tokens) if first else None
        self.head = torch.nn.ModuleList([body.ln_f if self.gpt2 else body.norm, model.lm_head]) if last else None
        self.rotary = None if self.gpt2 else body.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.embed[0](x) + self.embed[1](pos) if self.gpt2 else self.embed(x)
        if self.gpt2:
            for block in self.blocks:
                x = block(x)
        else:
            pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
            rope = self.rotary(x, pos)
            for block in self.blocks:
                x = block(x, position_embeddings=rope, position_ids=pos)
        if self.head is not None:
            x = self.head[1](self.head[0](x))
        return x


def chunk_blocks(n_layer: int, chunks: int) -> list[tuple[int, int]]:
    """Block ranges of ``chunks`` chunks at ds_mp's uniform split (what its engine builds)."""
    from ds_mp.models.partition import stage_parts

    parts = stage_parts(n_layer, chunks, "uniform", 1, 1)
    cuts = [0] + [min(max(p - 2, 0), n_layer) for p in parts[1:-1]] + [n_layer]
    return list(zip(cuts, cuts[1:]))


def placement(schedule: str, rank: int) -> list[int]:
    """The chunks (stage indices) rank ``rank`` holds."""
    if schedule == "1f1b":
        return [rank]
    if schedule in ("zbv", "dualpipev"):
        return [rank, 2 * STAGES - 1 - rank]
    return [rank + STAGES * c for c in range(CHUNKS)]


class TorchPipeBench:
    """One torch.distributed.pipelining schedule; ``step()`` is one optimizer step over M micro-batches."""

    def __init__(self, rank: int, world: int, shape: dict, micro: int, gas: int, schedule: str) -> None:
        import torch.distributed as dist
        from torch.distributed import pipelining

        from benchmarks.workloads import batch, hf_model

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = hf_model(shape)
        n = 1 if schedule == "1f1b" else CHUNKS
        ranges, total = chunk_blocks(shape["n_layer"], STAGES * n), STAGES * n
        self.local = placement(schedule, rank)
        self.modules = [Chunk(model, *ranges[i], i == 0, i == total - 1) for i in self.local]
        del model
        # HF ties the LM head to the embedding: a rank holding one end keeps a copy whose gradient is
        # summed with the other rank's.  A rank holding both (V placement) gets two copies too, summed
        # locally: torch scales each stage's gradients by 1/M, so one parameter shared by two local
        # stages would be scaled twice.
        ends = [m.embed[0] if m.gpt2 else m.embed for m in self.modules if m.embed is not None] + \
            [m.head[1] for m in self.modules if m.head is not None]
        tie = shape.get("tie_word_embeddings", True)
        if tie and len(ends) == 2:
            ends[1].weight = torch.nn.Parameter(ends[0].weight.detach().clone())
        self.tied = [e.weight for e in ends] if tie else []
        params = {id(p): p for m in self.modules for p in m.parameters()}
        self.opt = torch.optim.SGD(list(params.values()), lr=LR)
        stages = [pipelining.PipelineStage(m, i, total, torch.device("cpu")) for m, i in zip(self.modules, self.local)]
        cls = getattr(pipelining, TORCH[schedule])
        self.sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=gas, loss_fn=lm_loss)
        self.stages, self.first, self.last = stages, 0 in self.local, total - 1 in self.local
        self.ids, self.labels = batch(shape, micro * gas)
        self.first_losses = [self.step() for _ in range(CHECK_STEPS)]

    def step(self) -> float:
        import torch.distributed as dist

        losses: list = []
        self.sched.step(*((self.ids,) if self.first else ()), target=self.labels if self.last else None, losses=losses)
        if len(self.tied) == 2:  # both ends here
            total = self.tied[0].grad + self.tied[1].grad
            self.tied[0].grad, self.tied[1].grad = total, total.clone()
        elif self.tied:
            dist.all_reduce(self.tied[0].grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else float("nan")

    def losses(self) -> list[float]:
        return self.first_losses

    def held_peak(self) -> list[int]:
        """[peak held bytes, bytes held before the step] over one step, a census after every stage
        compute action (forward, backward or input-backward, weight-backward)."""
        from ds_mp.engine.memory import HeldMemory, static_tensors

        census = HeldMemory(lambda: [t for m in self.modules for t in static_tensors(m, self.opt)])
        names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

        def sampled(fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                census.sample()
                return out
            return run

        for s in self.stages:
            for name in names:
                setattr(s, name, sampled(getattr(s, name)))
        try:
            with census:
                before = census.sample()
                self.step()
        finally:
            for s in self.stages:
                for name in names:
                    delattr(s, name)
        return [census.peak, before]


def setup_torch(rank: int, world: int, **kwargs: Any) -> TorchPipeBench:
    return TorchPipeBench(rank, world, **kwargs)


def setup_ds_mp(rank: int, world: int, **kwargs: Any) -> Any:
    from benchmarks.schedules import SchedBench

    bench = SchedBench(rank, world, **kwargs)
    bench.first_losses = [bench.step() for _ in range(CHECK_STEPS)]
    bench.losses = lambda: bench.first_losses
    return bench


def hf_losses(shape: dict, rows: int) -> list[float]:
    """The unmodified HF model on one process, the whole batch, SGD: the first steps' losses."""
    from benchmarks.workloads import batch, hf_model

    model = hf_model(shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = batch(shape, rows)
    out = []
    for _ in range(CHECK_STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss))
    return out


def configs(shape: dict, M: int, tag: str) -> list[Config]:
    out = [Config(f"{tag}ds_mp_{name}", "benchmarks.peers:setup_ds_mp", ranks=STAGES,
                  kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": sched, "pipeline": pipeline})
           for name, (sched, pipeline) in DS_MP.items()]
    out += [Config(f"{tag}torch_{name}", "benchmarks.peers:setup_torch", ranks=STAGES,
                   kwargs={"shape": shape, "micro": ROWS, "gas": M, "schedule": name}) for name in TORCH]
    return out


def compare(shape: dict, M: int, tag: str, repeats: int, steps: int) -> dict:
    """One model's side-by-side: times, held memory, losses vs HF; configurations that fail to
    start are reported with their error instead."""
    groups, failed, extra = [], {}, {}
    try:
        for c in configs(shape, M, tag):
            groups.append(Group(c))
        for g in list(groups):  # a schedule torch refuses (on gloo, or at this shape) is named, not fatal
            try:
                g.wait_ready()
            except RuntimeError as e:
                failed[g.cfg.name] = str(e).strip().splitlines()[-1][:300]
                groups.remove(g)
        times = interleave(groups, repeats, steps)
        for g in groups:
            extra[g.cfg.name] = {"held": g.call("held_peak"), "losses": g.call("losses")}
    finally:
        for g in groups:
            g.close()
    cfgs = [g.cfg for g in groups]
    res = summarize(times, {c.name: ROWS * M * shape["seq"] for c in cfgs})
    for name, e in extra.items():
        res[name]["losses"] = [max((x for x in step if x == x), default=float("nan")) for step in zip(*e["losses"])]
        res[name]["held_peak_bytes"] = [p for p, _ in e["held"]]
        res[name]["held_before_bytes"] = [b for _, b in e["held"]]
    return {"results": res, "failed": failed, "hf_losses": hf_losses(shape, ROWS * M)}


def run(quick: bool, out_dir: str) -> dict:
    import os

    repeats, steps = (2, 2) if quick else (5, 2)
    if os.environ.get("DS_MP_PEERS_ROUNDS"):  # e.g. "3x2": rounds × steps, for a machine with little time left
        repeats, steps = map(int, os.environ["DS_MP_PEERS_ROUNDS"].split("x"))
    shapes = {k: v for k, v in {"gpt2": GPT2, "qwen2": QWEN2}.items()
              if k in os.environ.get("DS_MP_PEERS_MODELS", "gpt2,qwen2").split(",")}  # one model per run if busy
    if quick:
        shapes = {k: replace(v, **QUICK_SCALE) for k, v in shapes.items()}
    M = 4
    runs = {k: compare(asdict(s), M, f"{k}_", repeats, steps) for k, s in shapes.items()}
    rows, mem_rows, loss_rows, ratios, summary, plot = [], [], [], {}, [], ([], [])
    for k, r in runs.items():
        res = r["results"]
        for name, why in r["failed"].items():
            rows.append([name, "—", "—", f"does not run: {why}"])
        hf = r["hf_losses"]
        for name, x in res.items():
            err = max(abs(a - b) for a, b in zip(x["losses"], hf))
            loss_rows.append([name, " ".join(f"{v:.6f}" for v in x["losses"]), " ".join(f"{v:.6f}" for v in hf),
                              f"{err:.1e}"])
            mem_rows.append([name] + [f"{b / 2**20:.1f}" for b in x["held_peak_bytes"]])
        ours = [n for n in res if "ds_mp_" in n]
        theirs = [n for n in res if "torch_" in n]
        if not ours or not theirs:
            continue
        best_ours = min(ours, key=lambda n: res[n]["median_s"])
        best_theirs = min(theirs, key=lambda n: res[n]["median_s"])
        for name in ours + theirs:
            ratio = speedup(res[best_theirs]["step_times_s"], res[name]["step_times_s"])
            ratios[f"{name}/{best_theirs}"] = ratio.as_dict()
            rows.append([name, f"{res[name]['tokens_per_s']:.0f}", str(ratio), ""])
            plot[0].append(name.replace(f"{k}_", f"{k}:"))
            plot[1].append(ratio.value)
        r_best = speedup(res[best_theirs]["step_times_s"], res[best_ours]["step_times_s"])
        mem = max(res[best_ours]["held_peak_bytes"]) / max(res[best_theirs]["held_peak_bytes"])
        summary.append(f"{k}: ds_mp's best ({best_ours}) {r_best} torch's best ({best_theirs}) at {mem:.2f}× its "
                       f"largest rank's held memory (goal ≥ {GOAL}× at ≤ 1×: speed {r_best.verdict(GOAL)}, memory "
                       f"{'met' if mem <= 1 else 'NOT met'})")
        base = f"{k}_ds_mp_1f1b"
        for name in (n for n in ours if "zb-v" in n and base in res):
            r_v = speedup(res[base]["step_times_s"], res[name]["step_times_s"])
            mem = max(res[name]["held_peak_bytes"]) / max(res[base]["held_peak_bytes"])
            summary.append(f"{k}: {name} {r_v} ds_mp's 1F1B at {mem:.2f}× its largest rank's held memory (goal ≥ "
                           f"{ZBV_GOAL}× at ≤ 1×: speed {r_v.verdict(ZBV_GOAL)}, memory {'met' if mem <= 1 else 'NOT met'})")
    plots = []
    if plot[0]:
        plots.append(os.path.basename(bar_chart(os.path.join(out_dir, f"peers_{'_'.join(shapes)}.png"), plot[0], plot[1],
                                                "Speed over torch's best schedule (PP=2, gloo, 2 CPU ranks)",
                                                "× torch's best", target=GOAL)))
    return {"workload": " and ".join(Shape(**asdict(s)).describe() for s in shapes.values())
                        + f"; PP=2, M={M} micro-batches of {ROWS} rows",
            "result_name": "peers" if "gpt2" in shapes else "peers_" + "_".join(shapes),  # GPT-2's run keeps peers.json
            "repeats": repeats, "steps_per_repeat": steps, "runs": runs, "ratios": ratios, "summary": summary,
            "plots": plots,
            "tables": [table("Speed: tokens/s and the ratio of median step times over torch's best schedule of the "
                             "same model (90% interval)", ["config", "tokens/s", "× torch's best", "note"], rows),
                       table("Peak held memory per rank (MiB; storage census after every instruction / compute "
                             "action, weights, gradients and optimizer state not charged)",
                             ["config", "rank 0", "rank 1"], mem_rows),
                       table(f"Losses of the first {CHECK_STEPS} steps against the unmodified HF model on one process",
                             ["config", "losses", "HF", "max |diff|"], loss_rows)]}
