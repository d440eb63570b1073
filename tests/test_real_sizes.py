"""Issue 16, "Real sizes": no rank builds or reads the whole model.

* A fresh model is drawn per parameter name and row block: the same seed gives the same
  full weights at TP×PP = 1×1 and 2×2 (bit-exact), GPT-2's init distribution, and no rank
  constructs a ``GPT2LMHeadModel``.
* Readers return one TP shard through safetensors slices, exactly ``shard(full)``, and read
  no more elements than the shard holds (HF dirs, sharded dirs saved at another TP,
  optimizer state); ``pytorch_model.bin`` falls back to a full read.
* Building at TP=2 × PP=2 from an HF dir asks the source for no full non-replicated tensor.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from dist_utils import run_ranks
from ds_mp.checkpoint.convert import hf_to_ds
from ds_mp.checkpoint.hf import HFReader
from ds_mp.checkpoint.sharded import ShardedReader
from ds_mp.models.gpt2 import param_shapes, tp_kind
from ds_mp.optim.init import fresh_source, init_gpt2_weights
from ds_mp.tensor_parallel.sharding import padded_vocab_size, shard, shard_ranges
from helpers import ds_config, tiny_gpt2

SHAPE = {"n_layer": 4, "n_embd": 48, "n_head": 4, "vocab_size": 203, "n_positions": 64, "dropout": 0.0}


def _fresh_full(rank: int, tp: int, pp: int, seed: int) -> dict:
    import transformers

    import ds_mp
    from ds_mp.checkpoint.hf import full_state_dict

    def refuse(*_a, **_k):
        raise AssertionError("a fresh model must not be built whole (GPT2LMHeadModel constructed)")

    transformers.GPT2LMHeadModel.__init__ = refuse
    engine, *_ = ds_mp.initialize(config=ds_config(tp=tp, pp=pp, model=SHAPE, training={"seed": seed}))
    return full_state_dict(engine)


def test_fresh_model_is_layout_free_and_gpt2_init():
    one = run_ranks(_fresh_full, 1, 1, 1, 11, timeout=180)[0]
    four = run_ranks(_fresh_full, 4, 2, 2, 11, timeout=240)[0]
    other_seed = run_ranks(_fresh_full, 1, 1, 1, 12, timeout=180)[0]
    assert one.keys() == four.keys() and len(one) == len(param_shapes(tiny_gpt2(**_tiny_kw()).config))
    assert all(torch.equal(one[k], four[k]) for k in one)
    assert not torch.equal(one["transformer.wte.weight"], other_seed["transformer.wte.weight"])
    # the oracle: HF's own GPT2LMHeadModel with GPT-2's init applied by name with the same seed
    hf = tiny_gpt2(**_tiny_kw())
    plan = init_gpt2_weights(hf, SHAPE["n_layer"], seed=11)
    ref = hf.state_dict()
    assert all(torch.equal(one[k], ref[k]) for k in one)
    assert plan["transformer.h.0.attn.c_proj.weight"] == "normal(std/sqrt(2L))"
    big = torch.cat([one[f"transformer.h.{i}.mlp.c_fc.weight"].flatten() for i in range(4)])
    resid = torch.cat([one[f"transformer.h.{i}.mlp.c_proj.weight"].flatten() for i in range(4)])
    assert abs(float(big.std()) - 0.02) < 0.001 and abs(float(big.mean())) < 0.001
    assert abs(float(resid.std()) - 0.02 / math.sqrt(8)) < 0.0005
    assert float(one["transformer.h.1.ln_2.weight"].min()) == 1.0 == float(one["transformer.ln_f.weight"].max())
    assert float(one["transformer.h.2.attn.c_attn.bias"].abs().max()) == 0.0


def _tiny_kw() -> dict:
    return {"n_layer": SHAPE["n_layer"], "n_embd": SHAPE["n_embd"], "n_head": SHAPE["n_head"],
            "vocab": SHAPE["vocab_size"], "n_positions": SHAPE["n_positions"]}


def test_fresh_source_shards_equal_cut_of_full():
    cfg = tiny_gpt2(n_head=6, n_layer=2, n_positions=130).config  # 130 rows: row blocks straddle shards
    src = fresh_source(cfg, 5)
    for name in param_shapes(cfg):
        full = src.get(name)
        for size in (1, 2, 3):
            for r in range(size):
                meta = {"n_head": 6, "padded_vocab": padded_vocab_size(cfg.vocab_size, size)}
                assert torch.equal(src.get_shard(name, tp_kind(name), r, size, **meta),
                                   shard(full, tp_kind(name), r, size, **meta)), (name, size, r)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("real")
    out = {"hf": str(root / "hf"), "tp3": str(root / "tp3"), "tp2": str(root / "tp2")}
    tiny_gpt2(n_head=6, n_layer=3).save_pretrained(out["hf"])
    hf_to_ds(out["hf"], out["tp3"], tp=3, pp=2, verify=False)
    hf_to_ds(out["hf"], out["tp2"], tp=2, pp=3, verify=False)
    return out


@pytest.mark.parametrize("which", ["hf", "tp3", "tp2"])
def test_sliced_reads_equal_full_read_and_read_only_the_shard(dirs, which):
    reader = HFReader(dirs[which]) if which == "hf" else ShardedReader(dirs[which])
    for name in param_shapes(reader.config):
        full, kind = reader.get(name), tp_kind(name)
        for size in (1, 2, 3, 6):
            meta = {"n_head": 6, "padded_vocab": padded_vocab_size(reader.config.vocab_size, size)}
            for r in range(size):
                reader.elements_read[0] = 0
                got = reader.get_shard(name, kind, r, size, **meta)
                want = shard(full, kind, r, size, **meta)
                assert torch.equal(got, want), (which, name, size, r)
                # padding rows are created, not read: at most the shard's elements come from disk
                assert reader.elements_read[0] <= want.numel(), (which, name, size, r)
                if kind != "replicated" and size > 1:
                    assert reader.elements_read[0] < full.numel()


_SHARD_RSS = r"""
import sys
from ds_mp.checkpoint.hf import HFReader
def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
reader = HFReader(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS to the current RSS
base = peak()
wte = reader.get_shard("transformer.wte.weight", "vocab", 1, 2, padded_vocab=int(sys.argv[2]))
print("RISE_KIB", peak() - base, "SHARD_KIB", wte.numel() * wte.element_size() // 1024)
"""


def test_reading_a_shard_costs_the_shard(tmp_path):
    """The last TP rank's ``wte`` shard (rows read, padding rows added) from an HF dir: the peak RSS
    rises by the shard, not by the shard plus the file pages a memory map keeps resident plus a
    concatenation for the padding (3× the shard before)."""
    import subprocess
    import sys

    hf = str(tmp_path / "hf")
    tiny_gpt2(n_layer=1, n_embd=512, n_head=4, vocab=32000).save_pretrained(hf)  # wte: 62.5 MiB
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _SHARD_RSS, hf, str(padded_vocab_size(32000, 2))],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rise, shard_kib = (int(v) for v in out.stdout.split("RISE_KIB")[1].split()[::2])
    assert rise < 1.25 * shard_kib, (rise, shard_kib)


def test_qkv_shard_is_three_column_ranges():
    dim, ranges, length = shard_ranges("qkv", 1, 2, (48, 144), n_head=6)
    assert (dim, ranges, length) == (1, [(24, 48), (72, 96), (120, 144)], 72)
    dim, ranges, length = shard_ranges("vocab", 1, 2, (203, 48), padded_vocab=256)
    assert (dim, ranges, length) == (0, [(128, 203)], 128)  # 53 padding rows created, not read


def test_bin_checkpoint_falls_back_to_a_full_read(dirs, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(dirs["hf"], "model.safetensors"))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text(open(os.path.join(dirs["hf"], "config.json")).read())
    torch.save(sd, str(binary / "pytorch_model.bin"))
    reader = HFReader(str(binary))
    name = "transformer.h.1.attn.c_attn.weight"
    assert torch.equal(reader.get_shard(name, "qkv", 2, 3, n_head=6), shard(sd[name], "qkv", 2, 3, n_head=6))


def _build_from_dir_without_full_reads(rank: int, hf: str) -> dict:
    import ds_mp
    from ds_mp.checkpoint import hf as hf_mod
    from ds_mp.checkpoint.hf import full_state_dict

    full_reads: list[str] = []
    original = hf_mod.HFReader.get

    def get(self, name):
        full_reads.append(name)
        return original(self, name)

    hf_mod.HFReader.get = get
    engine, *_ = ds_mp.initialize(model=hf, config=ds_config(tp=2, pp=2))
    hf_mod.HFReader.get = original
    return {"full_reads": full_reads, "state": full_state_dict(engine)}


def test_tp2_pp2_build_reads_only_its_shards(dirs, tmp_path):
    from transformers import GPT2LMHeadModel

    hf = str(tmp_path / "hf4")
    tiny_gpt2().save_pretrained(hf)  # 4 heads
    res = run_ranks(_build_from_dir_without_full_reads, 4, hf, timeout=240)
    for r in res:
        assert all(tp_kind(n) == "replicated" for n in r["full_reads"]), r["full_reads"]
    ref = GPT2LMHeadModel.from_pretrained(hf).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in res[0]["state"].items()) and len(res[0]["state"]) == 4 * 12 + 4


# ----------------------------------------------------------------------------- bf16 / ZeRO-1
BF16_TOL = 1e-3  # |Δloss| bound in bf16: reduction order differs with TP/PP/DP (measured ≤ 1.1e-4; fp32 runs: 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_zero1_checkpoint_resumes_at_other_layouts(tmp_path):
    """``launch/train.py``'s loop on 4 in-process ranks: bf16 + ZeRO-1 + AdamW at TP×PP = 2×2, 4 steps, a
    checkpoint at step 2 (the fp32 master weights and Adam state by HF name: layout-free).
    ``--resume`` from it at TP×PP = 1×4 (4 ranks) and 1×1 with DP = 2 (2 ranks, half the
    accumulation: the same global batch; ZeRO-1 then splits the master and Adam state over the
    two ranks): steps 3–4 have the uninterrupted run's losses.  In-process (``train_in_process``):
    the launcher adds nothing this checks, and its own path is run end to end in test_launcher.py."""
    import shutil

    from launcher_utils import read_log, tiny_dataset, train_config, train_in_process

    data = tiny_dataset(str(tmp_path))
    training = {"steps": 4, "checkpoint_interval": 2, "eval_interval": 0, "export_hf": False}
    zero1 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    full = str(tmp_path / "full")
    os.makedirs(full)
    train_in_process(full, train_config(full, data, tp=2, pp=2, gas=2, ds=zero1, training=training), n=4)
    uninterrupted = [float(r["loss"]) for r in read_log(os.path.join(full, "run"))]
    step2 = os.path.join(full, "run", "checkpoints", "step2")
    reader = ShardedReader(step2)
    assert reader.meta["has_optimizer"] and (reader.meta["tp"], reader.meta["pp"]) == (2, 2)
    assert reader.get("wte.weight").dtype == torch.float32  # the fp32 master, not the bf16 module weight
    assert not os.path.exists(os.path.join(step2, "ds_mp_native.json"))
    for tp, pp, dp in ((1, 4, 1), (1, 1, 2)):
        out = str(tmp_path / f"resume{tp}x{pp}x{dp}")
        shutil.copytree(step2, os.path.join(out, "run", "checkpoints", "step2"))
        with open(os.path.join(out, "run", "checkpoints", "latest"), "w") as f:
            f.write("step2\n")
        cfg = train_config(out, data, tp=tp, pp=pp, gas=2 // dp, ds=zero1, training=training)
        train_in_process(out, cfg, n=tp * pp * dp, args=("--resume",))
        rows = read_log(os.path.join(out, "run"))
        assert [int(r["step"]) for r in rows] == [3, 4]
        got = [float(r["loss"]) for r in rows]
        assert max(abs(a - b) for a, b in zip(got, uninterrupted[2:])) < BF16_TOL, (tp, pp, dp, got, uninterrupted)


# ----------------------------------------------------------------------------- ds-mp convert
_CONVERT_RSS = r"""
import sys
from ds_mp.checkpoint.convert import convert_cli
from ds_mp.checkpoint.hf import HFReader
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
HFReader(sys.argv[1])  # imports and first reads done
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS: the baseline
base = status("VmHWM")
assert convert_cli(["hf-to-ds", sys.argv[1], sys.argv[2], "--tp", "2", "--pp", "2"]) == 0
assert convert_cli(["ds-to-hf", sys.argv[2], sys.argv[3]]) == 0
print("RISE_KIB", status("VmHWM") - base)
"""


def test_convert_streams_tensor_by_tensor(tmp_path):
    """hf-to-ds (TP 2 × PP 2) then ds-to-hf on a 31M-parameter GPT-2 (124 MB fp32): the peak
    RSS rises by less than one model (the whole-model path with its logits check held 3 models)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    hf, ds, back = (str(tmp_path / n) for n in ("hf", "ds", "back"))
    model = tiny_gpt2(n_layer=8, n_embd=512, n_head=8, vocab=8192, n_positions=256)
    model.save_pretrained(hf)
    model_kib = sum(p.numel() for p in model.parameters()) * 4 / 1024
    del model
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CONVERT_RSS, hf, ds, back], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rise = int(out.stdout.split("RISE_KIB")[1].split()[0])
    print(f"convert peak RSS rise {rise / 1024:.0f} MiB for a {model_kib / 1024:.0f} MiB model")
    # measured 0.44–0.71 across runs (allocator, imports, machine load); the whole-model path held
    # 3 models (> 2): below one model separates the two without flaking. The precise figure is
    # the scale benchmark's (python -m benchmarks.run --only scale: 0.35× for GPT-2 medium).
    assert rise < 1.0 * model_kib, (rise, model_kib)
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_verify_logits_option(dirs, tmp_path, capsys):
    from ds_mp.checkpoint.convert import convert_cli

    out = str(tmp_path / "o")
    assert convert_cli(["hf-to-ds", dirs["hf"], out, "--tp", "3", "--verify-logits"]) == 0
    msg = capsys.readouterr().out
    assert "bit-exact" in msg and "max |Δlogits|" in msg
