"""ds_mp.tools.viz on synthetic traces and logs: Chrome JSON, Gantt PNG, bubble maths, curves, CLIs."""
from __future__ import annotations

import csv
import json

import pytest

from ds_mp.tools import viz
from ds_mp.tools.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two stages, two micro-batches, forward 1 s, backward 2 s (GPipe order), times in seconds.
#   rank 0: F0 [0,1] F1 [1,2]                     B1 [6,8] B0 [8,10]  OptimizerStep [10,11]
#   rank 1:          F0 [1,2] F1 [2,3] B1 [3,5] B0 [5,7]               OptimizerStep [10,11]
HAND = {
    0: [("ForwardPass", 0, 100.0, 101.0), ("SendActivation", 0, 101.0, 101.0), ("ForwardPass", 1, 101.0, 102.0),
        ("RecvGrad", 1, 102.0, 106.0), ("BackwardPass", 1, 106.0, 108.0), ("BackwardPass", 0, 108.0, 110.0),
        ("OptimizerStep", -1, 110.0, 111.0)],
    1: [("RecvActivation", 0, 100.0, 101.0), ("ForwardPass", 0, 101.0, 102.0), ("ForwardPass", 1, 102.0, 103.0),
        ("BackwardPass", 1, 103.0, 105.0), ("SendGrad", 1, 105.0, 105.0), ("BackwardPass", 0, 105.0, 107.0),
        ("OptimizerStep", -1, 110.0, 111.0)],
}


def test_instruction_kinds_and_labels():
    assert [viz.instruction_kind(n) for n in ("ForwardPass", "BackwardPass", "SendGrad", "RecvActivation",
                                              "OptimizerStep", "ReduceGrads", "LoadMicroBatch")] == \
        ["forward", "backward", "comm", "comm", "optimizer", "other", "other"]
    assert viz.event_label("ForwardPass", 3) == "F3" and viz.event_label("BackwardPass", 3) == "B3"
    assert viz.event_label("SendActivation", 3) == "SendActivation"


def test_chrome_trace_is_valid_and_one_row_per_rank(tmp_path):
    path = viz.write_chrome_trace(HAND, str(tmp_path / "sub" / "trace.json"))
    data = json.loads(open(path).read())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(t) for t in HAND.values())
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"} <= set(e) and e["pid"] == e["tid"]
        assert e["ts"] >= 0 and e["dur"] >= 0
    assert {e["pid"] for e in xs} == {0, 1}
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    f1 = next(e for e in xs if e["pid"] == 0 and e["name"] == "F1")
    assert f1["ts"] == pytest.approx(1e6) and f1["dur"] == pytest.approx(1e6) and f1["args"]["buffer_id"] == 1
    # round trip back to seconds (relative to the earliest start)
    back = viz.load_trace(path)
    assert back[1][3] == ("BackwardPass", 1, pytest.approx(3.0), pytest.approx(5.0))


def test_bubble_fraction_on_hand_example(tmp_path):
    stats = viz.timeline_png(HAND, str(tmp_path / "t.png"), title="hand")
    # makespan 11 s; each rank computes 2·1 + 2·2 = 6 s -> busy 6/11, bubble 5/11
    assert stats["makespan_s"] == pytest.approx(11.0)
    for r in (0, 1):
        assert stats["ranks"][r]["compute_s"] == pytest.approx(6.0)
        assert stats["ranks"][r]["bubble"] == pytest.approx(5 / 11)
    assert stats["bubble"] == pytest.approx(1 - 12 / 22)
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)


def test_timeline_from_chrome_json_and_cli(tmp_path, capsys):
    trace = viz.write_chrome_trace(HAND, str(tmp_path / "trace.json"))
    assert viz.bubble_stats(viz.load_trace(trace))["bubble"] == pytest.approx(10 / 22)
    out = tmp_path / "cli.png"
    assert cli_main(["timeline", trace, "--out", str(out), "--title", "cli"]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert "bubble fraction 45.5%" in capsys.readouterr().out
    assert cli_main(["timeline", str(tmp_path / "missing.json"), "--out", str(out)]) == 2


def test_gather_trace_single_process():
    class Engine:
        trace = [("ForwardPass", 0, 1.0, 2.0)]

    assert viz.gather_trace(Engine()) == {0: [("ForwardPass", 0, 1.0, 2.0)]}


def test_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="empty trace"):
        viz.bubble_stats({0: []})


def _write_log(run_dir):
    run_dir.mkdir()
    with open(run_dir / "log.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "val_loss", "lr", "tokens_per_s", "tflops", "bubble",
                                          "grad_norm", "peak_mem_mib", "skipped", "elapsed_s"])
        w.writeheader()
        for step in range(10, 60, 10):
            w.writerow({"step": step, "loss": 5.0 - step / 50, "val_loss": 4.9 if step % 20 == 0 else "",
                        "lr": 1e-3 * step / 50, "tokens_per_s": 1000 + step, "tflops": 0.01, "bubble": 0.2,
                        "grad_norm": "", "peak_mem_mib": 500, "skipped": 0, "elapsed_s": step})


def test_plot_run_and_cli(tmp_path):
    run = tmp_path / "run"
    _write_log(run)
    assert viz.read_log(str(run / "log.csv"))["val_loss"] == [(20, 4.9), (40, 4.9)]
    png = viz.plot_run(str(run))
    assert png == str(run / "curves.png") and open(png, "rb").read().startswith(PNG_MAGIC)
    out = tmp_path / "c.png"
    assert cli_main(["plot", str(run), "--out", str(out)]) == 0 and out.read_bytes().startswith(PNG_MAGIC)
    assert cli_main(["plot", str(tmp_path / "nope")]) == 2


def test_log_bubble_counts_every_schedules_compute():
    """The training log's bubble counts TeraPipe's slices and Ouroboros' module passes as compute
    (it read 1.000 for TeraPipe when only ForwardPass/BackwardPass counted)."""
    from ds_mp.training.metrics import bubble

    assert bubble({"ForwardPass": 1.0, "BackwardPass": 2.0, "SendActivation": 0.5}, 4.0) == pytest.approx(0.25)
    assert bubble({"ForwardSlice": 1.0, "BackwardSlice": 2.0, "LoadSlice": 0.5}, 4.0) == pytest.approx(0.25)
    assert bubble({"ModuleForward": 1.0, "ModuleBackward": 2.0, "UpdateModules": 0.5}, 4.0) == pytest.approx(0.25)
