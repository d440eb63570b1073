"""The fine-tuner's workflow around training (issue 43, items 6-10): validation over the whole held-out
split equals an HF oracle at PP=2 and DP=2 (15 uneven held-out chats), ``ds-mp eval --format chat``
prints the same number, a dataset without a held-out split trains, epochs, and the export stops
``generate()`` at the template's end of turn."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest
import torch
from dist_utils import run_ranks
from helpers import ds_config

from ds_mp.data import SftDataset, SftRows, TokenDataset, prepare_sft_data
from ds_mp.data.sft_format import CHATML, CHATML_TOKENS
from sft_utils import chat_tokenizer, conversations, write_jsonl

pytestmark = pytest.mark.timeout(900)
SEQ = 128


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A base tokenizer without a chat template (ChatML given as --chat-template, as a user of a base
    model does), a tiny GPT-2 using it, a chat dataset holding out 15 chats, one with no held-out
    split, and a held-out records file."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = str(tmp_path_factory.mktemp("sft_workflow"))
    tok = chat_tokenizer(os.path.join(root, "tok"), template=None)
    model = os.path.join(root, "model")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_layer=2, n_embd=32, n_head=4, n_positions=SEQ,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.eos_token_id,
                               eos_token_id=tok.eos_token_id)).save_pretrained(model)
    tok.save_pretrained(model)
    src = write_jsonl(os.path.join(root, "chats.jsonl"), [{"messages": m} for m in conversations(60, seed=3, words=8)])
    template = os.path.join(root, "chatml.jinja")
    with open(template, "w") as f:
        f.write(CHATML)
    kw = dict(chat_template=template, show_progress=False)
    data = prepare_sft_data([src], os.path.join(root, "data"), model, "chat", val_fraction=0.25, **kw).path
    data0 = prepare_sft_data([src], os.path.join(root, "data0"), model, "chat", val_fraction=0, **kw).path
    held = write_jsonl(os.path.join(root, "held.jsonl"), [{"messages": m} for m in conversations(15, seed=11, words=9)])
    return {"root": root, "model": model, "data": data, "data0": data0, "held": held, "template": template}


def hf_oracle(model_dir: str, docs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The unmodified HF model on each document alone: Σ (HF mean loss × targets) / Σ targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = count = 0.0
    for ids, mask in docs:
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        k = int((labels[1:] != -100).sum())
        with torch.no_grad():
            total += float(model(input_ids=ids[None], labels=labels[None]).loss) * k
        count += k
    return total / count


def split_docs(ds: SftDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    o = ds.offsets
    return [(torch.from_numpy(ds.tokens[o[d]:o[d + 1]].astype("int64")),
             torch.from_numpy(ds.mask[o[d]:o[d + 1]].copy())) for d in range(len(ds))]


def _held_out_rank(rank: int, model_dir: str, data: str, pp: int, packing: bool) -> float:
    import ds_mp
    from ds_mp.data.validation import HeldOutBatches
    from ds_mp.training.loop import evaluate
    from transformers import AutoModelForCausalLM

    engine, *_ = ds_mp.initialize(model=AutoModelForCausalLM.from_pretrained(model_dir),
                                  config=ds_config(pp=pp, micro=2, gas=2, seq=SEQ, lr=0.0))
    topo = engine.topology
    rows = SftRows(SftDataset(TokenDataset(data, "val")), SEQ, packing=packing, seed=1234)
    return evaluate(engine, HeldOutBatches(rows, SEQ, 2, 2, topo.dp_rank, topo.dp))


@pytest.mark.parametrize("pp,packing", [(2, True), (1, False)], ids=["pp2_packed", "dp2_one_per_row"])
def test_val_loss_is_the_whole_held_out_split_per_token(world, pp, packing):
    """15 held-out chats of uneven length: rows that fill the passes unevenly (the last pass partly
    empty; at DP=2 the replicas hold different row counts), each read once."""
    val = SftDataset(TokenDataset(world["data"], "val"))
    assert len(val) == 15
    rows = SftRows(val, SEQ, packing=packing, seed=1234)
    assert rows.report["truncated"] == 0 and len(rows.rows) % (2 * 2 * (2 // pp)) != 0  # uneven on purpose
    got = run_ranks(_held_out_rank, 2, world["model"], world["data"], pp, packing, timeout=600)
    want = hf_oracle(world["model"], split_docs(val))
    assert got[0] == got[1] and abs(got[0] - want) < 1e-5, (got, want)


def _train(rank: int, cfg: dict, model: str, path: str) -> tuple[int, str]:
    from ds_mp.training.loop import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["--deepspeed_config", path, "--model", model])
    return code, out.getvalue()


def run_training(tmp: str, data: str, model: str, world_size: int = 1, pp: int = 1, lr: float = 0.0,
                 val_path: str = "", **training) -> tuple[list[dict], str]:
    """``ds_mp.training.loop.main`` on ``world_size`` ranks (micro 2 × GA 2); returns log.csv and rank 0's output."""
    import csv

    cfg = ds_config(pp=pp, micro=2, gas=2, seq=SEQ, lr=lr, data={"path": data, "seq_len": SEQ,
                                                                **({"val_path": val_path} if val_path else {})},
                    training={"output_dir": os.path.join(tmp, "run"), "log_interval": 1, "checkpoint_interval": 0,
                              "export_hf": False, **training})
    path = os.path.join(tmp, "cfg.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    results = run_ranks(_train, world_size, cfg, model, path, timeout=600)
    code, out = results[0]
    assert code == 0, out[-3000:]
    with open(os.path.join(tmp, "run", "log.csv")) as f:
        return list(csv.DictReader(f)), out


def test_training_validates_on_a_named_held_out_file_like_ds_mp_eval(world, tmp_path, capsys):
    """data.val_path = a records file: val_loss (PP=2, lr 0) = the HF oracle over its chats =
    ``ds-mp eval --format chat`` on the same file."""
    from ds_mp.data.sft_prepare import encode_documents, load_sft_tokenizer
    from ds_mp.tools.evaluate import eval_cli

    rows, _ = run_training(str(tmp_path), world["data"], world["model"], world_size=2, pp=2, val_path=world["held"],
                           steps=1, eval_interval=1)
    tok = load_sft_tokenizer(os.path.join(world["data"], "tokenizer"), "chat")
    docs = [(torch.tensor(i), torch.tensor(m)) for _, _, i, m in encode_documents([world["held"]], tok, "chat")]
    want = hf_oracle(world["model"], docs)
    assert abs(float(rows[0]["val_loss"]) - want) < 1e-5, (rows[0]["val_loss"], want)
    capsys.readouterr()
    assert eval_cli(["--model", world["model"], "--data", world["held"], "--format", "chat",
                     "--chat-template", world["template"], "--window", str(SEQ), "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["targets"] == sum(int(m[1:].sum()) for _, m in docs)
    assert abs(got["loss"] - want) < 1e-5 and abs(got["ppl"] - math.exp(want)) < 1e-3


def test_eval_of_a_prepared_dataset_scores_its_held_out_split(world, capsys):
    """``ds-mp eval --data DATASET_DIR --format chat``: the val split training validates on, the same
    HF oracle the PP=2 / DP=2 val_loss above equals."""
    from ds_mp.tools.evaluate import eval_cli

    assert eval_cli(["--model", world["model"], "--data", world["data"], "--format", "chat", "--window", str(SEQ),
                     "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = hf_oracle(world["model"], split_docs(SftDataset(TokenDataset(world["data"], "val"))))
    assert abs(got["loss"] - want) < 1e-5, (got, want)


def test_eval_recognises_chat_records_given_as_text(world, capsys):
    from ds_mp.tools.evaluate import eval_cli

    assert eval_cli(["--model", world["model"], "--data", world["held"], "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "chat records; pass --format chat" in err and len(err.strip().splitlines()) == 1


def test_no_held_out_split_trains_without_validation(world, tmp_path):
    """--val-fraction 0 with validation on (eval_interval 1): trains, says so once, logs no val_loss."""
    rows, out = run_training(str(tmp_path), world["data0"], world["model"], steps=2, eval_interval=1)
    assert [int(r["step"]) for r in rows] == [1, 2] and all(r["val_loss"] == "" for r in rows)
    assert out.count("ds_mp: no validation: the dataset has no held-out split") == 1


def test_epochs_derive_steps_and_export_stops_at_end_of_turn(world, tmp_path):
    """training.epochs: steps derived, printed, an epoch column; the export (base tokenizer + ChatML
    --chat-template) has generation_config.eos_token_id = [<|im_end|>, eos]."""
    from transformers import AutoTokenizer, GenerationConfig

    n = len(SftRows(SftDataset(TokenDataset(world["data"])), SEQ, seed=1234).rows)
    rows, out = run_training(str(tmp_path), world["data"], world["model"], steps=1000, epochs=1.5,
                             eval_interval=0, export_hf=True, lr=1e-3)
    steps = math.ceil(1.5 * n / 4)
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert f"ds_mp: epoch = {n} rows; {n / 4:.1f} steps per epoch at global batch 4; training.epochs=1.5 -> " \
           f"{steps} steps" in out
    assert float(rows[-1]["epoch"]) == pytest.approx(steps * 4 / n, abs=1e-3) and float(rows[-1]["epoch"]) >= 1.5
    assert float(rows[0]["epoch"]) == pytest.approx(4 / n, abs=1e-3)
    hf = os.path.join(str(tmp_path), "run", "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    eos = GenerationConfig.from_pretrained(hf).eos_token_id
    assert eos == [tok.convert_tokens_to_ids(CHATML_TOKENS[1]), tok.eos_token_id]


def test_epoch_steps_coherent_over_resume_and_ramp():
    from ds_mp.training.batch_ramp import BatchRamp
    from ds_mp.training.epochs import epoch_steps

    assert epoch_steps(2, 30, 0, 0, 8) == 8  # 60 samples / 8
    assert epoch_steps(2, 30, 24, 3, 4) == 3 + 9  # resumed after 3 steps of 8 at another global batch of 4
    ramp = BatchRamp("linear", 4, 16, 40, 1, "none", 4)
    total, consumed, step = epoch_steps(3, 50, 0, 0, 4, ramp), 0, 0
    while consumed < 150:  # the ramp run itself
        step += 1
        consumed += ramp.before_step(step)
        ramp.after_step()
        if step == 3:
            assert epoch_steps(3, 50, ramp.consumed, 3, ramp.batch, ramp) == total  # a resume mid-ramp
    assert step == total
