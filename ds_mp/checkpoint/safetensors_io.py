"""safetensors files one tensor (or one index range) at a time: a streaming writer whose peak
memory is one tensor, a reader of index ranges straight into caller-provided tensors, and
``safe_open`` with a one-line error naming the file."""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy
import torch
from safetensors import SafetensorError, safe_open

from ds_mp.checkpoint.integrity import CheckpointError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_ST = {v: k for k, v in _DTYPES.items()}


def st_dtype(code: str) -> torch.dtype:
    """torch dtype of a safetensors dtype code (``get_slice(k).get_dtype()``: ``"F32"``...)."""
    if code not in _FROM_ST:
        raise CheckpointError(f"safetensors dtype {code!r} is not supported by ds_mp; convert the weights to fp32")
    return _FROM_ST[code]


def write_safetensors_streaming(path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                                produce: Any, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file tensor by tensor: the header from ``specs`` (name -> (shape,
    dtype), in file order), then ``produce(name)`` for each name, written and dropped before
    the next, so peak memory is one tensor (``safetensors.torch.save_file`` needs them all)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (shape, dtype) in specs.items():
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, (shape, dtype) in specs.items():
            t = produce(name).detach().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: {name} produced shape {list(t.shape)}, expected {list(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SafetensorsRanges:
    """Index ranges of the tensors of one safetensors file, read with ``os.preadv`` straight
    into caller-provided tensors.

    No memory map: ``safe_open``'s map keeps every page a read touched counted in this
    process' resident memory until the handle is collected (a 98 MiB ``wte`` shard read
    through it cost 98 MiB of file pages on top of the shard), and a ``get_slice`` returns a
    new tensor that the caller then copies into place.  Here reading a shard costs the shard.
    Only the header is parsed here; ``open_safetensors`` validates the file (truncation...).
    ``counter[0]`` adds the elements read."""

    def __init__(self, path: str, counter: list[int] | None = None) -> None:
        self.path, self.counter = path, counter
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.data_start = 8 + n
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}

    def read(self, key: str, dim: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """Write the stored tensor ``key``'s index range ``[lo, hi)`` along ``dim`` into ``out``
        (shape: the stored shape with ``hi - lo`` along ``dim``; a view with a contiguous last
        dim, e.g. a ``narrow`` of a fresh tensor).  The range is ``prod(shape[:dim])``
        contiguous runs of the file: one read each."""
        entry = self.entries[key]
        shape, begin = entry["shape"], entry["data_offsets"][0]
        if entry["dtype"] != _DTYPES.get(out.dtype):
            raise CheckpointError(f"{self.path}: {key} is stored as {entry['dtype']}, read into {out.dtype}")
        expect = [*shape[:dim], hi - lo, *shape[dim + 1:]]
        if list(out.shape) != expect:
            raise CheckpointError(f"{self.path}: {key}[{lo}:{hi}] along dim {dim} has shape {expect}, "
                                  f"destination {list(out.shape)}")
        item, inner = out.element_size(), math.prod(shape[dim + 1:])
        outer = math.prod(shape[:dim])
        # the destination's bytes as a numpy array sharing its memory: one row per contiguous run
        dest = out.view(_INT_OF_SIZE[item]).numpy()
        rows = dest.reshape(outer, (hi - lo) * inner)
        if rows.size and not numpy.may_share_memory(rows, dest):  # reshape copied: out is not such a view
            raise ValueError(f"SafetensorsRanges.read: destination strides {out.stride()} are not a range view")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for j in range(outer):
                row = memoryview(rows[j]).cast("B")
                offset, done = self.data_start + begin + (j * shape[dim] + lo) * inner * item, 0
                while done < len(row):
                    got = os.preadv(fd, [row[done:]], offset + done)
                    if got <= 0:
                        raise CheckpointError(f"{self.path}: {key} ends early; the file is truncated, re-create "
                                              "or re-copy it")
                    done += got
        finally:
            os.close(fd)
        if self.counter is not None:
            self.counter[0] += out.numel()


def open_safetensors(path: str) -> Any:
    """``safe_open`` with a one-line error naming the file (missing, truncated, corrupt)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file missing; the checkpoint is incomplete, re-create or re-copy it")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the file is truncated "
                              "or corrupt, re-create or re-copy it") from None


__all__ = ["st_dtype", "write_safetensors_streaming", "SafetensorsRanges", "open_safetensors"]
