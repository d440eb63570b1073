"""Fine-tuning a pretrained HF GPT-2 directory end to end through the ``deepspeed`` launcher:

    deepspeed --num_gpus 2 launch/finetune.py --model <hf dir> --data <dataset> \
        --deepspeed_config ds_configs/finetune_tp2.json      (TP=2, shrunk to a tiny run)

then: the exported ``<output_dir>/hf`` loads with ``from_pretrained`` and holds exactly the
final training checkpoint's weights, ``ds-mp eval`` gives the same loss on both, and
``ds-mp generate`` writes text from both.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from launcher_utils import REPO, explain, launch, read_log, tiny_dataset

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One fine-tuning run shared by the checks below."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from ds_mp.data import DatasetInfo

    tmp = str(tmp_path_factory.mktemp("finetune"))
    data = tiny_dataset(tmp)
    tok = AutoTokenizer.from_pretrained(DatasetInfo.load(data).tokenizer_dir)
    pretrained = os.path.join(tmp, "pretrained")
    torch.manual_seed(0)
    eos = tok.eos_token_id
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tok), n_positions=64,
                               bos_token_id=eos, eos_token_id=eos)).save_pretrained(pretrained)
    tok.save_pretrained(pretrained)
    with open(os.path.join(REPO, "ds_configs", "finetune_tp2.json")) as f:
        cfg = json.load(f)
    cfg["optimizer"]["params"]["lr"] = cfg["scheduler"]["params"]["warmup_max_lr"] = 1e-3  # visible change
    cfg["ds_mp"]["data"]["seq_len"] = 32
    cfg["ds_mp"]["training"].update(steps=20, eval_batches=1, output_dir=os.path.join(tmp, "out"))
    proc = launch(tmp, cfg, script="launch/finetune.py", args=("--model", pretrained, "--data", data))
    assert proc.returncode == 0, explain(proc)
    return {"tmp": tmp, "data": data, "pretrained": pretrained, "out": os.path.join(tmp, "out"), "cfg": cfg}


def test_finetune_logs_and_exports_the_final_weights(run):
    from transformers import GPT2LMHeadModel

    from ds_mp.checkpoint import ShardedReader
    from ds_mp.checkpoint.convert import model_from

    rows = read_log(run["out"])
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20]
    assert all(r["val_ppl"] for r in rows if int(r["step"]) % 10 == 0)
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    ckpt_root = os.path.join(run["out"], "checkpoints")
    with open(os.path.join(ckpt_root, "latest")) as f:
        tag = f.read().strip()
    assert tag == "step20"
    reader = ShardedReader(os.path.join(ckpt_root, tag))
    assert reader.tp == 2
    exported = GPT2LMHeadModel.from_pretrained(os.path.join(run["out"], "hf")).eval()
    final, start = model_from(reader), GPT2LMHeadModel.from_pretrained(run["pretrained"]).eval()
    ids = torch.randint(0, exported.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = exported(input_ids=ids).logits
        assert torch.equal(got, final(input_ids=ids).logits)           # export == engine's final weights
        assert (got - start(input_ids=ids).logits).abs().max() > 1e-3  # ... which did change
    assert os.path.isfile(os.path.join(run["out"], "hf", "tokenizer.json"))


def test_eval_on_export_equals_eval_on_training_checkpoint(run, capsys):
    import numpy as np

    from ds_mp.tools.evaluate import eval_cli

    tokens = os.path.join(run["tmp"], "val.npy")
    np.save(tokens, np.fromfile(os.path.join(run["data"], "val_tokens.bin"), dtype=np.uint16)[:200])
    outs = []
    for model in (os.path.join(run["out"], "hf"), os.path.join(run["out"], "checkpoints")):
        assert eval_cli(["--model", model, "--data", tokens, "--window", "64", "--device", "cpu"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["scored_tokens"] == outs[1]["scored_tokens"] == 199
    assert outs[1]["nll"] == pytest.approx(outs[0]["nll"], rel=1e-6)


def test_generate_from_export_and_from_training_checkpoint(run, capsys):
    from ds_mp.tools.generate import generate_cli

    texts = []
    for model in (os.path.join(run["out"], "hf"), os.path.join(run["out"], "checkpoints")):
        assert generate_cli(["--model", model, "--prompt", "def ", "--max-new-tokens", "8"]) == 0
        texts.append(capsys.readouterr().out)
    assert "def" in texts[0] and len(texts[0].strip()) > len("def")
    assert texts[1] == texts[0]   # same weights, same tokenizer (the dataset's), greedy
