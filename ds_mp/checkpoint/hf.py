"""Hugging Face model directories in and out (any family of ``ds_mp.config.families.FAMILIES``).

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
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_mp import deepspeed_compat as compat
from ds_mp.atomic import atomic_dir
from ds_mp.checkpoint.experts import FusedExperts
from ds_mp.checkpoint.safetensors_io import SafetensorsRanges, open_safetensors, st_dtype, write_safetensors_streaming
from ds_mp.checkpoint.sharded import CheckpointError, ShardedReader, expected_shapes, is_sharded_dir
from ds_mp.models.family import family_named, family_of, untied_as_hf_loads
from ds_mp.models.pipeline import hf_param_name, is_tied_copy
from ds_mp.models.weights import WeightSource
from ds_mp.tensor_parallel.sharding import EXPERT_KINDS, REPLICATED, read_shard, shard, unshard
from ds_mp.engine_view import EngineView

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def read_hf_config(path: str) -> Any:
    """The HF config of an HF directory, refusing model types (and non-causal-LM architectures) that
    no family of ds_mp handles."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; give an HF model directory (save_pretrained) "
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
    try:
        family = family_named(raw.get("model_type"))
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    arch = [a for a in raw.get("architectures") or [] if a not in family.architectures]
    if arch:
        raise CheckpointError(f"{cfg_path}: architectures {arch}; ds_mp trains causal LMs "
                              f"({', '.join(family.architectures)}): export the base model")
    return family.config_from_dict(raw)


class HFReader:
    """Validated, lazy access to the tensors of an HF model directory by canonical name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = read_hf_config(path)
        self.family = family_of(self.config)
        self._where: dict[str, tuple[Any, str]] = {}  # canonical name -> (source, stored key)
        self._shape: dict[str, tuple[int, ...]] = {}
        self.elements_read = [0]  # tensor elements read through get_shard (safetensors ranges)
        self._headers: dict[str, SafetensorsRanges] = {}  # safetensors file -> its parsed header
        self._experts = FusedExperts(self._read_range, self._key_dtype)  # the Hub's per-expert keys, fused
        for file in self._weight_files():
            self._index(file)
        for name in self._experts.names():
            self._where[name], self._shape[name] = (self._experts, name), self._experts.shape(name)
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
            if self.family.ignored(key):
                continue
            name = self.family.canonical_name(key)
            part = self.family.expert_part(name)
            if part is not None:
                self._experts.add(*part, handle, key, shape)
                continue
            self._where[name], self._shape[name] = (handle, key), shape

    def _read_range(self, handle: Any, key: str, dim: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """The stored tensor ``key``'s range [lo, hi) along ``dim`` into ``out`` (safetensors: only that range)."""
        if isinstance(handle, str):
            self._headers[handle].read(key, dim, lo, hi, out)
        else:
            out.copy_(handle[key].narrow(dim, lo, hi - lo))

    def _key_dtype(self, handle: Any, key: str) -> torch.dtype:
        return st_dtype(self._headers[handle].entries[key]["dtype"]) if isinstance(handle, str) else handle[key].dtype

    def _raw(self, name: str) -> torch.Tensor:
        handle, key = self._where[name]
        if isinstance(handle, FusedExperts):
            return handle.full(key)
        return open_safetensors(handle).get_tensor(key) if isinstance(handle, str) else handle[key]

    def _validate(self) -> None:
        head, embedding = self.family.head_and_embedding()
        if (head in self._shape and embedding in self._shape and getattr(self.config, "tie_word_embeddings", True)
                and not torch.equal(self._raw(head), self._raw(embedding))):
            self.config = untied_as_hf_loads(self.config, self.path)  # HF's from_pretrained loads them untied
        want = expected_shapes(self.config)
        have = set(self._shape) - ({head} - set(want))  # a head stored beside a tied embedding (equal to it)
        if want.keys() - have:
            raise CheckpointError(f"{self.path}: missing tensors {sorted(want.keys() - have)[:5]}; the "
                                  "checkpoint does not match its config.json (n_layer?)")
        if have - want.keys():
            raise CheckpointError(f"{self.path}: unexpected tensors {sorted(have - want.keys())[:5]}; not a "
                                  f"plain {self.family.architecture(self.config)} checkpoint for this config.json")
        for name, shape in want.items():
            if self._shape[name] != shape:
                raise CheckpointError(f"{self.path}: {name} has shape {list(self._shape[name])} but config.json "
                                      f"implies {list(shape)}; the weights and config.json disagree")
        if head in self._shape and head not in want and not getattr(self.config, "tie_word_embeddings", True):
            if not torch.equal(self._raw(head), self._raw(embedding)):
                raise CheckpointError(f"{self.path}: {head} is untied from {embedding}; ds_mp ties the LM "
                                      "head to the embedding for this config, so this checkpoint cannot be loaded")

    def get(self, name: str) -> torch.Tensor:
        name = self.family.canonical_name(name)
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this {self.family.name} checkpoint")
        return self._raw(name)

    def dtype_of(self, name: str) -> torch.dtype:
        handle, key = self._where[self.family.canonical_name(name)]
        return handle.dtype_of(key) if isinstance(handle, FusedExperts) else self._key_dtype(handle, key)

    def get_shard(self, name: str, kind: str, rank: int, size: int, *, n_head: int = 0,
                  padded_vocab: int = 0) -> torch.Tensor:
        """``shard(get(name), kind, rank, size, ...)``: from safetensors only the rows/columns
        of this shard are read, straight into the shard (:class:`SafetensorsRanges`; the three
        q|k|v column ranges of ``c_attn``, the vocab rows); a ``pytorch_model.bin`` is
        memory-mapped and cut after a full read."""
        name = self.family.canonical_name(name)
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this {self.family.name} checkpoint")
        handle, key = self._where[name]
        if isinstance(handle, dict):
            return shard(handle[key], kind, rank, size, n_head=n_head, padded_vocab=padded_vocab).clone()
        read = handle.read if isinstance(handle, FusedExperts) else self._headers[handle].read
        return read_shard(lambda dim, lo, hi, out: read(key, dim, lo, hi, out), self._shape[name], kind,
                          rank, size, n_head=n_head, padded_vocab=padded_vocab, dtype=self.dtype_of(name))


def open_reader(path: str) -> HFReader | ShardedReader:
    """An :class:`HFReader` or a :class:`ShardedReader`, whichever ``path`` holds."""
    if os.path.isdir(path) and is_sharded_dir(path):
        return ShardedReader(path)
    return HFReader(path)


def directory_source(path: str, verify_weights: bool = False) -> WeightSource:
    """A lazy ``WeightSource`` over an HF model directory or a ds_mp sharded directory.

    Names are accepted with or without the ``transformer.`` prefix; floating tensors
    are returned as fp32 (training keeps fp32 master weights; bf16 is DeepSpeed's cast).
    ``get_shard`` reads only the shard's slices (see ``HFReader.get_shard`` /
    ``ShardedReader.get_shard``).  ``verify_weights``: check every model file of a ds_mp
    directory against its manifest now (a damaged one raises here, before any collective,
    instead of on the ranks that happen to read it while the model is built).
    """
    reader = open_reader(path)
    if verify_weights and isinstance(reader, ShardedReader):
        import glob

        reader.verify_files(sorted(glob.glob(os.path.join(path, "model-*.safetensors"))))

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


def generation_config(cfg: Any, tokenizer_dir: str | None = None) -> Any:
    """The model's ``GenerationConfig``; when the tokenizer in ``tokenizer_dir`` has a chat template,
    its end-of-turn token(s) (``<|im_end|>``, ``<|eot_id|>``: :func:`ds_mp.data.sft_format.end_of_turn_ids`)
    come first in ``eos_token_id``, the model's eos after them (a list when several), so
    ``generate()`` stops where a fine-tuned model was trained to end its turn."""
    from transformers import AutoTokenizer, GenerationConfig

    from ds_mp.data.sft_format import end_of_turn_ids

    gen = GenerationConfig.from_model_config(cfg)
    if not tokenizer_dir:
        return gen
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError):  # no loadable tokenizer: the model's eos as it is
        return gen
    ends = end_of_turn_ids(tok)
    if ends:
        base = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        ids = list(dict.fromkeys([*ends, *(i for i in base if i is not None)]))
        gen.eos_token_id = ids[0] if len(ids) == 1 else ids
    return gen


def write_hf_files(tensors: dict[str, torch.Tensor], cfg: Any, out: str, tokenizer_dir: str | None = None) -> None:
    """Write ``config.json``, ``generation_config.json`` (:func:`generation_config`) and
    ``model.safetensors`` into ``out`` from full tensors (true vocab) by HF name.

    A tied head is omitted, as ``save_pretrained`` does; a GPT-2 config with
    ``tie_word_embeddings`` false gets ``lm_head.weight`` as a copy of ``wte`` (ds_mp ties it).
    """
    import copy

    from safetensors.torch import save_file

    want = expected_shapes(cfg)
    if want.keys() != tensors.keys():
        raise CheckpointError(f"{out}: refusing to write an incomplete model (missing "
                              f"{sorted(want.keys() - tensors.keys())[:5]})")
    state = {n: tensors[n].detach().cpu().contiguous() for n in want}
    family = family_of(cfg)
    head, embedding = family.head_and_embedding()
    if head not in want and not getattr(cfg, "tie_word_embeddings", True):
        state[head] = state[embedding].clone()
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [family.architecture(cfg)]
    cfg.dtype = str(state[embedding].dtype).removeprefix("torch.")
    cfg.save_pretrained(out)
    generation_config(cfg, tokenizer_dir).save_pretrained(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out)


def write_hf_streaming(reader: Any, cfg: Any, out: str, tokenizer_dir: str | None = None) -> None:
    """:func:`write_hf_files` from a reader (``get`` and ``dtype_of`` by HF name), one tensor
    at a time: ``model.safetensors`` is streamed, so peak memory is one full tensor."""
    import copy

    shapes, family = expected_shapes(cfg), family_of(cfg)
    head, embedding = family.head_and_embedding()
    specs = {n: (shape, reader.dtype_of(n)) for n, shape in shapes.items()}
    if head not in shapes and not getattr(cfg, "tie_word_embeddings", True):
        specs[head] = specs[embedding]
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [family.architecture(cfg)]
    cfg.dtype = str(specs[embedding][1]).removeprefix("torch.")
    cfg.save_pretrained(out)
    generation_config(cfg, tokenizer_dir).save_pretrained(out)
    write_safetensors_streaming(os.path.join(out, "model.safetensors"), specs,
                                lambda n: reader.get(embedding if n == head and head not in shapes else n))
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out)


def write_hf_dir(tensors: dict[str, torch.Tensor], cfg: Any, out: str, tokenizer_dir: str | None = None,
                 overwrite: bool = False) -> None:
    """:func:`write_hf_files` into a temporary sibling of ``out``, renamed when complete."""
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        raise CheckpointError(f"tokenizer_dir {tokenizer_dir!r} is not a directory")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_hf_files(tensors, cfg, tmp, tokenizer_dir)


def gather_stage(engine: EngineView, masters: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Collective over the TP group: this stage's full tensors by HF name (on TP rank 0).

    ``masters`` (id(parameter) -> fp32 master weight) replaces the module weights it covers.
    A tied embedding is kept only on stage 0.  Tensors travel as fp32 (gloo lacks bf16).
    """
    pipe, topo = engine.module, engine.topology
    out: dict[str, torch.Tensor] = {}
    for pname, p in pipe.named_parameters():
        name = hf_param_name(pname, pipe)
        if is_tied_copy(pname, topo.pp_rank):
            continue
        local, kind = (masters or {}).get(id(p), p).detach().float().contiguous(), pipe.family.tp_kind(name)
        if p.tp_kind in EXPERT_KINDS:  # cut by the run's expert layout (ds_mp.moe), which the plan cannot name
            kind = p.tp_kind
        if topo.tp > 1 and kind not in REPLICATED:
            parts = [torch.empty_like(local) for _ in range(topo.tp)] if topo.tp_rank == 0 else None
            dist.gather(local, parts, dst=topo.peer(tp=0),
                        group=topo.tp_group)
        else:
            parts = [local]
        if topo.tp_rank == 0:
            out[name] = unshard(parts, kind, n_head=pipe.family.heads(name, engine.hf_config),
                                vocab=engine.hf_config.vocab_size).cpu()
    return out


def full_state_dict(engine: EngineView) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): every weight by HF name, full (unsharded, true vocab),
    fp32 on CPU, on global rank 0; ``{}`` elsewhere.

    TP shards are gathered to TP rank 0 of each stage of DP replica 0, whose stage dicts are
    gathered over the pipeline group to global rank 0.
    """
    topo = engine.topology
    tensors: dict[str, torch.Tensor] = {}
    # bf16/fp16/ZeRO: the fp32 masters the optimizer steps, not the module's rounded copies
    masters = compat.master_weights(engine.module, engine.optimizer)  # collective over DP
    if topo.grad_rank == 0:  # one copy of the weights: dp and cp peers hold the same
        tensors = gather_stage(engine, masters)
        if topo.tp_rank == 0 and topo.pp > 1:
            stages = [None] * topo.pp if topo.rank == 0 else None
            dist.gather_object(tensors, stages, dst=0, group=topo.pp_group)
            tensors = {k: v for d in (stages or []) for k, v in d.items()}
    return tensors if topo.rank == 0 else {}


def write_on_rank0(engine: EngineView, what: str, write: Callable[[], None]) -> None:
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


def save_hf(engine: EngineView, out_dir: str, tokenizer_dir: str | None = None) -> None:
    """Collective (every rank calls it): global rank 0 writes an HF model directory.

    The weights come from :func:`full_state_dict`.  A write error on rank 0 is re-raised on
    every rank.  ``out_dir`` is replaced atomically if it exists.  Weights are written in
    fp32: the optimizer's fp32 master weights under bf16/fp16/ZeRO (not the module's rounded copies).
    """
    tensors = full_state_dict(engine)
    write_on_rank0(engine, f"save_hf to {out_dir!r}", lambda: write_hf_dir(
        tensors, engine.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True))
