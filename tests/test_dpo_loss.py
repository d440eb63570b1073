"""The DPO loss spec (``ds_mp.losses.dpo``) against TRL 1.16's own loss code: ``DPOTrainer._compute_loss``
on HF models with TRL's fused LM head (tests/dpo_utils.trl_loss), on the same pairs of very uneven
lengths with one pair truncated at ``max_length``; each loss type, ``loss_weights`` mixing with
``sft``, TRL's logged metrics from the spec's rows, the gradient; and the ``"loss"`` block's options
and refusals."""
from __future__ import annotations

import copy

import pytest
import torch

from dpo_utils import collate, labels_of, pairs, row_logps, trl_loss
from helpers import ds_config, tiny_gpt2

from ds_mp.config import ConfigError, load_config
from ds_mp.losses import shift_labels

V = 61
CASES = [dict(loss_type=("sigmoid",)), dict(loss_type=("ipo",), beta=0.5), dict(loss_type=("hinge",)),
         dict(loss_type=("robust",), label_smoothing=0.2),
         dict(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5))]


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A policy and a reference that differs from it (the reference's weights perturbed)."""
    ref = tiny_gpt2(n_layer=2, n_embd=32, vocab=V, seed=3)
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref


def batch() -> dict[str, torch.Tensor]:
    """Four pairs of very uneven lengths, one truncated at max_length (its completion cut)."""
    ex = pairs(4, V, seed=1)
    ex[2]["chosen_ids"] = list(range(1, 40))  # prompt + chosen > max_length: cut, keep_start
    return collate(ex, max_length=24)


@pytest.mark.parametrize("opts", CASES, ids=lambda o: "+".join(o["loss_type"]))
def test_the_spec_is_trls_loss_metrics_and_gradient(opts: dict) -> None:
    from ds_mp.config.losses import configured_loss
    from ds_mp.losses.dpo import dpo_metrics
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology

    policy, ref = models()
    b = batch()
    assert b["completion_mask"][2].sum() < 39  # the truncated pair really was cut
    want, want_metrics, _ = trl_loss(policy, ref, b, **opts)

    cfg, _ = load_config(ds_config(loss={"type": "dpo", **{k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in opts.items()}}), 1)
    spec = configured_loss(cfg.loss)
    assert spec.loss_type == opts["loss_type"] and spec.beta == opts.get("beta", 0.1)
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), policy.config, False, 1)
    policy.train()
    targets = shift_labels(labels_of(b))
    extras = {"ref_logps": row_logps(ref, b)}
    pairs_n = spec.units(targets)
    assert pairs_n == 4
    logits = policy(input_ids=b["input_ids"]).logits  # no attention mask: right padding changes nothing
    record: list = []
    got = spec.micro_loss(logits, spec.labels(targets, torch.tensor(float(pairs_n)), extras), ctx, record)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-7)
    metrics = dpo_metrics(record[0], spec.beta)
    for key, value in metrics.items():
        assert value == pytest.approx(want_metrics[key], abs=1e-5), key  # the bound (fp32 sums)


def test_the_gradient_is_trls() -> None:
    """TRL's gradient on its policy copy equals the spec's (sigmoid + sft, the two paths that differ)."""
    from ds_mp.losses.dpo import DPO_LOSS
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology

    policy, ref = models()
    b = batch()
    spec = DPO_LOSS.with_options(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3])
    want, _, trl_policy = trl_loss(policy, ref, b, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.3))
    want.backward()
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), policy.config, False, 1)
    policy.train()
    targets = shift_labels(labels_of(b))
    got = spec.micro_loss(policy(input_ids=b["input_ids"]).logits,
                          spec.labels(targets, torch.tensor(4.0), {"ref_logps": row_logps(ref, b)}), ctx)
    got.backward()
    for (name, p), q in zip(policy.named_parameters(), trl_policy.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_loss_blocks_options_and_refusals() -> None:
    from ds_mp.config.losses import configured_loss

    cfg, _ = load_config(ds_config(loss={"type": "dpo", "beta": 0.3, "loss_type": "hinge"}), 1)
    spec = configured_loss(cfg.loss)
    assert (spec.beta, spec.loss_type, spec.loss_weights, spec.extras) == (0.3, ("hinge",), None, ("ref_logps",))
    bad = [({"beta": 0}, r"ds_mp\.loss\.beta: expected a number > 0"),
           ({"bta": 0.1}, r"ds_mp\.loss\.bta: unknown key for the 'dpo' loss; known keys: .*beta"),
           ({"loss_type": ["sigmoid", "aot"]}, r"ds_mp\.loss\.loss_type: 'aot' is not supported under ds_mp"),
           ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
            r"ds_mp\.loss\.loss_weights: expected 2 numbers"),
           ({"label_smoothing": 0.5}, r"ds_mp\.loss\.label_smoothing: expected a number in \[0, 0\.5\)"),
           ({"f_divergence_type": "js_divergence"}, r"ds_mp\.loss\.f_divergence_type: 'js_divergence' is not"),
           ({"ld_alpha": 0.5}, r"ds_mp\.loss\.ld_alpha: 0\.5 is not supported"),
           ({"use_weighting": True}, r"ds_mp\.loss\.use_weighting: True is not supported"),
           ({"sync_ref_model": True}, r"ds_mp\.loss\.sync_ref_model"),
           ({"padding_free": True}, r"ds_mp\.loss\.padding_free")]
    for opts, msg in bad:
        with pytest.raises(ConfigError, match=msg) as err:
            load_config(ds_config(loss={"type": "dpo", **opts}), 1)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"ds_mp\.loss\.beta: unknown key for the 'lm' loss"):
        load_config(ds_config(loss={"beta": 0.1}), 1)
    for schedule, msg in (("terapipe", "needs whole sequences"), ("ouroboros", "'ouroboros' is not supported")):
        with pytest.raises(ConfigError, match=msg):
            load_config(ds_config(pp=2, schedule=schedule, loss={"type": "dpo"}), 2)
    with pytest.raises(ValueError, match="even number per micro-batch; got 3"):
        spec.units(torch.zeros(3, 4, dtype=torch.long))


def test_a_padding_pair_counts_nothing() -> None:
    """A short batch padded per half (a pair whose rows are all -100, as the Trainer pads its last
    micro-batch): 0 units, 0 added, left out of the metrics -- the loss and metrics of the real pairs,
    as TRL computes them on the batch without it."""
    from ds_mp.losses.dpo import DPO_LOSS, dpo_metrics
    from ds_mp.models.ctx import Ctx
    from ds_mp.topology import Topology

    policy, ref = models()
    b = batch()
    want, want_metrics, _ = trl_loss(policy, ref, b)
    n = b["input_ids"].shape[0] // 2
    padded = {k: torch.cat([v[:n], torch.zeros_like(v[:1]), v[n:], torch.zeros_like(v[:1])]) for k, v in b.items()}
    targets = shift_labels(labels_of(padded))
    assert DPO_LOSS.units(targets) == 4 and targets[n].eq(-100).all()
    ctx = Ctx(Topology(tp=1, pp=1, dp=1, rank=0), policy.config, False, 1)
    record: list = []
    with torch.no_grad():
        got = DPO_LOSS.micro_loss(policy(input_ids=padded["input_ids"]).logits,
                                  DPO_LOSS.labels(targets, torch.tensor(4.0), {"ref_logps": row_logps(ref, padded)}),
                                  ctx, record)
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-6)
    for key, value in dpo_metrics(record[0], 0.1).items():
        assert value == pytest.approx(want_metrics[key], abs=1e-5), key
