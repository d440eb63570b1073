"""The Llama family's checkpoints: HF ⇄ sharded bit-exact at any TP × PP, training from a
``save_pretrained`` directory, resuming at another layout, and ``generate()`` after training.

Tiny ``save_pretrained`` checkpoints built in the test (no downloads).  The oracle is the
unmodified HF model trained single-process with torch SGD + momentum (optimizer state crosses
the resume), and HF's own ``generate()``.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, train_one_process
from test_llama import SEQ, VOCAB, tiny_llama

LR, MOMENTUM = 0.1, 0.9


@pytest.mark.parametrize("kind, kv, tied", [("qwen2", 2, True), ("llama", 3, False)])
def test_hf_sharded_round_trip_bit_exact(kind: str, kv: int, tied: bool, tmp_path) -> None:
    """hf -> sharded at TP=3 x PP=2 (KV heads replicated for 2, split for 3) -> sharded at TP=2 x PP=1
    -> HF: every tensor bit-exact, and from_pretrained gives the source's logits."""
    from ds_mp.checkpoint import ShardedReader, ds_to_hf, hf_to_ds

    model = tiny_llama(kind, kv, tied, n_layer=3, inner=204)  # 204: TP=3 and TP=2 both split it evenly
    model.save_pretrained(tmp_path / "hf")
    hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds3x2"), tp=3, pp=2, verify_logits=True)
    hf_to_ds(str(tmp_path / "ds3x2"), str(tmp_path / "ds2x1"), tp=2, pp=1)
    ds_to_hf(str(tmp_path / "ds2x1"), str(tmp_path / "back"), verify_logits=True)
    reader = ShardedReader(str(tmp_path / "ds3x2"))
    kv_shard = reader.local_shape("model.layers.0.self_attn.k_proj.weight")
    assert kv_shard == ((kv // 3 if kv % 3 == 0 else kv) * 16, 96)  # split by heads, or every head on each rank
    back = type(model).from_pretrained(str(tmp_path / "back")).eval()
    want = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, want[name]), name
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def _sgd_config(tp: int, pp: int) -> dict:
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, seq=SEQ)
    cfg["optimizer"]["params"]["momentum"] = MOMENTUM
    return cfg


def _train_rank(rank: int, model_dir: str, tp: int, pp: int, steps: list, root: str, save: bool,
                resume: bool, out: str | None) -> list[float]:
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    engine, *_ = ds_mp.initialize(model=model_dir, config=_sgd_config(tp, pp))
    if resume:
        load_checkpoint(engine, root)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps]
    if save:
        save_checkpoint(engine, root, "step1")
    if out:
        ds_mp.save_hf(engine, out)
    return losses


def hf_sgd(model, steps: list[list]) -> tuple[list[float], torch.nn.Module]:
    model = copy.deepcopy(model).train()
    losses, _ = train_one_process(model, steps, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    return losses, model.eval()


def test_train_resume_at_another_layout_then_generate(tmp_path) -> None:
    """From a save_pretrained Qwen2 directory: 1 step at TP=2 x PP=2 (4 ranks), checkpoint; resume at
    TP=2 x PP=1 (KV heads split the other way round of the stages), 1 more step, save_hf: the losses
    are HF's uninterrupted run's, the export loads with from_pretrained and its greedy generate()
    equals the HF-trained model's."""
    model = tiny_llama("qwen2", kv=2, tied=False, n_layer=3)
    model.save_pretrained(tmp_path / "base")
    steps = [batches(2, 2, SEQ, VOCAB, seed=40 + i) for i in range(2)]
    want, trained = hf_sgd(model, steps)
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    first = run_ranks(_train_rank, 4, str(tmp_path / "base"), 2, 2, steps[:1], root, True, False, None, timeout=600)
    second = run_ranks(_train_rank, 2, str(tmp_path / "base"), 2, 1, steps[1:], root, False, True, out, timeout=600)
    assert first[0] + second[0] == pytest.approx(want, abs=2e-5)
    assert os.path.isfile(os.path.join(out, "config.json"))
    exported = type(model).from_pretrained(out).eval()
    for name, t in trained.state_dict().items():
        assert (exported.state_dict()[name] - t).abs().max() < 2e-5, name
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(exported.generate(prompt, **kw), trained.generate(prompt, **kw))


@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_finetune_through_the_launcher(tmp_path, kind: str) -> None:
    """``deepspeed --num_gpus 2 launch/finetune.py --model <dir>`` at TP=2 (bf16), a Qwen2 and a Gemma 3
    directory: trains, checkpoints, and writes <output_dir>/hf, a directory of the same HF class that
    from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_gemma3
    from launcher_utils import explain, launch, read_log, tiny_dataset, train_config

    data = tiny_dataset(str(tmp_path))
    model_dir = str(tmp_path / kind)
    model = tiny_llama("qwen2", kv=2, tied=True) if kind == "qwen2" else tiny_gemma3()
    model.save_pretrained(model_dir)
    cfg = train_config(str(tmp_path), data, tp=2, pp=1, steps=2, ds={"bf16": {"enabled": True}})
    cfg["ds_mp"].pop("model")
    proc = launch(str(tmp_path), cfg, n=2, script="launch/finetune.py", args=("--model", model_dir, "--data", data),
                  timeout=600)
    assert proc.returncode == 0, explain(proc)
    rows = read_log(str(tmp_path / "run"))
    assert [int(r["step"]) for r in rows] == [1, 2]
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "hf"))
    assert type(exported) is type(model)
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step2")
