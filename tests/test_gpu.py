"""The GPU path (CUDA, NCCL): skipped without CUDA; run with ``pytest -m gpu`` where one is lent.

One rank on one GPU (NCCL takes one rank per device): bf16 training, a layout-free save and load
(every tensor of the save's collectives on the device: NCCL refuses CPU tensors), eval, and
``generate`` on the exported model.  Several ranks on one GPU need gloo, which the CPU suite
covers.
"""
from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from helpers import batches, ds_config, tiny_gpt2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m gpu where lent)")]


def _one_gpu(rank: int, out: str) -> dict:
    import ds_mp

    cfg = {**ds_config(lr=0.05, optimizer="AdamW"), "bf16": {"enabled": True}}
    data = [batches(2, 2, 16, 203, seed=s) for s in range(4)]
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(), config=cfg)
    assert engine.device.type == "cuda"
    losses = []
    for t, mbs in enumerate(data):
        if t == 2:
            engine.save_checkpoint(out + "/ckpt", tag="mid")
        losses.append(float(engine.train_batch(iter(mbs))))
    resumed, *_ = ds_mp.initialize(model=tiny_gpt2(seed=1), config=cfg)
    resumed.load_checkpoint(out + "/ckpt")
    tail = [float(resumed.train_batch(iter(mbs))) for mbs in data[2:]]
    eval_loss = float(resumed.eval_batch(iter(data[0])))
    ds_mp.save_hf(resumed, out + "/hf")
    return {"losses": losses, "tail": tail, "eval": eval_loss}


def test_bf16_train_save_resume_eval_on_one_gpu(tmp_path):
    from transformers import GPT2LMHeadModel

    r = run_ranks(_one_gpu, 1, str(tmp_path), timeout=600)[0]
    torch.testing.assert_close(torch.tensor(r["tail"]), torch.tensor(r["losses"][2:]), rtol=5e-4, atol=0)
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).cuda().eval()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long, device="cuda"), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 5)
