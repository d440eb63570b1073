"""What a training run reports beyond ``log.csv``: DeepSpeed's monitors (the JSON's
``"csv_monitor"`` / ``"tensorboard"`` / ``"wandb"`` blocks) receive every ``log.csv`` metric,
and ``training.trace_steps`` records a pipeline timeline of chosen steps from a real run.

The run is ``ds_mp.training.loop.main`` on 2 spawned CPU ranks (PP=2, gloo).
"""
from __future__ import annotations

import csv
import glob
import json
import os

import pytest

from dist_utils import run_ranks
from launcher_utils import read_log, tiny_dataset, train_config


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("monitoring")))


def _train_rank(rank: int, config_path: str) -> None:
    from ds_mp.training import loop

    assert loop.main(["--deepspeed_config", config_path]) == 0


def _monitor_files(root: str) -> dict[str, dict[int, float]]:
    """``{tag file stem: {step: value}}`` from DeepSpeed's csvMonitor output directory."""
    out: dict[str, dict[int, float]] = {}
    for path in glob.glob(os.path.join(root, "*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        out[os.path.basename(path)[:-4]] = {int(r[0]): float(r[1]) for r in rows[1:]}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, data) -> dict:
    tmp = str(tmp_path_factory.mktemp("monitored_run"))
    monitor_dir = os.path.join(tmp, "monitor")
    cfg = train_config(tmp, data, pp=2, steps=4, training={"checkpoint_interval": 0, "export_hf": False,
                                                          "trace_steps": [2, 3]},
                       ds={"csv_monitor": {"enabled": True, "output_path": monitor_dir, "job_name": "job"}})
    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    run_ranks(_train_rank, 2, path, timeout=240)
    return {"run": os.path.join(tmp, "run"), "monitor": os.path.join(monitor_dir, "job")}


def test_every_log_csv_metric_reaches_deepspeeds_monitor(run):
    rows = read_log(run["run"])
    files = _monitor_files(run["monitor"])
    assert "Train_Samples_train_loss" in files  # DeepSpeed's own events land in the same place
    checked = 0
    for row in rows:
        step = int(row["step"])
        for key, cell in row.items():
            if key == "step" or cell == "":
                continue
            tag = f"ds_mp_{key}"
            assert tag in files, f"{key} missing from the monitor: {sorted(files)}"
            assert step in files[tag], f"{key} at step {step} missing from the monitor"
            places = len(cell.split(".")[1]) if "." in cell and "e" not in cell else 0
            assert files[tag][step] == pytest.approx(float(cell), rel=1e-6, abs=0.51 * 10 ** -places), (key, step)
            checked += 1
    logged = {k for r in rows for k, v in r.items() if v and k != "step"}
    assert {"val_loss", "val_ppl", "tokens_per_s", "tflops", "bubble", "grad_norm", "lr", "skipped"} <= logged
    assert checked >= 4 * 8


def test_trace_steps_write_a_timeline_that_ds_mp_timeline_renders(run, tmp_path, capsys):
    from ds_mp.tools.cli import main as ds_mp_cli
    from ds_mp.tools.viz import load_trace

    path = os.path.join(run["run"], "trace.json")
    with open(path) as f:
        assert json.load(f)["traceEvents"]          # Chrome-trace JSON
    traces = load_trace(path)
    assert sorted(traces) == [0, 1]                  # every rank
    for rank, trace in traces.items():
        steps = [n for n, _, _, _ in trace if n == "OptimizerStep"]
        assert len(steps) == 2, f"rank {rank}: steps 2 and 3 make 2 optimizer steps, got {len(steps)}"
        # 2 micro-batches per step: 4 forwards and 4 backwards per rank over the 2 steps
        assert sum(n == "ForwardPass" for n, *_ in trace) == 4 and sum(n == "BackwardPass" for n, *_ in trace) == 4
    png = str(tmp_path / "timeline.png")
    assert ds_mp_cli(["timeline", path, "--out", png]) == 0
    assert os.path.getsize(png) > 1000
    assert "bubble fraction" in capsys.readouterr().out
