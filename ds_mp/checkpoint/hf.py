"""Hugging Face GPT-2 directories in and out.

In: :func:`directory_source` turns an HF directory (``config.json`` + ``model.safetensors``,
a sharded safetensors index, or ``pytorch_model.bin``) or a ds_mp sharded directory into a
:class:`WeightSource`.  Every file header, key and shape is checked against the config up
front; tensors are then read lazily by name (``safe_open``), so a rank building one
pipeline stage reads only that stage's tensors.

Out: :func:`write_hf_dir` writes ``config.json`` + ``model.safetensors`` (+ tokenizer files)
atomically; :func:`save_hf` is the collective that gathers a running engine's shards to
global rank 0 and calls it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_mp.atomic import atomic_dir
from ds_mp.checkpoint.sharded import (CheckpointError, ShardedReader, canonical_name, expected_shapes,
                                      SafetensorsRanges, is_sharded_dir, open_safetensors, st_dtype,
                                      write_safetensors_streaming)
from ds_mp.models.gpt2 import WeightSource, hf_param_name, tp_kind
from ds_mp.tensor_parallel.sharding import read_shard, shard, unshard

# Buffers older GPT-2 checkpoints carry (causal mask); recomputed by every implementation.
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def read_hf_config(path: str) -> Any:
    """The ``GPT2Config`` of an HF directory, refusing other model types."""
    from transformers import GPT2Config

    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; give an HF GPT-2 directory (save_pretrained) "
                              "or a ds_mp sharded checkpoint")
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json; not an HF model directory "
                              "(save_pretrained writes one)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e}); fix or re-export the config") from None
    if raw.get("model_type") != "gpt2":
        raise CheckpointError(f"{cfg_path}: model_type is {raw.get('model_type')!r}; ds_mp reads GPT-2 "
                              "checkpoints (model_type 'gpt2') only")
    return GPT2Config.from_dict(raw)


class HFReader:
    """Validated, lazy access to the tensors of an HF GPT-2 directory by canonical name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = read_hf_config(path)
        self._where: dict[str, tuple[Any, str]] = {}  # canonical name -> (source, stored key)
        self._shape: dict[str, tuple[int, ...]] = {}
        self.elements_read = [0]  # tensor elements read through get_shard (safetensors ranges)
        self._headers: dict[str, SafetensorsRanges] = {}  # safetensors file -> its parsed header
        for file in self._weight_files():
            self._index(file)
        self._validate()

    def _weight_files(self) -> list[str]:
        p = self.path
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if os.path.isfile(os.path.join(p, index)):
                try:
                    with open(os.path.join(p, index)) as f:
                        files = sorted(set(json.load(f)["weight_map"].values()))
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{p}/{index}: not a valid weight index ({e}); re-export the model") from None
                return [os.path.join(p, f) for f in files]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(p, single)):
                return [os.path.join(p, single)]
        raise CheckpointError(f"{p}: no model.safetensors, pytorch_model.bin or index json (found "
                              f"{sorted(os.listdir(p))}); save the model with save_pretrained")

    def _index(self, file: str) -> None:
        """Record each tensor's shape and where to read it: a safetensors path (reopened
        per read, so no memory map outlives its tensor) or the mmap-loaded ``.bin`` dict."""
        handle: str | dict[str, torch.Tensor]
        if file.endswith(".safetensors"):
            f = open_safetensors(file)  # validates the file (truncation, corrupt header)
            handle, keys = file, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            self._headers[file] = SafetensorsRanges(file, self.elements_read)
        else:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: file missing; the checkpoint is incomplete, re-copy it")
            try:
                handle = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises several types for bad files
                raise CheckpointError(f"{file}: cannot load ({type(e).__name__}: {e}); the file is truncated "
                                      "or not a weights-only PyTorch state dict") from None
            keys = {k: tuple(v.shape) for k, v in handle.items()}
        for key, shape in keys.items():
            if _IGNORED.match(key):
                continue
            name = "lm_head.weight" if key == "lm_head.weight" else canonical_name(key)
            self._where[name], self._shape[name] = (handle, key), shape

    def _raw(self, name: str) -> torch.Tensor:
        handle, key = self._where[name]
        return open_safetensors(handle).get_tensor(key) if isinstance(handle, str) else handle[key]

    def _validate(self) -> None:
        want = expected_shapes(self.config)
        have = set(self._shape) - {"lm_head.weight"}
        if want.keys() - have:
            raise CheckpointError(f"{self.path}: missing tensors {sorted(want.keys() - have)[:5]}; the "
                                  "checkpoint does not match its config.json (n_layer?)")
        if have - want.keys():
            raise CheckpointError(f"{self.path}: unexpected tensors {sorted(have - want.keys())[:5]}; not a "
                                  "plain GPT2LMHeadModel checkpoint for this config.json")
        for name, shape in want.items():
            if self._shape[name] != shape:
                raise CheckpointError(f"{self.path}: {name} has shape {list(self._shape[name])} but config.json "
                                      f"implies {list(shape)}; the weights and config.json disagree")
        if "lm_head.weight" in self._shape and not getattr(self.config, "tie_word_embeddings", True):
            if not torch.equal(self._raw("lm_head.weight"), self._raw("transformer.wte.weight")):
                raise CheckpointError(f"{self.path}: lm_head.weight is untied from wte; ds_mp ties the LM "
                                      "head to the embedding, so this checkpoint cannot be loaded")

    def get(self, name: str) -> torch.Tensor:
        name = canonical_name(name)
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this GPT-2 checkpoint")
        return self._raw(name)

    def dtype_of(self, name: str) -> torch.dtype:
        handle, key = self._where[canonical_name(name)]
        return st_dtype(self._headers[handle].entries[key]["dtype"]) if isinstance(handle, str) else handle[key].dtype

    def get_shard(self, name: str, kind: str, rank: int, size: int, *, n_head: int = 0,
                  padded_vocab: int = 0) -> torch.Tensor:
        """``shard(get(name), kind, rank, size, ...)``: from safetensors only the rows/columns
        of this shard are read, straight into the shard (:class:`SafetensorsRanges`; the three
        q|k|v column ranges of ``c_attn``, the vocab rows); a ``pytorch_model.bin`` is
        memory-mapped and cut after a full read."""
        name = canonical_name(name)
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this GPT-2 checkpoint")
        handle, key = self._where[name]
        if not isinstance(handle, str):
            return shard(handle[key], kind, rank, size, n_head=n_head, padded_vocab=padded_vocab).clone()
        ranges = self._headers[handle]
        return read_shard(lambda dim, lo, hi, out: ranges.read(key, dim, lo, hi, out), self._shape[name], kind,
                          rank, size, n_head=n_head, padded_vocab=padded_vocab, dtype=self.dtype_of(name))


def open_reader(path: str) -> HFReader | ShardedReader:
    """An :class:`HFReader` or a :class:`ShardedReader`, whichever ``path`` holds."""
    if os.path.isdir(path) and is_sharded_dir(path):
        return ShardedReader(path)
    return HFReader(path)


def directory_source(path: str) -> WeightSource:
    """A lazy ``WeightSource`` over an HF GPT-2 directory or a ds_mp sharded directory.

    Names are accepted with or without the ``transformer.`` prefix; floating tensors
    are returned as fp32 (training keeps fp32 master weights; bf16 is DeepSpeed's cast).
    ``get_shard`` reads only the shard's slices (see ``HFReader.get_shard`` /
    ``ShardedReader.get_shard``).
    """
    reader = open_reader(path)

    def fp32(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.is_floating_point() else t

    def get_shard(name: str, kind: str, rank: int, size: int, **meta: int) -> torch.Tensor:
        return fp32(reader.get_shard(name, kind, rank, size, **meta))

    return WeightSource(lambda name: fp32(reader.get(name)), reader.config, get_shard)


def copy_tokenizer(tokenizer_dir: str, out: str) -> None:
    found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, f))]
    if not found:
        raise CheckpointError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...); "
                              "pass the directory the tokenizer was saved to")
    for f in found:
        shutil.copy2(os.path.join(tokenizer_dir, f), os.path.join(out, f))


def write_hf_files(tensors: dict[str, torch.Tensor], cfg: Any, out: str, tokenizer_dir: str | None = None) -> None:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``out``
    from full tensors (true vocab) by HF name.

    With ``tie_word_embeddings`` (the GPT-2 default) ``lm_head.weight`` is omitted, as
    ``save_pretrained`` does; otherwise it is written as a copy of ``wte``.
    """
    import copy

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    want = expected_shapes(cfg)
    if want.keys() != tensors.keys():
        raise CheckpointError(f"{out}: refusing to write an incomplete model (missing "
                              f"{sorted(want.keys() - tensors.keys())[:5]})")
    state = {n: tensors[n].detach().cpu().contiguous() for n in want}
    if not getattr(cfg, "tie_word_embeddings", True):
        state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    cfg = copy.deepcopy(cfg)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.dtype = str(state["transformer.wte.weight"].dtype).removeprefix("torch.")
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out)


def write_hf_streaming(reader: Any, cfg: Any, out: str, tokenizer_dir: str | None = None) -> None:
    """:func:`write_hf_files` from a reader (``get`` and ``dtype_of`` by HF name), one tensor
    at a time: ``model.safetensors`` is streamed, so peak memory is one full tensor."""
    import copy

    from transformers import GenerationConfig

    shapes = expected_shapes(cfg)
    specs = {n: (shape, reader.dtype_of(n)) for n, shape in shapes.items()}
    if not getattr(cfg, "tie_word_embeddings", True):
        specs["lm_head.weight"] = specs["transformer.wte.weight"]
    cfg = copy.deepcopy(cfg)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.dtype = str(specs["transformer.wte.weight"][1]).removeprefix("torch.")
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
    write_safetensors_streaming(os.path.join(out, "model.safetensors"), specs,
                                lambda n: reader.get("transformer.wte.weight" if n == "lm_head.weight" else n))
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out)


def write_hf_dir(tensors: dict[str, torch.Tensor], cfg: Any, out: str, tokenizer_dir: str | None = None,
                 overwrite: bool = False) -> None:
    """:func:`write_hf_files` into a temporary sibling of ``out``, renamed when complete."""
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        raise CheckpointError(f"tokenizer_dir {tokenizer_dir!r} is not a directory")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_hf_files(tensors, cfg, tmp, tokenizer_dir)


def gather_stage(engine: Any) -> dict[str, torch.Tensor]:
    """Collective over the TP group: this stage's full tensors by HF name (on TP rank 0).

    The tied ``wte`` is kept only on stage 0.  Tensors travel as fp32 (gloo lacks bf16).
    """
    pipe, topo = engine.module, engine.topology
    out: dict[str, torch.Tensor] = {}
    for pname, p in pipe.named_parameters():
        name = hf_param_name(pname, pipe)
        if name == "transformer.wte.weight" and topo.pp_rank != 0:
            continue
        local, kind = p.detach().float().contiguous(), tp_kind(name)
        if topo.tp > 1 and kind != "replicated":
            parts = [torch.empty_like(local) for _ in range(topo.tp)] if topo.tp_rank == 0 else None
            dist.gather(local, parts, dst=topo.rank_of(tp=0, pp=topo.pp_rank, dp=topo.dp_rank),
                        group=topo.tp_group)
        else:
            parts = [local]
        if topo.tp_rank == 0:
            out[name] = unshard(parts, kind, n_head=engine.hf_config.n_head,
                                vocab=engine.hf_config.vocab_size).cpu()
    return out


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): every weight by HF name, full (unsharded, true vocab),
    fp32 on CPU, on global rank 0; ``{}`` elsewhere.

    TP shards are gathered to TP rank 0 of each stage of DP replica 0, whose stage dicts are
    gathered over the pipeline group to global rank 0.
    """
    topo = engine.topology
    tensors: dict[str, torch.Tensor] = {}
    if topo.dp_rank == 0:
        tensors = gather_stage(engine)
        if topo.tp_rank == 0 and topo.pp > 1:
            stages = [None] * topo.pp if topo.rank == 0 else None
            dist.gather_object(tensors, stages, dst=0, group=topo.pp_group)
            tensors = {k: v for d in (stages or []) for k, v in d.items()}
    return tensors if topo.rank == 0 else {}


def write_on_rank0(engine: Any, what: str, write: Callable[[], None]) -> None:
    """Collective: global rank 0 runs ``write``; its error, if any, is raised on every rank
    (so no rank waits on a peer that failed) as one ``CheckpointError`` naming ``what``."""
    error = ""
    if engine.topology.rank == 0:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(f"{what} failed on rank 0: {error}")


def save_hf(engine: Any, out_dir: str, tokenizer_dir: str | None = None) -> None:
    """Collective (every rank calls it): global rank 0 writes an HF GPT-2 directory.

    The weights come from :func:`full_state_dict`.  A write error on rank 0 is re-raised on
    every rank.  ``out_dir`` is replaced atomically if it exists.  Weights are written in
    fp32 (a bf16 engine's module weights, upcast exactly).
    """
    tensors = full_state_dict(engine)
    write_on_rank0(engine, f"save_hf to {out_dir!r}", lambda: write_hf_dir(
        tensors, engine.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True))
