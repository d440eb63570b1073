"""Context parallelism on the GPU path (CUDA, NCCL): CP = 2 on two GPUs (NCCL takes one rank per
device), both impls, packed documents, fp32 with TF32 off, against the unmodified HF model on one
process (tests/test_cp_engine.py's cases and oracle, 1e-5).  Every tensor of the CP exchanges
(all-gather / reduce-scatter, all-to-all) and of the engine's step head must be on the device: NCCL
refuses CPU tensors.  Skipped with fewer than two GPUs; run with ``pytest -m gpu`` where lent."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from test_cp_engine import check, _case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one rank each)")]

CASES = [_case("gpt2_cp2_allgather_nccl"), _case("qwen2_cp2_ulysses_nccl", model="qwen2", impl="ulysses")]


def _rank(rank: int) -> dict:
    import ds_mp
    from test_cp_engine import MODELS
    from test_tensor_parallel import gather_weights

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = {}
    for case in CASES:
        gas = case["gas"]
        engine, *_ = ds_mp.initialize(model=MODELS[case["model"]](), config=case["cfg"])
        assert engine.device.type == "cuda"
        evaluated = float(engine.eval_batch(iter(case["steps"][0][:gas])))
        losses = [float(engine.train_batch(iter(step[:gas]))) for step in case["steps"]]
        out[case["name"]] = (losses, {k: v.cpu() for k, v in gather_weights(engine)[0].items()}, evaluated)
    return out


def test_cp2_on_two_gpus_trains_hf_exactly() -> None:
    check(CASES, run_ranks(_rank, 2, timeout=600))
