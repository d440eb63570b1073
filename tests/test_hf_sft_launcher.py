"""launch/trl_sft.py through the real ``deepspeed`` launcher with ds_configs/trainer_tp2_pp2.json (4 CPU
ranks, TP2 × PP2, the script's built-in tiny Qwen2 and chats): it trains, logs the Trainer's losses,
and ``save_model()`` writes a directory that ``from_pretrained`` loads with its chat template."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dist_utils import free_port

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trl_sft_script_through_the_deepspeed_launcher(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path / "run")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(free_port()),
           "--num_gpus", "4", "launch/trl_sft.py", "--deepspeed", "ds_configs/trainer_tp2_pp2.json",
           "--output_dir", out, "--bf16", "false", "--max_steps", "3", "--max_length", "48", "--packing", "true",
           "--assistant_only_loss", "true", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
           "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no",
           "--disable_tqdm", "true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_MP_TIMEOUT="120", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = [float(x) for x in re.findall(r"\{'loss': '([-+.0-9e]+)'", proc.stdout)]  # lines of ranks may interleave
    assert len(losses) >= 3 and all(0 < x < 20 for x in losses), proc.stdout[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen2" and "{% generation %}" in tok.chat_template
