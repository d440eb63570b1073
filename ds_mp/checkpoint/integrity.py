"""Checkpoint integrity: a CRC32C of every file, written at save, verified before a file is used.

    DIR/ds_mp_manifest.json
      {"format": "ds_mp.manifest", "version": 1, "algorithm": "crc32c",
       "files": {"<file>": {"size": <bytes>, "crc32c": "<8 hex>",
                            "header": [<bytes>, "<8 hex>"]},      # safetensors files only
                 ...},                                             # every other file of DIR
       "crc32c": "<8 hex>"}                                        # of the "files" object itself

The checksum is CRC32C (Castagnoli, the one TensorFlow's checkpoint bundles and GCS use),
computed by ``google-crc32c``'s C code (SSE4.2 / ARMv8 CRC instructions: 10.6 GB/s here
in memory, 2.7x zlib's CRC32) over the whole file, streamed in ``CHUNK`` pieces, so checking
a file costs one sequential read of it (which bounds the speed: ~2 GB/s from the page cache)
and no memory beyond one chunk.  A CRC
catches every burst of damage up to 32 bits and all but 2^-32 of the rest; it is not a
defence against someone who edits the checkpoint on purpose (that would need a keyed hash).

Writers record the files they wrote (:func:`file_entries`, each rank its own, reading them back
while they are in the page cache) and the committing rank writes the manifest
(:func:`write_manifest`; files nobody reported are read by it).  Readers open the manifest
first (:meth:`Manifest.open`: its own CRC is checked), then each file as it is used: its
size (a missing or truncated file is named as such), the header of each safetensors file
whenever it is parsed (:meth:`Manifest.check_header`: a few KB; a sharded reader parses every
header up front), and the whole file the first time data is read from it
(:meth:`Manifest.verify`, once per file and reader).  A mismatch raises :class:`CheckpointError` naming the file and what to do.
Files ds_mp does not read (``config.json``, kept for HF tools) are not checked.

Which files a rank verifies: the ones it reads, whole.  A rank that needs a slice of a
shard (resharding to a larger TP) checks the whole shard, so at TP 8 from TP 1 every rank
reads each file it touches in full once more (measured: ~1.14x the CPU seconds of an
unverified GPT-2-small load at TP 1 and TP 2, ``benchmarks/checkpoint_integrity.py``).
The alternative, ranks splitting the files between them, reads each file once in total but
lets a rank use bytes another rank checked, which is wrong where ranks read different copies
(node-local disks).  ``load_checkpoint(..., verify=False)`` / ``ShardedReader(path,
verify=False)`` skip every check, for checkpoints too large to read twice.

A directory without a manifest was written by a ds_mp older than this module: it loads,
with a warning (:func:`warn_unverified`), unless its ``ds_mp_meta.json`` says a manifest was
written (then the manifest was lost: refused).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Iterable

import google_crc32c

MANIFEST = "ds_mp_manifest.json"
FORMAT, VERSION, ALGORITHM = "ds_mp.manifest", 1, "crc32c"
CHUNK = 1 << 20  # bytes per read: checksumming is bound by the read (page cache ~2.4 GB/s here, read + CRC
#                  ~2.1 GB/s at 0.5-1 MiB; 4-16 MiB chunks, out of the L2 cache, measured 1.2-1.3 GB/s)
DAMAGED = "the checkpoint is damaged: resume from an earlier tag, or re-copy or re-save it"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and the fix."""


def crc32c(path: str, limit: int | None = None) -> tuple[int, int]:
    """``(CRC32C, bytes read)`` of the first ``limit`` bytes of ``path`` (all without a
    limit), read sequentially ``CHUNK`` bytes at a time."""
    crc, done = 0, 0
    with open(path, "rb", buffering=0) as f:
        while limit is None or done < limit:
            chunk = f.read(CHUNK if limit is None else min(CHUNK, limit - done))
            if not chunk:
                break
            crc = google_crc32c.extend(crc, chunk)
            done += len(chunk)
    return crc, done


def _hex(crc: int) -> str:
    return f"{crc:08x}"


def _header_length(path: str) -> int | None:
    """Bytes of a safetensors file's header (8-byte length + JSON), None if not readable."""
    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) < 8:
        return None
    n = 8 + int.from_bytes(raw, "little")
    return n if n <= os.path.getsize(path) else None


def file_entry(path: str) -> dict[str, Any]:
    """The manifest entry of one file: size, CRC32C, and for safetensors its header's CRC."""
    crc, size = crc32c(path)
    entry: dict[str, Any] = {"size": size, "crc32c": _hex(crc)}
    if path.endswith(".safetensors"):
        n = _header_length(path)
        if n is not None:
            entry["header"] = [n, _hex(crc32c(path, n)[0])]
    return entry


def file_entries(paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries of ``paths`` (files of one checkpoint directory), by file name."""
    return {os.path.basename(p): file_entry(p) for p in paths}


def _files_crc(files: dict[str, Any]) -> str:
    return _hex(google_crc32c.value(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()))


def write_manifest(directory: str, known: dict[str, dict[str, Any]] | None = None) -> None:
    """Write ``directory/ds_mp_manifest.json`` covering every file in ``directory``: the
    ``known`` entries (computed by the ranks that wrote those files) and, for any other
    file, one computed here.  Called last, before the directory is committed."""
    files = dict(known or {})
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name != MANIFEST and name not in files and os.path.isfile(path):
            files[name] = file_entry(path)
    stale = sorted(n for n in files if not os.path.isfile(os.path.join(directory, n)))
    if stale:
        raise CheckpointError(f"{directory}: files {stale} were reported written but are not there")
    doc = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM,
           "files": dict(sorted(files.items())), "crc32c": _files_crc(files)}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def warn_unverified(directory: str) -> None:
    """The warning for a checkpoint written before manifests existed (its files load unchecked)."""
    warnings.warn(f"ds_mp: {directory} has no {MANIFEST} (written by an older ds_mp): its files are loaded "
                  "without checksums, so damage may go unnoticed; save it again to add one", stacklevel=3)


class Manifest:
    """The manifest of one checkpoint directory, checked against the files as they are used."""

    def __init__(self, directory: str, files: dict[str, dict[str, Any]]) -> None:
        self.directory, self.files = directory, files
        self.verified: set[str] = set()  # file names whose whole CRC matched

    @classmethod
    def open(cls, directory: str) -> "Manifest | None":
        """The directory's manifest, None if it has none; its own CRC is checked."""
        path = os.path.join(directory, MANIFEST)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                doc = json.load(f)
            files = doc["files"]
            ok = (doc["format"], doc["version"], doc["algorithm"]) == (FORMAT, VERSION, ALGORITHM) \
                and doc["crc32c"] == _files_crc(files)
        except (ValueError, KeyError, TypeError):  # json's errors are ValueErrors (bad UTF-8 too)
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: not a valid {FORMAT} version {VERSION} (unreadable, or its own "
                                  f"checksum does not match); {DAMAGED}")
        return cls(directory, files)

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self.files:
            raise CheckpointError(f"{os.path.join(self.directory, name)}: not listed in {MANIFEST}, so it was "
                                  f"not written with this checkpoint; {DAMAGED}")
        return self.files[name]

    def check_size(self, name: str) -> None:
        """``name`` exists with the size the manifest records (missing / truncated / grown)."""
        path, want = os.path.join(self.directory, name), self._entry(name)["size"]
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: file missing (listed in {MANIFEST}); {DAMAGED}")
        size = os.path.getsize(path)
        if size != want:
            what = "truncated" if size < want else "longer than saved"
            raise CheckpointError(f"{path}: {what} ({size} bytes, saved with {want}); {DAMAGED}")

    def check_header(self, path: str) -> None:
        """A safetensors file's header (dtypes, shapes, offsets) is as saved: a few KB read,
        before anything trusts it."""
        name = os.path.basename(path)
        header = self._entry(name).get("header")
        if name in self.verified or header is None:
            return
        self.check_size(name)
        got = _hex(crc32c(path, header[0])[0])
        if got != header[1]:
            raise CheckpointError(f"{path}: header checksum mismatch (crc32c {got}, saved {header[1]}); {DAMAGED}")

    def verify(self, path: str) -> None:
        """The whole file ``path`` is as saved (its CRC32C, one streamed read); once per file."""
        name = os.path.basename(path)
        if name in self.verified:
            return
        entry = self._entry(name)
        self.check_size(name)
        crc, _ = crc32c(path)
        if _hex(crc) != entry["crc32c"]:
            raise CheckpointError(f"{path}: checksum mismatch (crc32c {_hex(crc)}, saved {entry['crc32c']}); "
                                  f"{DAMAGED}")
        self.verified.add(name)


def load_torch(path: str, manifest: Manifest | None) -> Any:
    """``torch.load(path, weights_only=True)`` of a checkpoint file, verified first; any failure
    (missing, truncated, not a weights-only pickle) is one :class:`CheckpointError` naming it."""
    import torch

    if manifest is not None:
        manifest.verify(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file missing; {DAMAGED}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"{DAMAGED}") from None
