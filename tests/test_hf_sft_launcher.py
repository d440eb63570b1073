"""launch/trl_sft.py through the real launchers (CPU ranks, the script's built-in tiny Qwen2 and chats).

``deepspeed``, ``accelerate launch`` and ``torchrun`` (2 ranks, TP = 2, 2 steps) train the same
model: the same saved weights, the same logged losses; each launch logs every one of the Trainer's
loss lines once per job (not once per rank), and ``save_model()`` writes a directory that
``from_pretrained`` loads with its chat template.  The shipped TP2 × PP2 config
(ds_configs/trainer_tp2_pp2.json) is run against plain TRL in tests/test_hf_sft.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dist_utils import free_port
from launcher_utils import clean_env

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_ARGS = ["--bf16", "false", "--max_length", "48", "--packing", "true", "--assistant_only_loss", "true",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
            "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--disable_tqdm", "true"]


def launch(kind: str, ranks: int, config: str, argv: list[str]) -> subprocess.CompletedProcess:
    """launch/trl_sft.py through ``kind`` (deepspeed, accelerate, torchrun) on ``ranks`` CPU ranks."""
    bin_dir, port = os.path.dirname(sys.executable), str(free_port())
    cmd = {"deepspeed": [os.path.join(bin_dir, "deepspeed"), "--master_port", port, "--num_gpus", str(ranks)],
           "torchrun": [os.path.join(bin_dir, "torchrun"), "--nproc_per_node", str(ranks), "--master_port", port],
           "accelerate": [os.path.join(bin_dir, "accelerate"), "launch", "--use_deepspeed", "--num_processes",
                          str(ranks), "--deepspeed_config_file", config, "--main_process_port", port]}[kind]
    env = clean_env(OMP_NUM_THREADS="1", DS_MP_TIMEOUT="120", PYTHONUNBUFFERED="1",
                    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd + ["launch/trl_sft.py", "--deepspeed", config, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"{kind}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def logged_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\{'loss': '([-+.0-9e]+)'", stdout)]


@pytest.mark.slow
def test_three_launchers_train_the_same_sft_model(tmp_path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = str(tmp_path / "ds.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
                   "ds_mp": {"tensor_parallel": {"size": 2}}}, f)
    got = {}
    for kind in ("deepspeed", "accelerate", "torchrun"):
        out = str(tmp_path / kind)
        proc = launch(kind, 2, config, ["--output_dir", out, "--max_steps", "2", *SFT_ARGS])
        got[kind] = (logged_losses(proc.stdout), load_file(os.path.join(out, "model.safetensors")))
        assert len(got[kind][0]) == 2 and all(0 < x < 20 for x in got[kind][0]), (kind, proc.stdout[-3000:])
        tok = AutoTokenizer.from_pretrained(out)
        assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2", kind
        assert "{% generation %}" in tok.chat_template, kind
    losses, weights = got["deepspeed"]
    for kind, (other_losses, other_weights) in got.items():
        assert other_losses == losses, kind
        assert other_weights.keys() == weights.keys(), kind
        for k in weights:
            torch.testing.assert_close(other_weights[k], weights[k], rtol=1e-6, atol=1e-6, msg=f"{kind}: {k}")
