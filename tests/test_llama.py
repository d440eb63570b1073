"""The Llama family (Llama, Qwen2, Mistral) equals the unmodified HF model at TP, PP and TP × PP
(with tests/test_combinations.py's Llama-family rows: TP = 2, PP = 2, DP, 1f1b/gpipe/TeraPipe, ZeRO-1).

Awkward sizes: hidden 96, 6 heads (head dim 16) with 2 or 3 key/value heads, intermediate 200
(204 at TP=3: the MLP splits in equal blocks, and TP=3 with 200 is refused at config time), vocab
1003 (padded per TP).  Key/value heads split when TP divides them (TP=2 with 2, TP=3 with 3)
and replicated with their gradient summed over TP when it does not (TP=3 with 2 KV heads).  The
oracle is HF's own ``…ForCausalLM`` trained single-process with torch SGD and
``clip_grad_norm_`` (active: the step-1 norm is about 2): every step's loss and every final weight
(fp32, also under ZeRO-1); bf16 within :data:`BF16_TOL` of HF's fp32 losses.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_ranks
from helpers import batches, ds_config, step_loss
from test_tensor_parallel import gather_weights, hf_train, max_diff

VOCAB, SEQ, LR, TOL, CLIP = 1003, 16, 0.1, 2e-5, 1.0
BF16_TOL = 1e-3  # relative, bf16 losses against HF's fp32 ones (measured 2.6e-5 on the bf16 case, TP2 x PP2)


def tiny_llama(kind: str = "llama", kv: int = 2, tied: bool = False, n_layer: int = 2, seed: int = 0,
               pad: int | None = None, inner: int = 200, hidden: int = 96, vocab: int = VOCAB):
    """A tiny HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (q/k/v biases) / ``MistralForCausalLM``, 6 heads."""
    import transformers

    torch.manual_seed(seed)
    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    cfg = getattr(transformers, names + "Config")(
        hidden_size=hidden, intermediate_size=inner, num_hidden_layers=n_layer, num_attention_heads=6,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tied,
        bos_token_id=0, eos_token_id=0, pad_token_id=pad, rms_norm_eps=1e-5)
    model = getattr(transformers, names + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # RMSNorm weights and biases away from their init, so a wrong cut shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def steps_for(n_steps: int = 2, micro_batches: int = 2, seq: int = SEQ) -> list[list]:
    out = []
    for i in range(n_steps):
        mbs = batches(micro_batches, 2, seq, VOCAB, seed=7 + i)
        mbs[0][1][0, :3] = -100  # some ignored labels
        out.append(mbs)
    return out


def _train(rank: int, model, steps: list[list], cfg: dict) -> tuple[list[float], dict]:
    import ds_mp

    engine, *_ = ds_mp.initialize(model=copy.deepcopy(model), config=cfg)
    losses = [float(engine.train_batch(iter(mbs))) for mbs in steps]
    weights, _ = gather_weights(engine)
    return losses, weights


def _assert_trains_as_hf(results: list, want_losses: list[float], want: dict) -> None:
    """Every rank's losses and the weights gathered over the ranks equal HF's (fp32, :data:`TOL`)."""
    got: dict = {}
    for losses, weights in results:
        got.update(weights)
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
    assert set(got) == set(want), set(got) ^ set(want)
    assert max_diff(got, want) < TOL


# (family, kv heads, tied, tp, pp, sequence parallel, wrapper): the KV cut, both head kinds, biases, SP,
# DeepSpeed's ZeRO-1 and bf16 optimizers.  TP = 2 with the KV heads split and TP x PP = 2 x 2 with an
# untied head (and with every schedule, DP and ZeRO-1) are rows of tests/test_combinations.py (MODELS).
CASES = [
    ("qwen2", 2, True, 3, 1, False, "zero1"),    # KV heads replicated (2 over TP=3), q/k/v biases, tied head
    ("mistral", 3, False, 3, 1, True, "fp32"),   # KV heads split (3 over TP=3), sequence parallelism
    ("llama", 3, True, 2, 2, True, "fp32"),      # TP x PP = 2 x 2 with the tied head, KV replicated (3 over 2), SP
    ("qwen2", 2, True, 2, 2, False, "bf16"),     # bf16 at TP x PP = 2 x 2 against HF's fp32 losses
]


def _case_id(c: tuple) -> str:
    return f"{c[0]}_kv{c[1]}_{'tied' if c[2] else 'untied'}_tp{c[3]}pp{c[4]}{'_sp' if c[5] else ''}_{c[6]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_equals_hf(case: tuple) -> None:
    kind, kv, tied, tp, pp, sp, wrapper = case
    seq = 18 if sp and tp == 3 else SEQ  # SP splits the sequence evenly over TP
    model, steps = tiny_llama(kind, kv, tied, inner=200 if tp != 3 else 204), steps_for(seq=seq)
    want_losses, _, want = hf_train(model, steps, lr=LR, clip=CLIP)
    extra = {"tensor_parallel": {"sequence_parallel": True}} if sp else {}
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, clip=CLIP, seq=seq, **extra)
    if wrapper == "zero1":
        cfg.update(zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    if wrapper == "bf16":
        cfg["bf16"] = {"enabled": True}
    results = run_ranks(_train, tp * pp, model, steps, cfg, timeout=600)
    if wrapper != "bf16":
        _assert_trains_as_hf(results, want_losses, want)
        return
    for losses, weights in results:
        assert losses == pytest.approx(want_losses, rel=BF16_TOL) and losses[1] < losses[0], (losses, want_losses)
    assert set().union(*(w for _, w in results)) == set(want)


def test_tables_cover_hf_models() -> None:
    """``param_shapes`` is exactly HF's state dict (names and shapes, tied head omitted), every name has a
    TP kind and a layer, and the layer table's two directions agree."""
    from ds_mp.models.family import family_of

    for kind, tied in (("llama", False), ("qwen2", True), ("mistral", False)):
        model = tiny_llama(kind, 2, tied, n_layer=3)
        fam, cfg = family_of(model.config), model.config
        sd = {n: tuple(t.shape) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
        assert fam.param_shapes(cfg) == sd
        layers = fam.pipeline_layers(cfg)
        for name in sd:
            assert fam.tp_kind(name) in ("vocab", "replicated", "linear_out", "linear_in", "kv")
            assert 0 <= fam.layer_index(name, layers) < len(layers)


@pytest.mark.parametrize("size", [2, 3])
def test_kv_cut_round_trip(size: int) -> None:
    """``kv`` splits by key/value heads when ``size`` divides them, else every rank holds them all."""
    from ds_mp.tensor_parallel.sharding import shard, shard_ranges, unshard

    for kv in (2, 3, 6):
        full = torch.randn(kv * 16, 96)
        parts = [shard(full, "kv", r, size, n_head=kv) for r in range(size)]
        assert torch.equal(unshard(parts, "kv", n_head=kv), full)
        split = kv % size == 0
        assert all(p.shape[0] == (kv // size * 16 if split else kv * 16) for p in parts)
        dim, ranges, _ = shard_ranges("kv", 1, size, tuple(full.shape), n_head=kv)
        assert dim == 0 and ranges == ([(kv // size * 16, 2 * kv // size * 16)] if split else [(0, kv * 16)])


# (family, kv heads, tied, tp, pp, sequence parallel): TeraPipe token slices 6 + 10, activation checkpointing
TERAPIPE = [
    ("qwen2", 2, True, 1, 2, False),   # a slice's rotary positions are its offsets; the cache holds 2 KV heads
    ("llama", 3, False, 2, 2, True),   # TP x PP = 2 x 2, KV heads replicated (3 over 2) in the cache, SP
]


@pytest.mark.parametrize("case", TERAPIPE, ids=lambda c: _case_id((*c, "terapipe")))
def test_terapipe_equals_hf(case: tuple) -> None:
    kind, kv, tied, tp, pp, sp = case
    model, steps = tiny_llama(kind, kv, tied), steps_for()
    want_losses, _, want = hf_train(model, steps, lr=LR, clip=CLIP)
    extra: dict = {"terapipe": {"slices": [6, 10]}, "pipeline": {"activation_checkpoint_interval": 1}}
    if sp:
        extra["tensor_parallel"] = {"sequence_parallel": True}
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, schedule="terapipe", **extra)
    _assert_trains_as_hf(run_ranks(_train, tp * pp, model, steps, cfg, timeout=600), want_losses, want)


def test_pad_token_row_gets_no_gradient_as_in_hf() -> None:
    """HF's embedding has ``padding_idx = pad_token_id`` (that row never changes); so does ds_mp's (TP=2)."""
    steps = steps_for()
    pad = int(steps[0][0][0][0, 0])  # a token the batches contain
    model = tiny_llama("llama", 2, False, pad=pad)
    want_losses, _, want = hf_train(model, steps, lr=LR)
    results = run_ranks(_train, 2, model, steps, ds_config(tp=2, micro=2, gas=2, lr=LR, seq=SEQ), timeout=600)
    got = {**results[0][1], **results[1][1]}
    row = "model.embed_tokens.weight"
    assert torch.equal(want[row][pad], model.state_dict()[row][pad])  # the oracle keeps it
    assert max_diff(got, want) < TOL and torch.equal(got[row][pad], want[row][pad])


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_zero_bubble_equals_hf(tp: int, pp: int) -> None:
    """zb-h1 (backward split into input and weight gradients): Qwen2 with its KV heads replicated at TP=2
    (3 over 2: the copy_to_tp on k/v weights runs in the deferred weight pass), clipping on."""
    model, steps = tiny_llama("qwen2", 3, False), steps_for()
    want_losses, _, want = hf_train(model, steps, lr=LR, clip=CLIP)
    cfg = ds_config(tp=tp, pp=pp, micro=2, gas=2, lr=LR, clip=CLIP, seq=SEQ, schedule="zb-h1")
    _assert_trains_as_hf(run_ranks(_train, tp * pp, model, steps, cfg, timeout=600), want_losses, want)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_cost_profile_measures_the_family_layers(tied: bool) -> None:
    """``"partition": "cost"`` times the Llama table's own lead (embed_tokens), block and tail (norm, head,
    loss) layers; the split puts the 1 lead layer on stage 0 and the 2 tail layers on the last stage."""
    from ds_mp.models.cost_profile import measure_layer_costs
    from ds_mp.models.family import family_of
    from ds_mp.models.partition import stage_parts
    from ds_mp.models.weights import WeightSource
    from ds_mp.topology import Topology

    model = tiny_llama("llama", 2, tied, n_layer=4)
    costs = measure_layer_costs(WeightSource.from_model(model), Topology(tp=1, pp=1, dp=1, rank=0), rows=2,
                                seq=SEQ, dtype=torch.float32, device=torch.device("cpu"), rounds=2, warmup=1)
    assert min(vars(costs).values()) > 0, costs
    fam = family_of(model.config)
    parts = stage_parts(4, 2, [1, 3], 96, VOCAB, lead=fam.lead_layers, tail=fam.tail_layers)
    table = fam.pipeline_layers(model.config)
    assert parts == [0, 2, 7] and table[:2] == ["embed_tokens", "layers.0"] and table[2:7][-2:] == ["norm", "lm_head"]


INLINE = {"model_type": "qwen2", "n_layer": 2, "n_embd": 96, "n_head": 6, "n_kv_head": 2, "intermediate_size": 200,
          "vocab_size": VOCAB, "n_positions": 64, "tie_word_embeddings": False}


def _fresh_inline(rank: int, steps: list) -> tuple[dict, list[float]]:
    """An inline Qwen2 shape at TP=2 x PP=2, no checkpoint: its full weights and one step's loss;
    no rank builds the whole HF model."""
    import transformers

    import ds_mp
    from ds_mp.checkpoint.hf import full_state_dict

    def refuse(*_a, **_k):
        raise AssertionError("a fresh model must not be built whole (Qwen2ForCausalLM constructed)")

    transformers.Qwen2ForCausalLM.__init__ = refuse
    engine, *_ = ds_mp.initialize(config=ds_config(tp=2, pp=2, micro=2, gas=2, lr=LR, seq=SEQ, model=INLINE,
                                                   training={"seed": 5}))
    weights = full_state_dict(engine)
    return weights, [float(engine.train_batch(iter(mbs))) for mbs in steps]


def test_inline_shape_draws_the_family_init_layout_free() -> None:
    """``"model": {"model_type": "qwen2", ...}`` without a checkpoint: the weights drawn shard by shard at
    TP=2 x PP=2 equal the layout-free full draws (``fresh_source``) bit for bit, have exactly HF
    ``Qwen2ForCausalLM``'s names and shapes and HF's init (N(0, initializer_range) weights, zero
    biases, unit RMSNorm weights), and the first loss equals HF's model loaded with them."""
    from transformers import Qwen2ForCausalLM

    from ds_mp.config import InlineModel
    from ds_mp.models.family import inline_config
    from ds_mp.models.weights import fresh_source

    steps = steps_for(n_steps=1)
    got, losses = run_ranks(_fresh_inline, 4, steps, timeout=600)[0]
    cfg = inline_config(InlineModel(**INLINE))
    hf = Qwen2ForCausalLM(cfg)
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    src = fresh_source(cfg, 5)
    assert all(torch.equal(t, src.get(n)) for n, t in got.items())
    std = cfg.initializer_range
    for name, t in got.items():
        if name.endswith(".bias"):
            assert float(t.abs().max()) == 0.0, name
        elif name.endswith("norm.weight"):
            assert float(t.min()) == float(t.max()) == 1.0, name
        elif t.numel() > 10000:  # HF draws these N(0, initializer_range) too
            assert abs(float(t.std()) - std) < 0.05 * std and abs(float(t.mean())) < 0.1 * std, name
    hf.load_state_dict(got)
    hf.train()
    want = step_loss(hf, steps[0])
    assert abs(losses[0] - want) < TOL, (losses, want)
