"""Context parallelism from the launcher's JSON: ``launch/train.py``'s loop (in-process ranks,
``train_in_process``) at CP = 2 on 2 ranks logs the losses — training and evaluation — of the same
run at CP = 1 on one process (same JSON but ``context_parallel``; one replica reading every row in
both).  ``ds_mp.hf.SFTTrainer`` with packing at CP = 2 against plain TRL on one process without CP.
The Python API (``ds_mp.initialize``) is tests/test_cp_engine.py's."""
from __future__ import annotations

import os
from typing import Any

import pytest

from dist_utils import run_ranks
from launcher_utils import read_log, tiny_dataset, train_config, train_in_process
from test_hf_sft import ARGS, _run, compare, ds_json, plain, saved


def test_launcher_json_at_cp2_logs_the_cp1_run(tmp_path) -> None:
    data = tiny_dataset(str(tmp_path))
    logs = {}
    for cp, n in ((1, 1), (2, 2)):
        tmp = str(tmp_path / f"cp{cp}")
        os.makedirs(tmp)
        cfg = train_config(tmp, data, pp=1, steps=4, context_parallel={"size": cp})
        train_in_process(tmp, cfg, n=n, timeout=400)
        logs[cp] = read_log(os.path.join(tmp, "run"))
    assert len(logs[1]) == len(logs[2]) == 4
    for key in ("loss", "val_loss"):
        one = [float(r[key]) for r in logs[1] if r.get(key)]
        two = [float(r[key]) for r in logs[2] if r.get(key)]
        assert one and len(one) == len(two), (key, logs)
        assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(one, two)), (key, one, two)


@pytest.mark.timeout(1200)
def test_sft_trainer_with_packing_at_cp2_equals_plain_trl(tmp_path: Any) -> None:
    """``ds_mp.hf.SFTTrainer`` with ``packing=True`` (which plain TRL refuses with its own ``cp_size``)
    at CP = 2 on 2 ranks: the losses, eval loss and saved weights of plain ``trl.SFTTrainer`` on one
    process without CP (tests/test_hf_sft.py's script and oracle)."""
    ref = plain(str(tmp_path / "plain"))
    out = str(tmp_path / "ds_mp")
    cfg = ds_json(str(tmp_path / "ds.json"), context_parallel={"size": 2})
    res = run_ranks(_run, 2, ARGS + ["--output_dir", out, "--deepspeed", cfg], False, timeout=900)[0]
    compare(ref, res, saved(out), "CP2")
