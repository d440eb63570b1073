"""Checkpoints: HF ⇄ sharded at any TP × PP bit-exact, clear refusals of bad inputs,
loading an HF directory through ``ds_mp.initialize``, ``save_hf`` from a trained engine,
and resharded resume (2×2 -> 1×1 and 1×4) equal to an uninterrupted run.

Awkward sizes: vocab 203 (padded to 256 at TP 2, 384 at TP 3), 6 heads at TP 3.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_ranks
from ds_mp.checkpoint import CheckpointError, ShardedReader, atomic_dir, convert_cli, directory_source
from ds_mp.checkpoint.convert import ds_to_hf, hf_to_ds
from ds_mp.checkpoint.hf import copy_tokenizer
from helpers import batches, ds_config, hf_reference, tiny_gpt2

VOCAB, TOL = 203, 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("hf") / "tiny")
    tiny_gpt2(vocab=VOCAB).save_pretrained(path)
    return path


def hf_state(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


# ----------------------------------------------------------------------------- conversion
def test_hf_to_ds_to_hf_tp2_pp2_is_bit_exact(hf_dir, tmp_path):
    ds, back = str(tmp_path / "ds"), str(tmp_path / "back")
    assert convert_cli(["hf-to-ds", hf_dir, ds, "--tp", "2", "--pp", "2"]) == 0
    meta = json.load(open(os.path.join(ds, "ds_mp_meta.json")))
    assert (meta["tp"], meta["pp"], meta["vocab_size"], meta["padded_vocab"]) == (2, 2, VOCAB, 256)
    assert sorted(f for f in os.listdir(ds) if f.endswith(".safetensors")) == [
        f"model-pp{s:02d}-tp{r:02d}.safetensors" for s in range(2) for r in range(2)]
    assert load_file(os.path.join(ds, "model-pp00-tp01.safetensors"))["transformer.wte.weight"].shape == (128, 48)
    assert convert_cli(["ds-to-hf", ds, back]) == 0
    src, out = hf_state(hf_dir), hf_state(back)
    assert src.keys() == out.keys() and "lm_head.weight" not in out  # tied: written as HF does
    assert all(torch.equal(src[k], out[k]) for k in src)
    from transformers import GPT2LMHeadModel
    ids = torch.arange(12).view(2, 6)
    a, b = GPT2LMHeadModel.from_pretrained(hf_dir), GPT2LMHeadModel.from_pretrained(back)
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_tp3_awkward_vocab_and_resharding(tmp_path):
    hf = str(tmp_path / "hf")
    tiny_gpt2(n_head=6, vocab=VOCAB, n_layer=4).save_pretrained(hf)
    tp3, tp2pp4, back = (str(tmp_path / n) for n in ("tp3", "tp2pp4", "back"))
    hf_to_ds(hf, tp3, tp=3, pp=1)
    reader = ShardedReader(tp3)
    assert reader.meta["padded_vocab"] == 384
    assert load_file(os.path.join(tp3, "model-pp00-tp02.safetensors"))["transformer.h.0.attn.c_attn.weight"].shape \
        == (48, 48)  # q, k, v of 2 heads × 8 dims
    hf_to_ds(tp3, tp2pp4, tp=2, pp=4)  # sharded -> sharded: reshard without going through HF
    ds_to_hf(tp2pp4, back)
    src, out = hf_state(hf), hf_state(back)
    assert all(torch.equal(src[k], out[k]) for k in src)


def test_source_accepts_unprefixed_names_bin_and_index(hf_dir, tmp_path):
    ref = hf_state(hf_dir)
    cfg = open(os.path.join(hf_dir, "config.json")).read()
    bare, binary = tmp_path / "bare", tmp_path / "bin"
    for d in (bare, binary):
        d.mkdir()
        (d / "config.json").write_text(cfg)
    old = {k.removeprefix("transformer."): v for k, v in ref.items()}
    old.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 64, 64)) for i in range(4)})  # legacy buffers
    save_file(old, str(bare / "model.safetensors"))
    torch.save({**ref, "lm_head.weight": ref["transformer.wte.weight"]}, str(binary / "pytorch_model.bin"))
    index = str(tmp_path / "index")
    tiny_gpt2(vocab=VOCAB).save_pretrained(index, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(index, "model.safetensors.index.json"))
    for path in (str(bare), str(binary), index):
        src = directory_source(path)
        for name in ("transformer.h.3.mlp.c_fc.weight", "wte.weight"):
            assert torch.equal(src.get(name), ref["transformer." + name.removeprefix("transformer.")])


def _refused(path: str, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as e:
        directory_source(path)
    msg = str(e.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_corrupt_and_mismatched_checkpoints_are_refused(hf_dir, tmp_path):
    import shutil

    def copy(name: str) -> str:
        return shutil.copytree(hf_dir, str(tmp_path / name))

    trunc = copy("trunc")
    with open(os.path.join(trunc, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    _refused(trunc, "model.safetensors", "truncated")
    wide = copy("wide")  # config says n_embd 64, weights are 48 wide
    cfg = json.load(open(os.path.join(wide, "config.json")))
    json.dump({**cfg, "n_embd": 64}, open(os.path.join(wide, "config.json"), "w"))
    _refused(wide, "transformer.wte.weight", "shape [203, 48]", "[203, 64]")
    deep = copy("deep")
    json.dump({**cfg, "n_layer": 5}, open(os.path.join(deep, "config.json"), "w"))
    _refused(deep, "missing tensors", "transformer.h.4")
    extra = copy("extra")
    save_file({**hf_state(hf_dir), "transformer.h.0.attn.q_proj.weight": torch.zeros(2)},
              os.path.join(extra, "model.safetensors"))
    _refused(extra, "unexpected tensors", "q_proj")
    bert = copy("bert")
    json.dump({**cfg, "model_type": "bert"}, open(os.path.join(bert, "config.json"), "w"))
    _refused(bert, "'bert'", "GPT-2")
    _refused(str(tmp_path / "nowhere"), "not a directory")
    os.remove(os.path.join(copy("noweights"), "model.safetensors"))
    _refused(str(tmp_path / "noweights"), "no model.safetensors")
    ds = str(tmp_path / "ds")  # a damaged shard of a sharded checkpoint names that file
    hf_to_ds(hf_dir, ds, tp=2, pp=2, verify=False)
    with open(os.path.join(ds, "model-pp01-tp01.safetensors"), "r+b") as f:
        f.truncate(100)
    _refused(ds, "model-pp01-tp01.safetensors")


def test_cli_errors_and_atomic_writes(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert convert_cli(["hf-to-ds", hf_dir, out, "--tp", "3"]) == 1  # 4 heads
    assert "--tp 3 does not divide n_head=4" in capsys.readouterr().err
    assert convert_cli(["hf-to-ds", hf_dir, out, "--pp", "2", "--partition", "cost"]) == 1
    assert "--partition cost is measured when training starts" in capsys.readouterr().err
    assert convert_cli(["hf-to-ds", hf_dir, out, "--pp", "2", "--partition", "1,2"]) == 1
    assert "--partition 1,2: need 2 block counts summing to n_layer=4" in capsys.readouterr().err
    assert not os.path.exists(out) and os.listdir(tmp_path) == []
    listed = str(tmp_path / "listed")  # a "cost" run's blocks per stage, given as a list
    assert convert_cli(["hf-to-ds", hf_dir, listed, "--pp", "2", "--partition", "3,1", "--no-verify"]) == 0
    assert json.load(open(os.path.join(listed, "ds_mp_meta.json")))["parts"] == [0, 5, 8]
    shutil.rmtree(listed)
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        open(os.path.join(tmp, "half"), "w").write("x")
        raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []  # neither OUT nor the temporary directory remains
    assert convert_cli(["hf-to-ds", hf_dir, out, "--no-verify"]) == 0
    assert convert_cli(["hf-to-ds", hf_dir, out]) == 1 and "already exists" in capsys.readouterr().err
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    copy_tokenizer(str(tok), out)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_training_checkpoint_refusals(tmp_path):
    """Bad tags, missing ``latest``, and the DeepSpeed-format bf16/ZeRO checkpoints of older
    ds_mp (bf16/ZeRO now save the layout-free format: tests/test_real_sizes.py)."""
    import json
    from types import SimpleNamespace

    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    class BF16_Optimizer:  # stands in for DeepSpeed's wrapper (not a torch optimizer)
        pass

    bf16_engine = SimpleNamespace(optimizer=BF16_Optimizer(), topology=SimpleNamespace(tp=1, pp=1, dp=1, rank=0))
    with pytest.raises(CheckpointError, match="plain name"):
        save_checkpoint(bf16_engine, str(tmp_path), "a/b")
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        load_checkpoint(SimpleNamespace(optimizer=None, topology=None), str(tmp_path))
    native = tmp_path / "native"
    native.mkdir()
    (native / "ds_mp_native.json").write_text(json.dumps({"tp": 2, "pp": 2, "dp": 1}))
    with pytest.raises(CheckpointError, match="DeepSpeed-format bf16/ZeRO checkpoint of an older ds_mp"):
        load_checkpoint(bf16_engine, str(tmp_path), "native")


# ----------------------------------------------------------------------------- engines
def steps_of(n_steps: int, gas: int = 2, seed: int = 1) -> list[list]:
    mbs = batches(n_steps * gas, 2, 16, VOCAB, seed=seed)
    return [mbs[i * gas:(i + 1) * gas] for i in range(n_steps)]


ADAM_EPS = 1e-3  # comparable to the gradients: the export is compared with HF's weights (below)


def adam_config(tp: int, pp: int) -> dict:
    cfg = ds_config(tp=tp, pp=pp, optimizer="Adam", lr=0.01)
    cfg["optimizer"]["params"].update(weight_decay=0.0, eps=ADAM_EPS)  # torch_adam builds AdamW: make it Adam
    return cfg


def _tp2_from_dir_then_save_hf(rank: int, hf: str, out: str, steps: list) -> list[float]:
    import ds_mp

    engine, *_ = ds_mp.initialize(model=hf, config=ds_config(tp=2))
    losses = [float(engine.train_batch(iter(s))) for s in steps]
    ds_mp.save_hf(engine, out)
    return losses


def test_initialize_from_dir_tp2_and_save_hf(hf_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    steps, out = steps_of(2), str(tmp_path / "export")
    losses = run_ranks(_tp2_from_dir_then_save_hf, 2, hf_dir, out, steps, timeout=180)
    ref_losses, ref = hf_reference(GPT2LMHeadModel.from_pretrained(hf_dir), steps)
    assert losses[0] == losses[1] and max(abs(a - b) for a, b in zip(losses[0], ref_losses)) < TOL
    exported = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.arange(20).view(2, 10) * 7 % VOCAB
    with torch.no_grad():
        assert (exported(input_ids=ids).logits - ref.eval()(input_ids=ids).logits).abs().max() < TOL
    gen = exported.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 9)


def _run_phase(rank: int, tp: int, pp: int, model: str, root: str, steps: list, resume: bool, export: str) -> dict:
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint, save_checkpoint

    engine, *_ = ds_mp.initialize(model=model, config=adam_config(tp, pp))
    before = [p.detach().clone() for p in engine.module.parameters()]
    client = load_checkpoint(engine, root) if resume else None
    moved = max(float((a - p).abs().max()) for a, p in zip(before, engine.module.parameters()))
    losses = []
    for i, s in enumerate(steps):
        losses.append(float(engine.train_batch(iter(s))))
        if not resume and i == 1:
            save_checkpoint(engine, root, "step2", {"sampler": 4, "rng": torch.get_rng_state()})
    if export:
        ds_mp.save_hf(engine, export)
    return {"losses": losses, "client": client and client["sampler"], "steps": engine.global_steps, "moved": moved}


def test_resharded_resume_equals_uninterrupted(hf_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    steps, root, export = steps_of(4), str(tmp_path / "ckpt"), str(tmp_path / "export")
    full = run_ranks(_run_phase, 4, 2, 2, hf_dir, root, steps, False, export, timeout=240)
    assert open(os.path.join(root, "latest")).read().strip() == "step2"
    assert not any(n.endswith(".tmp") for n in os.listdir(root))
    ref_losses, ref = hf_reference(GPT2LMHeadModel.from_pretrained(hf_dir), steps, lr=0.01, optimizer="Adam",
                                   eps=ADAM_EPS)
    uninterrupted = full[-1]["losses"]  # the last stage computes the loss
    assert max(abs(a - b) for a, b in zip(uninterrupted, ref_losses)) < TOL
    ids = torch.arange(20).view(2, 10) * 7 % VOCAB
    with torch.no_grad():  # save_hf at TP 2 × PP 2 after 4 Adam steps; eps = ADAM_EPS keeps Adam from
        # turning the layouts' rounding differences into ±lr steps (test_ouroboros.ADAM_ATOL): fp32's TOL
        got = GPT2LMHeadModel.from_pretrained(export).eval()(input_ids=ids).logits
        assert (got - ref.eval()(input_ids=ids).logits).abs().max() < TOL
    ckpt = os.path.join(root, "step2")  # 1×4 also initialises from the 2×2 shards (merged on the fly)
    for tp, pp, n, init in ((1, 1, 1, hf_dir), (1, 4, 4, ckpt)):
        res = run_ranks(_run_phase, n, tp, pp, init, root, steps[2:], True, "", timeout=240)[-1]
        assert res["client"] == 4 and res["steps"] == 4 and (res["moved"] > 0) == (init == hf_dir)
        assert max(abs(a - b) for a, b in zip(res["losses"], uninterrupted[2:])) < TOL, (tp, pp, res)
