"""The batch ramp's LR scaling with LR schedulers, and the ramp settings that would otherwise do
nothing: the LR each optimizer step uses is the scheduler's own schedule — the same torch or
DeepSpeed scheduler run standalone, unscaled — times the ramp's factor (B / start)^p, through the
training loop, across a mid-ramp resume and under ZeRO-1; ``log.csv``'s ``lr`` column is that LR.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config
from launcher_utils import read_log, tiny_dataset, train_config
from ds_mp.config import ConfigError, load_config
from ds_mp.training.batch_ramp import BatchRamp, LrScaling, first_noise_decision

LR, STEPS = 3e-3, 10
RAMP = {"policy": "linear", "start": 1, "max": 4, "ramp_samples": 12, "interval": 1, "lr_scaling": "sqrt"}
SCHEDULERS = {  # DeepSpeed's "scheduler" block: its own schedules, and torch's looked up by name
    "none": None,
    "ExponentialLR": {"type": "ExponentialLR", "params": {"gamma": 0.7}},
    "StepLR": {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}},
    "WarmupLR": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 6,
                                                "warmup_type": "linear"}},
    "WarmupDecayLR": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                          "warmup_num_steps": 4, "total_num_steps": STEPS,
                                                          "warmup_type": "linear"}},
}


def standalone_schedule(sched: dict | None, steps: int) -> list[float]:
    """The oracle: the LR of steps 1..steps from the same scheduler on a bare torch optimizer,
    stepped after each optimizer step as DeepSpeed does, unscaled."""
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    where = lr_schedules if sched and hasattr(lr_schedules, sched["type"]) else torch.optim.lr_scheduler
    scheduler = None if sched is None else getattr(where, sched["type"])(opt, **sched["params"])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return out


def _used_lr_rank(rank: int, runs: list[tuple[str, tuple | None]]) -> list[dict[int, list[float]]]:
    """Each run through ``loop.main`` (with ``(run, tag, into)``: resumed in ``into`` from ``run``'s
    checkpoint ``tag``); per run, step -> the LRs of every parameter group inside the torch
    optimizer's ``step`` (a post-step hook registered before the loop's own hooks)."""
    import ds_mp
    from ds_mp.training import loop

    used: list[dict[int, set]] = []
    initialize = ds_mp.initialize

    def observed(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engine, opt, seen = out[0], out[0].optimizer, {}
        base = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
        base.register_step_post_hook(
            lambda o, *_: seen.setdefault(engine.global_steps + 1, set()).update(g["lr"] for g in o.param_groups))
        used.append(seen)
        return out

    ds_mp.initialize = observed
    for path, fork in runs:
        if fork is not None:
            _copy_run_at(*fork)
        assert loop.main(["--deepspeed_config", path, *(["--resume"] if fork else [])]) == 0
    return [{step: sorted(lrs) for step, lrs in seen.items()} for seen in used]


def _expected(sched: dict | None, batches: list[int]) -> list[float]:
    """schedule(t) × (B_t / start)^½ for the logged batches B_t."""
    return [lr * (b / RAMP["start"]) ** 0.5 for lr, b in zip(standalone_schedule(sched, len(batches)), batches)]


def test_lr_scaling_with_schedulers_is_the_standalone_schedule_times_the_factor(tmp_path):
    """DP=1, a linear ramp 1 -> 4 samples with sqrt LR scaling, 10 AdamW steps, under no scheduler,
    ExponentialLR, StepLR (torch's, which compute the next LR from the group's), WarmupLR and
    WarmupDecayLR (DeepSpeed's), WarmupDecayLR also under ZeRO-1 (DeepSpeed builds torch's schedulers
    on torch optimizers only), and ExponentialLR stopped at step 5 and resumed:
    every step's LR inside the optimizer and in log.csv equals the standalone schedule × the factor."""
    data = tiny_dataset(str(tmp_path / "data"))
    runs, paths = {}, []
    for name, sched in {**SCHEDULERS, "WarmupDecayLR-zero1": SCHEDULERS["WarmupDecayLR"]}.items():
        ds = {"scheduler": sched} if sched else {}
        if name.endswith("zero1"):
            ds.update(zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
        cfg = train_config(str(tmp_path / name), data, pp=1, micro=1, gas=1, steps=STEPS, lr=LR, batch_ramp=RAMP,
                           training={"eval_interval": 0, "checkpoint_interval": 5 if name == "ExponentialLR" else 0,
                                     "export_hf": False}, ds=ds)
        runs[name] = (sched, str(tmp_path / name / "run"))
        paths.append((_write(cfg, str(tmp_path / f"{name}.json")), None))
    # ExponentialLR resumed from its step-5 checkpoint in a copy of the run: steps 6-10 again
    with open(paths[1][0]) as f:
        cfg = json.load(f)
    cfg["ds_mp"]["training"]["output_dir"] = resumed = str(tmp_path / "resumed" / "run")
    paths.append((_write(cfg, str(tmp_path / "resumed.json")), (runs["ExponentialLR"][1], "step5", resumed)))
    used = run_ranks(_used_lr_rank, 1, paths, timeout=600)[0]
    for (name, (sched, run)), seen in zip(runs.items(), used):
        rows = read_log(run)
        batches = [int(r["batch_size"]) for r in rows]
        assert batches == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4], name
        want = _expected(sched, batches)
        assert [float(r["lr"]) for r in rows] == pytest.approx(want, rel=1e-12, abs=0), name
        assert sorted(seen) == list(range(1, STEPS + 1)) and all(len(lrs) == 1 for lrs in seen.values()), name
        assert [seen[t][0] for t in sorted(seen)] == pytest.approx(want, rel=1e-12, abs=0), name  # every group
    want = _expected(SCHEDULERS["ExponentialLR"], [1, 1, 1, 1, 2, 2, 3, 3, 4, 4])[5:]
    assert sorted(used[-1]) == list(range(6, STEPS + 1))
    assert [used[-1][t] for t in range(6, STEPS + 1)] == [[w] for w in want]


def _write(cfg: dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _copy_run_at(run: str, tag: str, into: str) -> None:
    """``into``: a run directory whose latest checkpoint is ``run``'s ``tag``."""
    import shutil

    shutil.copytree(os.path.join(run, "checkpoints", tag), os.path.join(into, "checkpoints", tag))
    with open(os.path.join(into, "checkpoints", "latest"), "w") as f:
        f.write(tag + "\n")


def test_lr_scaling_never_feeds_back_into_a_chainable_scheduler():
    """On a bare torch optimizer with ExponentialLR: the step sees schedule × factor, and the
    group (what the scheduler reads) holds the schedule between steps (the ZeRO way of narrowing
    ``param_groups`` to one group per step call included)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [], "lr": 0.2}], lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    seen = []  # an observer registered first: its post-step hook runs before the restoring one
    opt.register_step_post_hook(lambda o, *_: seen.append([g["lr"] for g in o.param_groups]))
    scale = LrScaling(opt)
    for t in range(3):
        assert scale.apply(4.0) == [0.1 * 0.5**t * 4, 0.2 * 0.5**t * 4]
        p.grad = torch.ones(2)
        if t == 2:  # ZeRO's _optimizer_step: one group at a time
            groups = opt.param_groups
            for g in groups:
                opt.param_groups = [g]
                opt.step()
            opt.param_groups = groups
        else:
            opt.step()
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [0.1 * 0.5 ** (t + 1), 0.2 * 0.5 ** (t + 1)]
    assert seen == [[0.4, 0.8], [0.2, 0.4], [0.1], [0.2]]
    assert p.detach().tolist() == pytest.approx([-0.7, -0.7])  # 0.4 + 0.2 + 0.1


def test_lr_scaling_resumes_a_checkpoint_that_saved_the_scaled_lr():
    """Checkpoints written before the hooks saved the scaled LR in the groups and the schedule
    beside it: resuming puts the schedule back."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)  # restored: 0.1 scaled × 4
    LrScaling(opt).load_state_dict({"scheduled": [0.1], "written": [0.4]})
    assert opt.param_groups[0]["lr"] == 0.1
    LrScaling(opt).load_state_dict(LrScaling(opt).state_dict())
    assert opt.param_groups[0]["lr"] == 0.1


# ----------------------------------------------------------------- settings that would do nothing
def test_noise_scale_ramp_says_when_it_first_decides():
    """The EMA is trusted after 20 measurements: at one measurement every 50 steps and decisions
    every 5 the batch first changes at step 1001 — said up front, and that a shorter run never
    gets there."""
    ramp = BatchRamp("noise_scale", 4, 32, 0, 5, "none", 4)
    assert first_noise_decision(5, 1, 0.95) == 21 and first_noise_decision(3, 1, 0.95) == 22
    assert first_noise_decision(5, 50, 0.95) == 1001
    note = ramp.warm_up_note(50, 0.95, 0, 400)
    assert "until step 1001" in note and "training.steps=400 ends before it" in note
    assert "ends before" not in ramp.warm_up_note(1, 0.95, 0, 400)
    assert ramp.warm_up_note(1, 0.95, 30, 400) is None  # resumed past it
    assert BatchRamp("linear", 4, 32, 64, 5, "none", 4).warm_up_note(1, 0.95, 0, 400) is None


@pytest.mark.parametrize("extra, world, match", [
    ({"ds_mp": {"training": {"noise_scale_interval": 5}}}, 1,
     r"noise_scale_interval: .* needs DP >= 2 \(this layout has DP = 1\) and would never be measured; set it to 0"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}, "ds_mp": {"batch_ramp": {
        "policy": "linear", "start": 4, "max": 16, "ramp_samples": 64}}}, 2,
     r"batch_ramp: not with zero_optimization.offload_optimizer: .*remove offload_optimizer or the ramp"),
])
def test_config_refuses_settings_that_would_silently_do_nothing(extra, world, match):
    cfg = ds_config(micro=2, gas=1)
    for key, value in extra.items():
        if key == "ds_mp":
            for sub, block in value.items():
                cfg["ds_mp"].setdefault(sub, {}).update(block)
        else:
            cfg[key] = value
    with pytest.raises(ConfigError, match=match):
        load_config(cfg, world_size=world)
    if "offload_optimizer" in json.dumps(extra):  # offload without a ramp, and "device": "none", still load
        load_config({**cfg, "ds_mp": {**cfg["ds_mp"], "batch_ramp": {}}}, world_size=world)
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "none"
        load_config(cfg, world_size=world)
