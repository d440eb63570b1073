"""A NaN stop's advice works when followed (issue 43, item 4).  On main b45273d a NaN before the
first checkpoint was a dead end: "start again without --resume" was refused ("already holds
checkpoints", the ``nan-stepN`` diagnostic) and ``--resume`` too ("no finished checkpoint")."""
from __future__ import annotations

import json
import os

import pytest
from dist_utils import run_ranks
from launcher_utils import loop_rank, tiny_dataset, train_config
from test_ops_startup import _errors

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return tiny_dataset(str(tmp_path_factory.mktemp("nan_advice")))


def _run(tmp: str, data: str, lr: float, interval: int, steps: int, args: list[str]) -> tuple[int, str]:
    """One rank of SGD at ``lr`` (1e30 diverges at step 2), checkpoints every ``interval`` steps."""
    cfg = train_config(tmp, data, pp=1, steps=steps, ds={"gradient_clipping": 0.0,
                                                        "optimizer": {"type": "SGD", "params": {"lr": lr}}},
                       training={"export_hf": False, "eval_interval": 0, "checkpoint_interval": interval,
                                 "on_nan": "stop"})
    path = os.path.join(tmp, f"config-{lr}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return run_ranks(loop_rank, 1, path, args, timeout=240)[0]


@pytest.mark.parametrize("case", ["no_checkpoint", "only_diverged", "earlier"])
def test_the_nan_message_advice_works_when_followed(data, tmp_path, case):
    """Diverge with no checkpoint before the NaN, with only the checkpoint of the step before it (it
    holds the diverging weights: main called it "the last good checkpoint", and resuming it NaNs
    again), or with older ones; do what the line says with a lower LR: every way trains."""
    tmp = str(tmp_path)
    ckpts, out = os.path.join(tmp, "run", "checkpoints"), []
    if case == "earlier":  # step1, step2 at a sane LR; then 1e30 from step 3: step3 diverged, NaN at step 4
        assert _run(tmp, data, 1e-3, 1, 2, [])[0] == 0
    rc, err = _run(tmp, data, 1e30, 0 if case == "no_checkpoint" else 1, 20, ["--resume"] if case == "earlier" else [])
    lines = _errors(err)
    bad = 4 if case == "earlier" else 2
    assert rc == 3 and len(lines) == 1 and f"nan-step{bad}" in lines[0], err[-3000:]
    if case == "no_checkpoint":
        assert "no checkpoint precedes it: lower the LR and start again without --resume" in lines[0], lines[0]
        advice: list[str] = []
    elif case == "only_diverged":
        assert "checkpoints (step1) hold the diverging weights" in lines[0] and "--output_dir" in lines[0], lines[0]
        assert "good" not in lines[0]
        out = ["--output_dir", os.path.join(tmp, "again")]
        ckpts = os.path.join(tmp, "again", "checkpoints")
        advice = out
    else:
        assert "continue from step2" in lines[0] and "--resume step2" in lines[0], lines[0]
        advice = ["--resume", "step2"]
    rc, err = _run(tmp, data, 1e-3, 1, 5, advice)
    assert rc == 0, err[-3000:]
    with open(os.path.join(ckpts, "latest")) as f:
        assert f.read().strip() == "step5"
