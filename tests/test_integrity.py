"""Checkpoint integrity: every file of a checkpoint carries a CRC32C in ``ds_mp_manifest.json``;
each kind of damage fails the load with one ``CheckpointError`` naming the file and what to
do, on every rank (also when only one rank reads the damaged file), and leaves the
checkpoint's files as they were.  Old checkpoints without a manifest load with a warning.

Before the manifest (commit "checkpoint integrity"), a truncated ``trainer_state.pt`` raised
torch's raw "failed finding central directory", and flipped bytes inside a shard, an optimizer
file or the metadata loaded silently, through ``load_checkpoint`` and ``ds-mp convert`` alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import pytest

from dist_utils import run_ranks
from ds_mp.checkpoint import CheckpointError, ShardedReader, convert_cli, directory_source
from ds_mp.checkpoint.convert import hf_to_ds
from ds_mp.checkpoint.integrity import MANIFEST, Manifest, crc32c, file_entries, write_manifest
from helpers import batches, ds_config, tiny_gpt2

VOCAB = 203
DAMAGED = "the checkpoint is damaged"


def crc32c_reference(data: bytes) -> int:
    """Bitwise CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the textbook definition."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def tree_digest(root: str) -> dict[str, str]:
    """Every file under ``root`` (relative path) -> sha256 of its bytes."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def flip(path: str, where: str = "data") -> None:
    """XOR one byte of a file, keeping its size: in a safetensors file's tensor data (``data``,
    the middle of it) or header (``header``: a digit of the first shape), else in the middle."""
    raw = bytearray(open(path, "rb").read())
    if path.endswith(".safetensors"):
        n = 8 + int.from_bytes(raw[:8], "little")
        i = raw.index(b'"shape":[') + len('"shape":[') if where == "header" else (n + len(raw)) // 2
    else:
        i = len(raw) // 2
    raw[i] ^= 0x01
    open(path, "wb").write(bytes(raw))


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_crc32c_matches_the_standard_check_value_and_streams(tmp_path):
    """CRC-32C("123456789") = 0xE3069283 (the published check value), and the streamed CRC of a
    file over several chunks equals the textbook bitwise one."""
    import ds_mp.checkpoint.integrity as integrity

    path = tmp_path / "f"
    path.write_bytes(b"123456789")
    assert crc32c(str(path)) == (0xE3069283, 9) == (crc32c_reference(b"123456789"), 9)
    data = bytes(range(256)) * 41 + b"tail"
    path.write_bytes(data)
    old, integrity.CHUNK = integrity.CHUNK, 1000  # force many chunks
    try:
        assert crc32c(str(path)) == (crc32c_reference(data), len(data))
        assert crc32c(str(path), 77) == (crc32c_reference(data[:77]), 77)
    finally:
        integrity.CHUNK = old


def test_manifest_self_check_and_file_checks(tmp_path):
    d = str(tmp_path)
    for name, body in (("a.json", b'{"x": 1}'), ("b.pt", bytes(1000))):
        open(os.path.join(d, name), "wb").write(body)
    write_manifest(d, file_entries([os.path.join(d, "a.json")]))  # b.pt: found and checksummed by the writer
    m = Manifest.open(d)
    assert set(m.files) == {"a.json", "b.pt"} and m.files["b.pt"]["crc32c"] == f"{crc32c_reference(bytes(1000)):08x}"
    m.verify(os.path.join(d, "b.pt"))
    flip(os.path.join(d, "b.pt"))
    with pytest.raises(CheckpointError, match=r"b\.pt: checksum mismatch.*" + DAMAGED):
        Manifest.open(d).verify(os.path.join(d, "b.pt"))
    raw = open(os.path.join(d, MANIFEST)).read()  # a changed digit inside the manifest itself
    open(os.path.join(d, MANIFEST), "w").write(raw.replace('"size": 8', '"size": 9'))
    with pytest.raises(CheckpointError, match=MANIFEST + r": not a valid .*own checksum.*" + DAMAGED):
        Manifest.open(d)


# ----------------------------------------------------------------------------- convert / export / init_from
@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[str, str]:
    """An HF dir and its ``ds-mp convert hf-to-ds`` at TP 2 × PP 2."""
    base = tmp_path_factory.mktemp("integrity")
    hf, ds = str(base / "hf"), str(base / "ds")
    tiny_gpt2(vocab=VOCAB).save_pretrained(hf)
    hf_to_ds(hf, ds, tp=2, pp=2)
    return hf, ds


def test_convert_writes_a_manifest_of_every_file(sharded):
    _, ds = sharded
    m = Manifest.open(ds)
    assert set(m.files) == set(os.listdir(ds)) - {MANIFEST}
    meta = os.path.join(ds, "ds_mp_meta.json")
    assert m.files["ds_mp_meta.json"]["crc32c"] == f"{crc32c_reference(open(meta, 'rb').read()):08x}"


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "missing", "flip_meta"])
def test_convert_and_export_refuse_a_damaged_source(sharded, tmp_path, damage, capsys):
    """``ds-mp convert ds-to-hf`` (the export ``ds-mp generate``/``eval`` run too), resharding
    ``hf-to-ds`` and ``directory_source`` (``init_from``) fail naming the damaged file; no output."""
    _, ds = sharded
    src = shutil.copytree(ds, str(tmp_path / "src"))
    name = "ds_mp_meta.json" if damage == "flip_meta" else "model-pp01-tp01.safetensors"
    path = os.path.join(src, name)
    {"flip_data": flip, "flip_header": lambda p: flip(p, "header"), "truncate": truncate, "missing": os.remove,
     "flip_meta": flip}[damage](path)
    before = tree_digest(src)
    for argv in (["ds-to-hf", src, str(tmp_path / "hf")], ["hf-to-ds", src, str(tmp_path / "re"), "--tp", "1"]):
        assert convert_cli(argv) == 1
        err = capsys.readouterr().err
        assert name in err and DAMAGED in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(str(tmp_path / "hf")) and not os.path.exists(str(tmp_path / "re"))
    with pytest.raises(CheckpointError, match=name):
        source = directory_source(src)
        for r in range(2):
            source.get_shard("transformer.h.3.mlp.c_fc.weight", "column", r, 2, n_head=4, padded_vocab=256)
    assert tree_digest(src) == before


def test_files_ds_mp_does_not_read_are_not_checked(sharded, tmp_path):
    """``config.json`` is written for HF tools; editing it does not make the checkpoint damaged."""
    _, ds = sharded
    src = shutil.copytree(ds, str(tmp_path / "src"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, "comment": "edited by hand"}, open(os.path.join(src, "config.json"), "w"))
    assert convert_cli(["ds-to-hf", src, str(tmp_path / "hf")]) == 0


def test_reader_verifies_exactly_the_files_it_reads(sharded):
    """``files_of_shard`` (checked ahead by ``load_checkpoint``) names the files ``get_shard``
    and ``get_state_shard`` then open, at the saved layout and resharded."""
    _, ds = sharded
    from ds_mp.checkpoint.sharded import expected_shapes
    from ds_mp.models.gpt2 import tp_kind
    from ds_mp.tensor_parallel.sharding import padded_vocab_size

    reader = ShardedReader(ds)
    for tp in (1, 2, 4):  # saved at TP 2: merged, as saved, split
        meta = {"n_head": 4, "padded_vocab": padded_vocab_size(VOCAB, tp)}
        for name in expected_shapes(reader.config):
            kind = tp_kind(name)
            for rank in range(tp):
                fresh = ShardedReader(ds)
                fresh.manifest.verified.clear()
                fresh.get_shard(name, kind, rank, tp, **meta)
                assert fresh.manifest.verified - {"ds_mp_meta.json", "config.json"} == {
                    os.path.basename(p) for p in reader.files_of_shard(name, kind, rank, tp, **meta)}, (name, tp)


# ----------------------------------------------------------------------------- training checkpoints
def _save(rank: int, hf: str, root: str) -> None:
    import ds_mp
    from ds_mp.checkpoint import save_checkpoint

    engine, *_ = ds_mp.initialize(model=hf, config=ds_config(pp=2, optimizer="Adam", lr=0.01))
    for i, step in enumerate((batches(2, 2, 16, VOCAB, seed=1), batches(2, 2, 16, VOCAB, seed=2))):
        engine.train_batch(iter(step))
        save_checkpoint(engine, root, f"step{i + 1}", {"sampler": i + 1})


@pytest.fixture(scope="module")
def saved(sharded, tmp_path_factory) -> str:
    """A 2-stage Adam run's checkpoints ``step1`` and ``step2`` (``latest``)."""
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_ranks(_save, 2, sharded[0], root, timeout=240)
    return root


def test_save_writes_a_manifest_of_every_file(saved):
    ckpt = os.path.join(saved, "step2")
    m = Manifest.open(ckpt)
    assert set(m.files) == set(os.listdir(ckpt)) - {MANIFEST}
    assert {"trainer_state.pt", "ds_mp_meta.json", "config.json", "model-pp01-tp00.safetensors",
            "optim-pp01-tp00.safetensors"} <= set(m.files)
    for name in ("trainer_state.pt", "model-pp01-tp00.safetensors"):  # rank 0's file and rank 1's
        assert m.files[name]["crc32c"] == f"{crc32c_reference(open(os.path.join(ckpt, name), 'rb').read()):08x}"


def _remove_key(path: str, key: str) -> None:
    meta = json.load(open(path))
    del meta[key]
    json.dump(meta, open(path, "w"), indent=2, sort_keys=True)


def _old_checkpoint(ckpt: str) -> None:
    """What a ds_mp before manifests wrote: no manifest, and no "manifest" key in the meta."""
    os.remove(os.path.join(ckpt, MANIFEST))
    _remove_key(os.path.join(ckpt, "ds_mp_meta.json"), "manifest")


# case -> (file damaged under step2, how, words every rank's error must contain); None: loads
CASES = {
    "trainer_state_truncated": ("trainer_state.pt", truncate, ["trainer_state.pt", "truncated", DAMAGED]),
    "shard_bytes_flipped_rank1_only": ("model-pp01-tp00.safetensors", flip,
                                       ["model-pp01-tp00.safetensors", "checksum mismatch", DAMAGED]),
    "optim_bytes_flipped": ("optim-pp00-tp00.safetensors", flip, ["optim-pp00-tp00.safetensors", "checksum", DAMAGED]),
    "shard_header_flipped": ("model-pp00-tp00.safetensors", lambda p: flip(p, "header"),
                             ["model-pp00-tp00.safetensors", "header checksum mismatch", DAMAGED]),
    "shard_truncated": ("model-pp01-tp00.safetensors", truncate, ["model-pp01-tp00.safetensors", "truncated"]),
    "shard_missing": ("optim-pp01-tp00.safetensors", os.remove, ["optim-pp01-tp00.safetensors", "missing"]),
    "meta_bytes_flipped": ("ds_mp_meta.json", flip, ["ds_mp_meta.json", "checksum mismatch", DAMAGED]),
    "manifest_damaged": (MANIFEST, flip, [MANIFEST, DAMAGED]),
    "manifest_missing": (MANIFEST, os.remove, [MANIFEST, "missing", "incomplete"]),
    "latest_dangling": ("../latest", lambda p: open(p, "w").write("step9\n"),
                        ["latest names 'step9'", "does not exist", "found: step1, step2"]),
    "old_checkpoint_truncated_trainer_state": ("trainer_state.pt", lambda p: (_old_checkpoint(os.path.dirname(p)),
                                                                              truncate(p)),
                                               ["trainer_state.pt", "cannot be read", DAMAGED]),
    "old_checkpoint_loads_with_a_warning": ("ds_mp_meta.json", lambda p: _old_checkpoint(os.path.dirname(p)), None),
    "intact": ("ds_mp_meta.json", lambda p: None, None),
}


def _load_each(rank: int, hf: str, roots: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Build the engine once, then try every case's checkpoint root; per case the outcome
    (``CheckpointError`` text or what loaded, and any warning)."""
    import ds_mp
    from ds_mp.checkpoint import load_checkpoint

    engine, *_ = ds_mp.initialize(model=hf, config=ds_config(pp=2, optimizer="Adam", lr=0.01))
    out = {}
    for case, root in roots.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                client = load_checkpoint(engine, root)
                outcome = f"loaded sampler={client['sampler']} steps={engine.global_steps}"
            except CheckpointError as e:
                outcome = f"CheckpointError: {e}"
        out[case] = (outcome, " | ".join(str(w.message) for w in caught if "ds_mp" in str(w.message)))
    loss = float(engine.train_batch(iter(batches(2, 2, 16, VOCAB, seed=3))))  # every rank still in step
    out["after"] = (f"trained {loss:.4f}", "")
    return out


def test_each_damage_fails_on_every_rank_naming_the_file_and_changes_nothing(saved, tmp_path, sharded):
    roots, digests = {}, {}
    for case, (name, damage, _) in CASES.items():
        root = shutil.copytree(saved, str(tmp_path / case))
        damage(os.path.normpath(os.path.join(root, "step2", name)))
        roots[case], digests[case] = root, tree_digest(root)
    results = run_ranks(_load_each, 2, sharded[0], roots, timeout=300)
    for case, (_, _, words) in CASES.items():
        for rank, res in enumerate(results):
            outcome, warned = res[case]
            if words is None:
                assert outcome == "loaded sampler=2 steps=2", (case, rank, outcome)
                assert ("without checksums" in warned) == case.startswith("old"), (case, warned)
            else:
                assert outcome.startswith("CheckpointError") and "\n" not in outcome, (case, rank, outcome)
                assert all(w in outcome for w in words), (case, rank, outcome)
        assert tree_digest(roots[case]) == digests[case], f"{case}: the load changed the checkpoint's files"
    # a damage only rank 1 reads (its stage's file) fails rank 0 too, which names rank 1
    assert "rank 1: " in results[0]["shard_bytes_flipped_rank1_only"][0]
    assert all(r["after"][0].startswith("trained") for r in results)  # and both ranks trained on together
