"""The loss slot (``ds_mp.losses``): the per-token LM loss is the first spec, chosen by config, equal
to HF's loss with its per-row values; an unknown loss is refused in one line; and a second spec (a
weighted per-sequence mean of token losses, its row weights an extra tensor of the batch: a toy
stand-in for DPO's reference log-probs and per-sequence normalisation) plugs in by ``register_loss``
alone and trains through the unchanged engine at PP 2 and DP 2 exactly as plain torch on HF's
logits on one process."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from helpers import ds_config, tiny_gpt2

from ds_mp.config import ConfigError, load_config
from ds_mp.losses import IGNORE, LM_LOSS, LossSpec, shift_labels

V, SEQ, ROWS, STEPS, LR = 61, 12, 4, 3, 0.3
STEP_ATOL = 1e-5  # fp32: the same token losses summed in another order


@dataclass(frozen=True)
class SeqMeanLoss(LossSpec):
    """Σ over the global batch's rows of ``row_weight`` × the row's mean token loss, over the number
    of rows with a target: a new ``units`` (rows, not tokens), ``numerator`` and one extra, nothing else."""

    name: str = "seq_mean"
    extras: tuple[str, ...] = ("row_weight",)
    token_sliceable: bool = False

    def units(self, targets: torch.Tensor) -> int:
        return int(((targets != IGNORE).sum(dim=1) > 0).sum())

    def numerator(self, token_losses: torch.Tensor, targets: torch.Tensor, extras: dict) -> torch.Tensor:
        means = token_losses.sum(dim=1) / (targets != IGNORE).sum(dim=1).clamp(min=1)
        return (extras["row_weight"] * means).sum()


def stream() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """STEPS global batches of ROWS rows with prompts of uneven lengths masked (-100), one row per
    step with no target at all (a user's over-long prompt), and a weight per row."""
    g = torch.Generator().manual_seed(7)
    out = []
    for s in range(STEPS):
        ids = torch.randint(0, V, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        for r in range(ROWS):
            labels[r, :int(torch.randint(1, SEQ - 2, (1,), generator=g))] = IGNORE
        labels[s % ROWS] = IGNORE
        out.append((ids, labels, 0.5 + 1.5 * torch.rand(ROWS, generator=g)))
    return out


def oracle(model: torch.nn.Module) -> list[float]:
    """Plain torch on HF's logits, one process: the per-row-mean loss of each global batch, SGD."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids, labels, weight in stream():
        opt.zero_grad()
        targets = shift_labels(labels)
        tok = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), targets.flatten(),
                              ignore_index=IGNORE, reduction="none").view(targets.shape)
        n = (targets != IGNORE).sum(dim=1)
        loss = (weight[n > 0] * tok.sum(dim=1)[n > 0] / n[n > 0]).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _train(rank: int, pp: int, dp: int) -> list[float]:
    import ds_mp
    from ds_mp.config.losses import register_loss

    register_loss("seq_mean", SeqMeanLoss())
    micro, gas = ROWS // (dp * 2), 2
    cfg = ds_config(pp=pp, micro=micro, gas=gas, lr=LR, seq=SEQ, loss={"type": "seq_mean"})
    engine, *_ = ds_mp.initialize(model=tiny_gpt2(n_layer=2, n_embd=32, vocab=V), config=cfg)
    assert isinstance(engine.module.loss_spec, SeqMeanLoss)
    d = engine.topology.dp_rank
    losses = []
    for ids, labels, weight in stream():
        rows = range(d * micro * gas, (d + 1) * micro * gas, micro)  # this replica's own rows
        mbs = [{"input_ids": ids[r:r + micro], "labels": labels[r:r + micro], "row_weight": weight[r:r + micro]}
               for r in rows]
        losses.append(float(engine.train_batch(iter(mbs))))
    with pytest.raises(ValueError, match=r"the loss needs the extras \['row_weight'\]; pass each micro-batch as a"):
        engine.train_batch(iter([(ids[:micro], labels[:micro])] * gas))
    return losses


@pytest.mark.parametrize("pp,dp", [(2, 1), (1, 2)])
def test_a_registered_spec_trains_through_the_engine_as_plain_torch(pp: int, dp: int) -> None:
    want = oracle(tiny_gpt2(n_layer=2, n_embd=32, vocab=V))
    got = run_ranks(_train, 2, pp, dp, timeout=300)
    for losses in got:
        assert losses == pytest.approx(want, abs=STEP_ATOL), (losses, want)
    assert want[0] != pytest.approx(want[1], abs=1e-3)  # the steps trained (not one loss repeated)


def test_the_lm_spec_is_hfs_loss_with_per_row_values() -> None:
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology

    model = tiny_gpt2(n_layer=1, n_embd=32, vocab=V)
    ids, labels, _ = stream()[0]
    with torch.no_grad():
        logits, want = (lambda o: (o.logits, o.loss))(model(input_ids=ids, labels=labels))
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), model.config, False, 1)
    targets = shift_labels(labels)
    count = LM_LOSS.units(targets)
    assert count == int((labels[:, 1:] != IGNORE).sum())
    out = LM_LOSS.bind(ctx)(logits, LM_LOSS.labels(targets, torch.tensor(float(count))))
    assert float(out) == pytest.approx(float(want), abs=1e-6)
    rows = LM_LOSS.row_values(logits, LM_LOSS.labels(targets, torch.tensor(1.0)), ctx)
    assert rows["targets"].tolist() == (targets != IGNORE).sum(dim=1).tolist()
    assert float(rows["loss_sum"].sum() / count) == pytest.approx(float(want), abs=1e-6)
    # the normalisation: D = N / (M · dp), so DeepSpeed's mean over M and dp gives Σ S / N
    assert LM_LOSS.denominators([3, 5], 16, 2, "tokens") == [4.0, 4.0]
    assert LM_LOSS.denominators([3, 0], 16, 2, "micro_batch") == [3.0, 1.0]


def test_the_loss_is_chosen_by_config_and_unknown_ones_are_refused() -> None:
    from ds_mp.config.losses import LOSSES, register_loss

    cfg, _ = load_config(ds_config(), 1)
    assert cfg.loss.type == "lm"
    with pytest.raises(ConfigError, match=r"ds_mp\.loss\.type: unknown loss 'dpoo'; registered: dpo, lm; "
                                          r"did you mean 'dpo'") as err:
        load_config(ds_config(loss={"type": "dpoo"}), 1)
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="LossSpec instance"):
        register_loss("bad", SeqMeanLoss)
    register_loss("seq_mean", SeqMeanLoss())
    try:
        assert load_config(ds_config(pp=2, loss={"type": "seq_mean"}), 2)[0].loss.type == "seq_mean"
        with pytest.raises(ConfigError, match=r"ds_mp\.loss\.type: the 'seq_mean' loss needs whole sequences.*"
                                              r"'terapipe'"):
            load_config(ds_config(pp=2, schedule="terapipe", loss={"type": "seq_mean"}), 2)
    finally:
        LOSSES.pop("seq_mean")


def test_a_micro_batch_carries_the_losses_extras() -> None:
    from ds_mp.models.batch import parse_micro_batch

    ids, labels, weight = stream()[0]
    mb = parse_micro_batch({"input_ids": ids, "labels": labels, "row_weight": weight}, ("row_weight",))
    assert mb.extras["row_weight"] is weight
    with pytest.raises(ValueError, match="dict batch without 'row_weight'"):
        parse_micro_batch({"input_ids": ids, "labels": labels}, ("row_weight",))
    with pytest.raises(ValueError, match="'row_weight' must be a tensor with one row per sequence"):
        parse_micro_batch({"input_ids": ids, "labels": labels, "row_weight": weight[:1]}, ("row_weight",))
    with pytest.raises(ValueError, match="key 'row_weight' is not used by ds_mp"):  # the LM loss reads none
        parse_micro_batch({"input_ids": ids, "labels": labels, "row_weight": weight})
    spec = SeqMeanLoss()
    sliced = spec.token_slice(spec.labels(shift_labels(labels), torch.tensor(2.0), {"row_weight": weight}),
                              slice(1, 3), slice(0, 5))
    assert sliced[0].shape == (2, 5) and float(sliced[1]) == 2.0 and torch.equal(sliced[2], weight[1:3])


def test_a_buffers_micro_batch_identity_travels_with_it() -> None:
    from ds_mp.engine.batches import MicroBook

    book = MicroBook()
    book.load(0), book.load(1), book.receive(1), book.receive(0)  # buffers 0, 1: micro-batches 0, 1 / 1, 0
    book.forward(0, first_stage=True), book.forward(1, first_stage=False)
    assert (book.micro_of(0), book.micro_of(1)) == (0, 0)
    book.load(1, micro=5)  # a schedule placing micro-batch 5's labels itself (ZB-V)
    assert book.loaded[1] == 5 and book.n_loaded == 2
    book.start()
    assert not book.loaded and not book.received and book.n_loaded == book.n_received == 0
    assert book.micro_of(0) == 0  # what a buffer's forward ran stays until it runs again (its backward)
