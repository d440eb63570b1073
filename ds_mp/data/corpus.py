"""Finding input files and reading them as documents, deterministically.

A *document* is one whole ``.txt`` file (or any explicitly named non-``.jsonl`` file,
read as text) or the ``"text"`` field of one line of a ``.jsonl`` file. Folders are
searched recursively for ``.txt`` and ``.jsonl`` files in sorted path order. Empty
documents are skipped. ``max_bytes`` keeps the deterministic first ``max_bytes`` UTF-8
bytes of the document stream (the last document is cut on a character boundary).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import DataError

FOLDER_SUFFIXES = (".txt", ".jsonl")
ENCODING_ERRORS = ("strict", "replace", "ignore")


def find_files(inputs: Sequence[str]) -> list[str]:
    """Expand files and folders into a sorted, de-duplicated list of input files.

    Contract: explicit files keep their order; a folder contributes its ``.txt``/``.jsonl``
    files in sorted relative-path order; a file named twice is read once. Raises
    :class:`DataError` for no inputs, a missing path, or a folder without input files.
    """
    if not inputs:
        raise DataError("no inputs given; pass .txt/.jsonl files or folders (or --default for the stdlib corpus)")
    files: list[str] = []
    for inp in inputs:
        if os.path.isdir(inp):
            found = []
            for root, dirs, names in os.walk(inp):
                dirs.sort()
                found += [os.path.join(root, n) for n in names if n.endswith(FOLDER_SUFFIXES)]
            if not found:
                raise DataError(f"no .txt or .jsonl files found under {inp!r}; point at a folder with text files")
            files += sorted(found, key=lambda p: os.path.relpath(p, inp).split(os.sep))
        elif os.path.isfile(inp):
            files.append(inp)
        else:
            raise DataError(f"input {inp!r} does not exist; check the path")
    seen: set[str] = set()
    unique = []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def _decode(data: bytes, path: str, errors: str, where: str = "") -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}{where}: not valid UTF-8 (byte {e.start}); convert it to UTF-8 or pass "
            f"encoding_errors='replace' (--encoding-errors replace)"
        ) from None


def _file_documents(path: str, errors: str) -> Iterator[str]:
    """The documents of one file, in order (empty ones skipped)."""
    if not path.endswith(".jsonl"):
        with open(path, "rb") as f:
            data = f.read()
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        text = _decode(data, path, errors)
        if text:
            yield text
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, errors, f":{lineno}").strip()
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); fix or remove the line") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(f'{path}:{lineno}: no string "text" field; each line must be {{"text": "..."}}')
            if text:
                yield text


@dataclass(frozen=True)
class Corpus:
    """A deterministic stream of documents read from ``files``.

    ``encoding_errors`` is passed to ``bytes.decode`` ("strict" raises :class:`DataError`
    naming the file); ``max_bytes`` (None = no limit) caps the UTF-8 size of the stream.
    Iterating twice yields the same documents.
    """

    files: tuple[str, ...]
    encoding_errors: str = "strict"
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.encoding_errors not in ENCODING_ERRORS:
            raise DataError(f"encoding_errors={self.encoding_errors!r} is unknown; use one of {ENCODING_ERRORS}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise DataError(f"max_bytes={self.max_bytes} must be positive; pass None for no limit")

    def documents(self) -> Iterator[tuple[int, str]]:
        """Yield ``(file_index, text)`` for every document, honouring ``max_bytes``."""
        budget = self.max_bytes
        for i, path in enumerate(self.files):
            for text in _file_documents(path, self.encoding_errors):
                if budget is not None:
                    size = len(text.encode("utf-8"))
                    if size > budget:
                        text = text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
                        size = budget
                    budget -= size
                    if not text:
                        return
                yield i, text
                if budget is not None and budget <= 0:
                    return

    def scan(self) -> "CorpusStats":
        """Read the whole stream once: count documents and bytes, hash the content."""
        h = hashlib.sha256()
        docs = nbytes = 0
        used: list[int] = []
        for i, text in self.documents():
            data = text.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
            docs += 1
            nbytes += len(data)
            if not used or used[-1] != i:
                used.append(i)
        return CorpusStats(docs, nbytes, h.hexdigest(), [self.files[i] for i in used])


@dataclass(frozen=True)
class CorpusStats:
    """What :meth:`Corpus.scan` found: document count, UTF-8 bytes, sha256, files used."""

    num_documents: int
    num_bytes: int
    sha256: str
    files_used: list[str]
