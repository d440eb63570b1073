"""``ds_mp.hf.Trainer.evaluate()`` on a tiny Qwen3-MoE with its aux loss on, against the plain
``transformers.Trainer.evaluate()`` on one process (the oracle).

HF's model returns, for each eval batch it is given (``per_device_eval_batch_size`` rows), its LM loss
(the batch's per-target-token mean) + ``coef · aux``, the aux pooled over every sparse layer and every
token the batch's attention mask keeps; the Trainer's ``evaluation_loop`` averages those per-batch
losses (each batch one weight, the short last one too).  ds_mp cuts each eval batch into micro-batches
of the pipeline's rows (``per_device_train_batch_size``), so the aux must be pooled over the eval
batch's micro-batches (their carries summed), not per micro-batch.  ds_mp's LM part is per target token
over the eval set (docs/trainer.md): the eval rows here give every eval batch the same targets per row
(10), so HF's row-weighted mean of per-batch means is that per-token loss and the plain Trainer's
``eval_loss`` is the oracle as it is.

Eval set: 10 rows of uneven lengths (5–16 tokens, right padding, a masked prompt), eval batches of 4
rows (4, 4, 2: micro-batches of 2 rows, 2 + 2 + 1), 3 micro-batches per pass (so an eval batch straddles
two passes, and the last pass is filled).  Layouts: PP2 (1F1B, ZB-V, interleaved), TP2, DP2 and
PP2 × DP2 (eval batch i on replica i mod 2: replica 0 reads batches 0 and 2).  The test checks it can fail: the eval loss without the aux
term, and with the aux pooled per micro-batch, both computed from the HF model, are far (> 100×
the tolerance) from the oracle.  Aux off: the plain LM loss, unchanged.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from helpers import ds_config
from test_hf_trainer import collate, ds_json, training_args
from test_moe_pp_models import COEF, tiny_moe4

RTOL = 1e-5
EVAL_BATCH, MICRO, GA = 4, 2, 3
LENGTHS = [16, 6, 12, 10, 5, 16, 14, 11, 11, 11]  # eval batches (4, 4, 2 rows) of 40, 40, 20 targets
PROMPTS = [0, 0, 0, 0, 0, 3, 0, 0, 0, 0]  # labels -100 on the first PROMPTS[i] tokens


def eval_rows(vocab: int = 203, seed: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return out


def _args(out: str, deepspeed: Any = None, ga: int = GA) -> Any:
    return training_args(out, deepspeed, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ga,
                         per_device_eval_batch_size=EVAL_BATCH)


def plain_eval(model_dir: str, out: str) -> float:
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = Trainer(model=model, args=_args(out), eval_dataset=eval_rows(), data_collator=collate)
    return trainer.evaluate()["eval_loss"]


def hf_parts(model_dir: str) -> dict[str, float]:
    """From the HF model directly: the per-token LM loss of the eval set, the aux term as HF's Trainer
    averages it (pooled per eval batch), and pooled per micro-batch (what a wrong pooling would give)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = eval_rows()

    def forward(batch: list[dict]) -> tuple[float, int, float, int]:
        mb = collate(batch)
        with torch.no_grad():
            out = model(**mb)
        n = int((mb["labels"][:, 1:] != -100).sum())
        aux = COEF * float(out.aux_loss) if out.aux_loss is not None else 0.0
        return float(out.loss) * n - aux * n, n, aux, len(batch)

    def by_rows(parts: list[tuple]) -> float:  # the Trainer's evaluation_loop: each batch weighted by its rows
        return sum(b[2] * b[3] for b in parts) / sum(b[3] for b in parts)

    per_batch = [forward(rows[i:i + EVAL_BATCH]) for i in range(0, len(rows), EVAL_BATCH)]
    per_micro = [forward(rows[i:i + MICRO]) for i in range(0, len(rows), MICRO)]
    return {"lm": sum(b[0] for b in per_batch) / sum(b[1] for b in per_batch),
            "targets_per_row": [b[1] / b[3] for b in per_batch],
            "aux": by_rows(per_batch), "aux_micro": by_rows(per_micro)}


def _rank(rank: int, model_dir: str, out: str, ds: dict) -> float:
    from ds_mp.hf import Trainer

    ga = 4 if ds["ds_mp"]["pipeline"]["schedule"] == "interleaved" else GA  # in groups of the stages
    trainer = Trainer(model=model_dir, args=_args(out, ds, ga), train_dataset=eval_rows(), eval_dataset=eval_rows(),
                      data_collator=collate)
    return trainer.evaluate()["eval_loss"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: Any) -> dict[bool, str]:
    out = {}
    for aux in (True, False):
        path = str(tmp_path_factory.mktemp(f"moe_aux{int(aux)}"))
        tiny_moe4(vocab=203, aux=aux).save_pretrained(path)
        out[aux] = path
    return out


@pytest.mark.parametrize("world, tp, pp, schedule, aux", [
    pytest.param(2, 1, 2, "1f1b", True, id="pp2"),
    pytest.param(2, 1, 2, "zb-v", True, id="pp2-zb-v"),  # the loss (and the carries) on rank 0
    pytest.param(2, 1, 2, "interleaved", True, id="pp2-interleaved"),  # 4 micro-batches per pass
    pytest.param(2, 2, 1, "1f1b", True, id="tp2"),
    pytest.param(2, 1, 1, "1f1b", True, id="dp2"),
    pytest.param(4, 1, 2, "1f1b", True, id="pp2xdp2"),
    pytest.param(2, 1, 2, "1f1b", False, id="pp2-aux-off"),
])
def test_eval_loss_pools_aux_per_eval_batch_as_hf(world: int, tp: int, pp: int, schedule: str, aux: bool,
                                                  moe_dirs: dict, tmp_path: Any) -> None:
    model_dir = moe_dirs[aux]
    want = plain_eval(model_dir, str(tmp_path / "plain"))
    parts = hf_parts(model_dir)
    assert len(set(parts["targets_per_row"])) == 1, parts  # so HF's row-weighted mean of batch means is per token
    if aux:
        assert want == pytest.approx(parts["lm"] + parts["aux"], rel=RTOL)
        # the test can fail: dropping the aux term, or pooling it per micro-batch, is far off
        assert abs(parts["aux"]) > 100 * RTOL * want
        assert abs(parts["aux"] - parts["aux_micro"]) > 100 * RTOL * want, parts
    else:
        assert want == pytest.approx(parts["lm"], rel=RTOL)
    got = run_ranks(_rank, world, model_dir, str(tmp_path / "ds_mp"), ds_json(tp=tp, pp=pp, schedule=schedule),
                    timeout=300)
    assert all(g == got[0] for g in got)
    assert got[0] == pytest.approx(want, rel=RTOL)


class _Chunks:
    """A stream dataset's held-out split in memory: ``n`` rows of ``SEQ_LEN`` token ids (labels = ids)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 6) -> None:
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def num_chunks(self, seq_len: int) -> int:
        return self.ids.shape[0]

    def batch(self, rows: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.ids[torch.as_tensor(rows)]
        return ids, ids.clone()


VAL_ROWS, VAL_SEQ = 7, 16  # micro-batches of 2 rows: the last holds one row beside a filler row


def _held_out_rank(rank: int, model: Any, pp: int, dp: int) -> float:
    import ds_mp
    from ds_mp.data.validation import HeldOutBatches, held_out_loss

    engine, *_ = ds_mp.initialize(model=model, config=ds_config(pp=pp, micro=MICRO, gas=2, seq=VAL_SEQ))
    batches = HeldOutBatches(_Chunks(VAL_ROWS, VAL_SEQ, 203), VAL_SEQ, MICRO, 2, engine.topology.dp_rank, dp)
    return held_out_loss(engine, batches)


@pytest.mark.parametrize("pp, dp", [pytest.param(2, 1, id="pp2"), pytest.param(1, 2, id="dp2")])
def test_launcher_val_loss_adds_aux_per_micro_batch(pp: int, dp: int) -> None:
    """The launcher's ``val_loss`` (``ds_mp.data.validation.held_out_loss``) of a MoE with its aux loss on:
    the per-token LM loss + each held-out micro-batch's ``coef · aux`` (HF's, every token: no mask)
    weighted by its rows; the filler row beside the last real one pools nowhere."""
    model = tiny_moe4(vocab=203)
    ids = _Chunks(VAL_ROWS, VAL_SEQ, 203).ids
    lm = n = aux = 0.0
    for i in range(0, VAL_ROWS, MICRO):
        with torch.no_grad():
            out = model(input_ids=ids[i:i + MICRO], labels=ids[i:i + MICRO])
        rows = ids[i:i + MICRO].shape[0]
        lm, n = lm + float(out.loss - COEF * out.aux_loss) * rows * (VAL_SEQ - 1), n + rows * (VAL_SEQ - 1)
        aux += COEF * float(out.aux_loss) * rows
    want = lm / n + aux / VAL_ROWS
    got = run_ranks(_held_out_rank, 2, tiny_moe4(vocab=203), pp, dp, timeout=300)  # (HF ran forwards on `model`)
    assert got[0] == got[1]
    assert got[0] == pytest.approx(want, rel=RTOL)
