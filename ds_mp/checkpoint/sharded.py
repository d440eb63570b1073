"""The ds_mp sharded checkpoint format: one safetensors file per (pipeline stage, TP rank).

    DIR/
      ds_mp_meta.json               format + version, tp, pp, stage parts, true and padded
                                    vocab, the HF config dict
      config.json                   the same HF config (for tools that read only that)
      model-pp00-tp00.safetensors   stage 0 / TP rank 0's shards, keyed by HF name
      ...
      optim-pp00-tp00.safetensors   training checkpoints only: optimizer state tensors,
                                    keyed "<HF name>::<state key>" (see training.py)
      trainer_state.pt              training checkpoints only

A tensor is stored in the file of the stage that holds its layer (the tied embedding once,
on stage 0).  Shards are cut by :func:`ds_mp.tensor_parallel.sharding.shard` with the kind
from the family's TP plan (``Family.tp_kind``, e.g. ``GPT2_TP_PLAN``), so ``unshard`` of the
TP shards of one name gives the full HF tensor (vocab padding dropped) and any other layout
can re-cut it: the format is layout-free.  A LoRA run's training checkpoint also holds the
factors (``<block>.<module>.lora_A/B``, cut by the family's LoRA plan; ``"lora"`` in the meta
names them).  :class:`ShardedReader` validates every file header up front and reads
tensors lazily, one name at a time, a TP shard as positioned reads of just its ranges
(:class:`SafetensorsRanges`).
"""
from __future__ import annotations

import bisect
import json
import os
from typing import Any

import torch

from ds_mp.models.family import Family, family_named, family_of
from ds_mp.checkpoint.integrity import MANIFEST, CheckpointError, Manifest, warn_unverified, write_manifest
from ds_mp.checkpoint.safetensors_io import SafetensorsRanges, open_safetensors, st_dtype, write_safetensors_streaming
from ds_mp.tensor_parallel.sharding import EXPERT_KINDS, REPLICATED, locate, read_shard, shard, shard_ranges, unshard

FORMAT, VERSION = "ds_mp.sharded", 1
META = "ds_mp_meta.json"


def expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``cfg``'s family (HF name, HF order) and its full shape."""
    return family_of(cfg).param_shapes(cfg)


def lora_shapes(cfg: Any, lora: dict | None) -> dict[str, tuple[int, ...]]:
    """The LoRA factors of a run with ``lora`` (``{"r": …, "target_modules": […]}``, as in
    ``ds_mp_meta.json``) and their full shapes in ds_mp's layout, ``lora_A`` (in, r) and
    ``lora_B`` (r, out), in HF order; empty without LoRA.  They shard by the family's LoRA plan."""
    return family_of(cfg).lora_shapes(cfg, lora)


def stage_of(name: str, layers: list[str], parts: list[int], family: Family) -> int:
    """The stage whose layer range ``[parts[s], parts[s+1])`` holds ``name``'s layer."""
    return bisect.bisect_right(parts, family.layer_index(name, layers)) - 1


def shard_meta(cfg: Any, name: str, padded_vocab: int) -> dict[str, int]:
    """The ``shard``/``unshard`` keywords of tensor ``name``: the heads its ``qkv``/``kv`` cut keeps
    whole (the family's :meth:`~ds_mp.models.family.Family.heads`) and the padded vocab."""
    return {"n_head": family_of(cfg).heads(name, cfg), "padded_vocab": padded_vocab}


def layout_kind(family: Family, name: str, expert_layout: str | None) -> str:
    """How ``name`` is cut in a run whose mixture-of-experts tensors are laid out ``expert_layout``
    (``ds_mp.moe``): the plan's kind, except that ``"whole"`` cuts the experts by expert (None: the plan's,
    a checkpoint written before the layout was recorded, or by ``write_sharded``)."""
    kind = family.tp_kind(name)
    return "experts" if kind in EXPERT_KINDS and expert_layout == "whole" else kind


def shard_shape(full: tuple[int, ...], kind: str, tp: int, n_head: int, padded_vocab: int) -> tuple[int, ...]:
    """Shape of one TP shard, computed by ``shard`` itself on a meta tensor."""
    t = torch.empty(full, device="meta")
    return tuple(shard(t, kind, 0, tp, n_head=n_head, padded_vocab=padded_vocab).shape)


def shard_file(path: str, prefix: str, stage: int, rank: int) -> str:
    return os.path.join(path, f"{prefix}-pp{stage:02d}-tp{rank:02d}.safetensors")


def make_meta(cfg: Any, tp: int, parts: list[int], padded_vocab: int, has_optimizer: bool = False,
              layers: list[str] | None = None, lora: dict | None = None, expert_layout: str | None = None) -> dict:
    """``layers``: the pipeline's layer order when it is not ``pipeline_layers`` (a ring layout);
    ``lora``: ``{"r", "alpha", "target_modules"}`` of a LoRA run, whose files also hold the
    factors (:func:`lora_shapes`); ``expert_layout``: the run's ``ds_mp.moe.expert_layout``."""
    meta = {"format": FORMAT, "version": VERSION, "tp": tp, "pp": len(parts) - 1, "parts": list(parts),
            "layers": list(layers or family_of(cfg).pipeline_layers(cfg)),
            "vocab_size": cfg.vocab_size, "padded_vocab": padded_vocab, "has_optimizer": has_optimizer,
            "lora": lora, "hf_config": cfg.to_dict(),
            "manifest": MANIFEST}  # written last, over every file (ds_mp.checkpoint.integrity)
    if any(k in EXPERT_KINDS for k in family_of(cfg).tp_plan.values()):
        meta["expert_layout"] = expert_layout
    return meta


def write_meta(path: str, meta: dict) -> None:
    """``ds_mp_meta.json`` plus the HF ``config.json`` (so ``ds_mp.model`` can name the dir)."""
    with open(os.path.join(path, META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(meta["hf_config"], f, indent=2, sort_keys=True)


def write_sharded(reader: Any, cfg: Any, out: str, tp: int, parts: list[int], padded_vocab: int) -> None:
    """Write the model files of a sharded directory from ``reader`` (``get_shard`` and
    ``dtype_of`` by HF name: an :class:`~ds_mp.checkpoint.hf.HFReader` or a
    :class:`ShardedReader` of another layout), one (stage, TP rank) file at a time and one
    shard at a time (read as slices, streamed to disk): peak memory is one shard."""
    family = family_of(cfg)
    layers, shapes = family.pipeline_layers(cfg), expected_shapes(cfg)
    for s in range(len(parts) - 1):
        names = [n for n in shapes if stage_of(n, layers, parts, family) == s]
        for r in range(tp):
            specs = {n: (shard_shape(shapes[n], family.tp_kind(n), tp, family.heads(n, cfg), padded_vocab),
                         reader.dtype_of(n)) for n in names}
            write_safetensors_streaming(
                shard_file(out, "model", s, r), specs,
                lambda n, r=r: reader.get_shard(n, family.tp_kind(n), r, tp, **shard_meta(cfg, n, padded_vocab)))
    write_meta(out, make_meta(cfg, tp, parts, padded_vocab))
    write_manifest(out)


def is_sharded_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


class ShardedReader:
    """Validated, lazy access to a sharded directory: full tensors by HF name (with the LoRA
    factors of a LoRA run's training checkpoint, see :func:`lora_shapes`).

    With ``verify`` (default) the directory's manifest (:mod:`~ds_mp.checkpoint.integrity`)
    is checked as files are used: every file's size and the metadata up front, each header
    as it is parsed, a whole file's CRC32C before the first tensor is read from it
    (:meth:`verify_files` checks a set ahead).  ``verify=False`` skips all of it."""

    def __init__(self, path: str, verify: bool = True) -> None:
        self.path = path
        self.manifest = Manifest.open(path) if verify else None
        if self.manifest is not None:
            self.verify_files([os.path.join(path, META)])  # config.json (for HF tools) is not read here
        try:
            with open(os.path.join(path, META)) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read {META} ({e}); not a ds_mp sharded checkpoint") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CheckpointError(f"{path}: {META} has format {meta.get('format')!r} version "
                                  f"{meta.get('version')!r}; this ds_mp reads {FORMAT!r} version {VERSION}")
        try:
            self.family = family_named(meta["hf_config"].get("model_type"))
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if verify and self.manifest is None:
            if meta.get("manifest"):
                raise CheckpointError(f"{os.path.join(path, MANIFEST)}: file missing ({META} says it was written); "
                                      "the checkpoint is incomplete: re-copy it, or pass verify=False to load unchecked")
            warn_unverified(path)
        self.meta, self.tp, self.parts = meta, meta["tp"], meta["parts"]
        self.config = self.family.config_from_dict(meta["hf_config"])
        self.lora = meta.get("lora") or None  # {"r", "alpha", "target_modules"} of a LoRA run
        self.shapes = {**expected_shapes(self.config), **lora_shapes(self.config, self.lora)}
        self.state_keys: dict[str, list[str]] = {}
        self.elements_read = [0]  # tensor elements read through get_shard / get_state_shard
        self._headers: dict[str, SafetensorsRanges] = {}  # file -> its parsed header (ranges read with pread)
        for s in range(meta["pp"]):
            want = {n for n in self.shapes if self.stage_of(n) == s}
            for r in range(self.tp):
                self._check_model_file(s, r, want)
                if meta.get("has_optimizer"):
                    self._index_optim_file(s, r, want)

    def kind(self, name: str) -> str:
        """How the saved shards of ``name`` are cut (:func:`layout_kind` of the saved run's expert layout)."""
        return layout_kind(self.family, name, self.meta.get("expert_layout"))

    def stage_of(self, name: str) -> int:
        return stage_of(name, self.meta.get("layers") or self.family.pipeline_layers(self.config), self.parts,
                        self.family)

    def _open(self, prefix: str, s: int, r: int, header_only: bool = False) -> Any:
        """A fresh handle per access: its memory map (pages counted in RSS) ends with it.
        The file is verified first (only its header with ``header_only``)."""
        path = shard_file(self.path, prefix, s, r)
        if self.manifest is not None:
            self.manifest.check_header(path) if header_only else self.manifest.verify(path)
        return open_safetensors(path)

    def verify_files(self, paths: Any) -> None:
        """Check the whole CRC32C of each file in ``paths`` (no-op without a manifest)."""
        if self.manifest is not None:
            for p in sorted(set(paths)):
                self.manifest.verify(p)

    def files_of_shard(self, name: str, kind: str, rank: int, size: int, *, n_head: int = 0, padded_vocab: int = 0,
                       state: bool = False) -> set[str]:
        """The files :meth:`get_shard` (with ``state`` also :meth:`get_state_shard`) reads for
        this shard of the canonical ``name``: those whose saved TP shard overlaps it, as
        :meth:`_read_range` finds them (the same model, so the same ``n_head``)."""
        s, full = self.stage_of(name), self.shapes[name]
        if self.kind(name) != kind and self.tp > 1:  # read whole from every saved shard (_read_range)
            ranks = set(range(self.tp))
            return ({shard_file(self.path, "model", s, k) for k in ranks}
                    | ({shard_file(self.path, "optim", s, k) for k in ranks} if state and self.state_keys.get(name) else set()))
        _, mine, _ = shard_ranges(kind, rank, size, full, n_head=n_head, padded_vocab=padded_vocab)
        saved = [shard_ranges(kind, k, self.tp, full, n_head=n_head, padded_vocab=self.meta["padded_vocab"])[1]
                 for k in range(1 if kind in REPLICATED else self.tp)]
        ranks = {k for k, ranges in enumerate(saved) if any(locate(lo, hi, ranges) for lo, hi in mine)}
        out = {shard_file(self.path, "model", s, k) for k in ranks}
        if state and self.state_keys.get(name):  # the state's slices, and TP rank 0's file (its extras)
            out |= {shard_file(self.path, "optim", s, k) for k in ranks | {0}}
        return out

    def local_shape(self, name: str) -> tuple[int, ...]:
        return shard_shape(self.shapes[name], self.kind(name), self.tp, self.family.heads(name, self.config),
                           self.meta["padded_vocab"])

    def _check_model_file(self, s: int, r: int, want: set[str]) -> None:
        f, path = self._open("model", s, r, header_only=True), shard_file(self.path, "model", s, r)
        have = set(f.keys())
        if want - have:
            raise CheckpointError(f"{path}: missing tensors {sorted(want - have)[:5]}; the checkpoint is incomplete")
        if have - want:
            raise CheckpointError(f"{path}: unexpected tensors {sorted(have - want)[:5]}; the files do not "
                                  f"match {META} (tp={self.tp}, parts={self.parts})")
        for name in sorted(want):
            got, exp = tuple(f.get_slice(name).get_shape()), self.local_shape(name)
            if got != exp:
                raise CheckpointError(f"{path}: {name} has shape {list(got)}, expected {list(exp)} for the "
                                      f"config in {META}; the checkpoint and its config disagree")

    def _index_optim_file(self, s: int, r: int, want: set[str]) -> None:
        f = self._open("optim", s, r, header_only=True)
        keys: dict[str, list[str]] = {}
        for k in f.keys():
            name, _, key = k.partition("::")
            if name not in want:
                raise CheckpointError(f"{shard_file(self.path, 'optim', s, r)}: state for unknown tensor "
                                      f"{name!r}; the optimizer files do not match {META}")
            keys.setdefault(name, []).append(key)
        for name, ks in keys.items():
            self.state_keys.setdefault(name, sorted(ks))

    def get(self, name: str) -> torch.Tensor:
        """The full HF tensor ``name`` (true vocab), merged from its TP shards."""
        name = self.family.canonical_name(name)
        if name not in self.shapes:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in a {self.family.name} with this config")
        s = self.stage_of(name)
        shards = [self._open("model", s, r).get_tensor(name) for r in range(self.tp)]
        return unshard(shards, self.kind(name), n_head=self.family.heads(name, self.config),
                       vocab=self.config.vocab_size)

    def _ranges(self, prefix: str, s: int, r: int, header_only: bool = False) -> SafetensorsRanges:
        path = shard_file(self.path, prefix, s, r)
        if self.manifest is not None and not header_only:
            self.manifest.verify(path)
        if path not in self._headers:
            self._headers[path] = SafetensorsRanges(path, self.elements_read)
        return self._headers[path]

    def _read_range(self, prefix: str, key: str, name: str, kind: str, dim: int, lo: int, hi: int,
                    out: torch.Tensor) -> None:
        """Write the full tensor's range ``[lo, hi)`` along ``dim`` into ``out``, from the
        overlapping saved shard files only (each piece read straight into its place)."""
        s, n_head, padded = self.stage_of(name), self.family.heads(name, self.config), self.meta["padded_vocab"]
        full = self.shapes[name]
        if self.kind(name) != kind and self.tp > 1:  # experts saved whole, read split (or back): cut along another dim
            shards = [self._open(prefix, s, k).get_tensor(key) for k in range(self.tp)]
            out.copy_(unshard(shards, self.kind(name)).narrow(dim, lo, hi - lo))
            return
        for k in range(1 if kind in REPLICATED else self.tp):
            _, ranges, _ = shard_ranges(kind, k, self.tp, full, n_head=n_head, padded_vocab=padded)
            for llo, lhi, glo in locate(lo, hi, ranges):
                self._ranges(prefix, s, k).read(key, dim, llo, lhi, out.narrow(dim, glo - lo, lhi - llo))

    def dtype_of(self, name: str) -> torch.dtype:
        name = self.family.canonical_name(name)
        return st_dtype(self._ranges("model", self.stage_of(name), 0, header_only=True).entries[name]["dtype"])

    def get_shard(self, name: str, kind: str, rank: int, size: int, *, n_head: int = 0,
                  padded_vocab: int = 0) -> torch.Tensor:
        """``shard(get(name), kind, rank, size, ...)`` for another layout, reading only the
        overlapping slices of the saved shard files (never the full tensor)."""
        name = self.family.canonical_name(name)
        if name not in self.shapes:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in a {self.family.name} with this config")
        return read_shard(lambda d, lo, hi, out: self._read_range("model", name, name, kind, d, lo, hi, out),
                          self.shapes[name], kind, rank, size, n_head=n_head, padded_vocab=padded_vocab,
                          dtype=self.dtype_of(name))

    def get_state_shard(self, name: str, kind: str, rank: int, size: int, *, n_head: int = 0,
                        padded_vocab: int = 0) -> dict[str, Any]:
        """:meth:`get_state` cut for one TP shard, reading only the slices it needs: state
        tensors shaped like the parameter follow its shard rule, others (Adam's ``step``)
        are read as stored, non-tensor entries come from the JSON metadata."""
        name = self.family.canonical_name(name)
        s = self.stage_of(name)
        out: dict[str, Any] = {}
        for key in self.state_keys.get(name, []):
            stored = f"{name}::{key}"
            f = self._open("optim", s, 0)
            sl = f.get_slice(stored)
            if tuple(sl.get_shape()) == self.local_shape(name):
                out[key] = read_shard(
                    lambda d, lo, hi, o: self._read_range("optim", stored, name, kind, d, lo, hi, o),
                    self.shapes[name], kind, rank, size, n_head=n_head, padded_vocab=padded_vocab,
                    dtype=st_dtype(sl.get_dtype()))
            else:
                out[key] = f.get_tensor(stored)
        if self.meta.get("has_optimizer"):
            extras = json.loads((self._open("optim", s, 0).metadata() or {}).get("extras", "{}"))
            out.update(extras.get(name, {}))
        return out

    def get_state(self, name: str) -> dict[str, Any]:
        """Optimizer state of parameter ``name``: tensors shaped like the parameter merged
        by its shard rule (full HF shape), other tensors (e.g. Adam's step) as stored, and
        non-tensor entries from the file's JSON metadata."""
        name = self.family.canonical_name(name)
        s = self.stage_of(name)
        out: dict[str, Any] = {}
        for key in self.state_keys.get(name, []):
            shards = [self._open("optim", s, r).get_tensor(f"{name}::{key}") for r in range(self.tp)]
            sharded = tuple(shards[0].shape) == self.local_shape(name)
            kind = self.kind(name) if sharded else "replicated"
            out[key] = unshard(shards, kind, n_head=self.family.heads(name, self.config),
                               vocab=self.config.vocab_size)
        if self.meta.get("has_optimizer"):
            extras = json.loads((self._open("optim", s, 0).metadata() or {}).get("extras", "{}"))
            out.update(extras.get(name, {}))
        return out
