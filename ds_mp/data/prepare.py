"""Build a pre-encoded token dataset from text files (``ds-mp prepare-data``).

Output layout of ``out_dir`` (written atomically: built in a temporary sibling folder and
renamed into place at the end, so a failure leaves no ``out_dir``)::

    tokens.bin       training tokens, raw little-endian uint16 (vocab < 65536) or uint32
    val_tokens.bin   validation tokens: held-out whole documents, same dtype
    meta.json        dtype, token/document counts, vocab size, eos id, sources, sha256
    tokenizer/       the tokenizer (``AutoTokenizer.from_pretrained`` loads it)

Within each split documents keep their corpus order and are joined by one eos token:
``d1 <eos> d2 <eos> ... dn`` (no eos inside a document, none at the ends).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import dataclasses
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ds_mp.atomic import commit_dir

from .corpus import Corpus, find_files
from .errors import DataError
from .tokenizer import data_encoder, load_tokenizer, train_tokenizer

META_FILE = "meta.json"
TRAIN_FILE = "tokens.bin"
VAL_FILE = "val_tokens.bin"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1
_ENCODE_BATCH_BYTES = 4 << 20


@dataclass(frozen=True)
class DatasetInfo:
    """The contents of ``meta.json`` plus the dataset's location (``path``)."""

    path: str  # absolute dataset directory (not stored in meta.json)
    dtype: str  # "uint16" or "uint32"
    vocab_size: int  # len(tokenizer), including added special tokens
    eos_id: int  # separator token written between documents
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    sha256: str  # of the document texts that went in (after max_bytes)
    source_files: list[str] = field(default_factory=list)
    tokenizer_source: str | None = None  # HF dir the tokenizer came from; None = trained here
    max_bytes: int | None = None
    val_fraction: float = 0.0
    seed: int = 0
    format_version: int = FORMAT_VERSION
    format: str = "stream"  # "stream" (documents joined by eos, cut into chunks) or an SFT format (ds_mp.data.sft)
    sft: dict[str, Any] | None = None  # SFT datasets: pad id, overlong policy and counts (ds_mp.data.sft_prepare)

    @property
    def tokenizer_dir(self) -> str:
        """Directory of the dataset's tokenizer (load with ``AutoTokenizer.from_pretrained``)."""
        return os.path.join(self.path, TOKENIZER_DIR)

    @classmethod
    def load(cls, path: str) -> "DatasetInfo":
        """Read ``path/meta.json``; raises :class:`DataError` if it is missing or malformed."""
        meta = os.path.join(path, META_FILE)
        if not os.path.isfile(meta):
            raise DataError(f"{path!r} is not a ds_mp dataset (no {META_FILE}); build it with `ds-mp prepare-data`")
        try:
            with open(meta, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(f"{meta}: unreadable ({type(e).__name__}: {e}); rebuild the dataset with "
                            "ds-mp prepare-data") from e
        if not isinstance(d, dict):
            raise DataError(f"{meta}: holds a JSON {type(d).__name__}, not an object; rebuild the dataset")
        if d.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{meta}: format_version {d.get('format_version')} != {FORMAT_VERSION}; rebuild the dataset")
        d.pop("tokenizer_dir", None)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "path"}
        required = [n for n, f in fields.items() if f.default is MISSING and f.default_factory is MISSING]
        problems = [f"{what} keys {keys}" for what, keys in (("missing", [k for k in required if k not in d]),
                                                             ("unknown", sorted(set(d) - set(fields)))) if keys]
        if problems:
            raise DataError(f"{meta}: {'; '.join(problems)}; rebuild the dataset with ds-mp prepare-data")
        return cls(path=os.path.abspath(path), **d)

    def to_json(self) -> str:
        d = asdict(self)
        del d["path"]
        d["tokenizer_dir"] = TOKENIZER_DIR
        return json.dumps(d, indent=2) + "\n"


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"output path {out_dir!r} exists and is a file; remove it or choose another --out")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise DataError(f"output dir {out_dir!r} already exists; pass overwrite=True (--overwrite) or another --out")


def _split_documents(n: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the held-out validation documents: a seeded random subset of size round(n * f) (>= 1 if f > 0)."""
    if val_fraction == 0:
        return set()
    k = max(1, round(n * val_fraction))
    if k >= n:
        raise DataError(
            f"val_fraction={val_fraction} leaves no training documents ({n} documents); "
            f"lower --val-fraction (0 disables validation) or add documents"
        )
    return set(np.random.default_rng(seed).permutation(n)[:k].tolist())


def _batches(docs: Iterator[tuple[int, str]], val: set[int]) -> Iterator[list[tuple[bool, str]]]:
    """Group documents (tagged is_val) into batches of about 4 MB for ``encode_batch``."""
    batch: list[tuple[bool, str]] = []
    size = 0
    for j, (_, text) in enumerate(docs):
        batch.append((j in val, text))
        size += len(text)
        if size >= _ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def prepare_data(
    inputs: Sequence[str],
    out_dir: str,
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    max_bytes: int | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    *,
    encoding_errors: str = "strict",
    overwrite: bool = False,
    show_progress: bool = True,
) -> DatasetInfo:
    """Encode the documents of ``inputs`` into a token dataset at ``out_dir``.

    ``tokenizer`` is an HF checkpoint/tokenizer directory to use (``vocab_size`` is then
    ignored); None trains a byte-level BPE of ``vocab_size`` on the training documents.
    ``val_fraction`` of the documents (seeded by ``seed``) are held out whole as the
    validation split. Contract: deterministic for the same inputs and arguments; the
    output appears atomically; errors are :class:`DataError` with a one-line fix.
    """
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1); e.g. --val-fraction 0.01")
    _check_out_dir(out_dir, overwrite)
    corpus = Corpus(tuple(find_files(inputs)), encoding_errors, max_bytes)
    stats = corpus.scan()
    if stats.num_documents == 0:
        raise DataError(f"inputs contain no text ({len(corpus.files)} files, all empty); pass non-empty files")
    val = _split_documents(stats.num_documents, val_fraction, seed)

    out_dir = os.path.abspath(out_dir)
    with staging_dir(out_dir, overwrite) as tmp:
        tok_dir = os.path.join(tmp, TOKENIZER_DIR)
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer)
            tok.save_pretrained(tok_dir)
        else:
            train_docs = (t for j, (_, t) in enumerate(corpus.documents()) if j not in val)
            tok = train_tokenizer(train_docs, vocab_size, tok_dir, stats.num_documents - len(val), show_progress)
        vocab, eos = len(tok), int(tok.eos_token_id)
        dtype = np.uint16 if vocab < 65536 else np.uint32
        encoder = data_encoder(tok)
        counts = {False: 0, True: 0}  # tokens per split (key: is_val)
        ndocs = {False: 0, True: 0}
        with open(os.path.join(tmp, TRAIN_FILE), "wb") as ftrain, open(os.path.join(tmp, VAL_FILE), "wb") as fval, \
                tqdm(total=stats.num_bytes, unit="B", unit_scale=True, desc="encoding", disable=not show_progress) as bar:
            for batch in _batches(corpus.documents(), val):
                encoded = encoder.encode_batch([t for _, t in batch], add_special_tokens=False)
                for (is_val, text), enc in zip(batch, encoded):
                    ids = enc.ids if ndocs[is_val] == 0 else [eos, *enc.ids]
                    (fval if is_val else ftrain).write(np.asarray(ids, dtype=dtype).tobytes())
                    counts[is_val] += len(ids)
                    ndocs[is_val] += 1
                    bar.update(len(text.encode("utf-8")))
        info = DatasetInfo(
            path=out_dir, dtype=np.dtype(dtype).name, vocab_size=vocab, eos_id=eos,
            train_tokens=counts[False], val_tokens=counts[True],
            train_documents=ndocs[False], val_documents=ndocs[True], sha256=stats.sha256,
            source_files=[os.path.abspath(f) for f in stats.files_used], tokenizer_source=tokenizer,
            max_bytes=max_bytes, val_fraction=val_fraction, seed=seed,
        )
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            f.write(info.to_json())
    return info


@contextlib.contextmanager
def staging_dir(out_dir: str, overwrite: bool) -> Iterator[str]:
    """A temporary sibling of ``out_dir`` to build a dataset in, renamed onto ``out_dir`` when the
    block ends without an exception (removed otherwise): the dataset appears whole or not at all."""
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the result normal permissions
        yield tmp
        _publish(tmp, out_dir, overwrite)
    except OSError as e:  # a full disk, a quota, a read-only mount: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot write the dataset {out_dir!r}: {e.strerror or e}; nothing was written: free "
                        "space (or choose another --out) and run prepare-data again") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out_dir`` (replacing an old one only if ``overwrite``)."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    try:
        commit_dir(tmp, out_dir, overwrite=overwrite)  # fsync, then rename (the old one kept until then)
    except FileExistsError:
        raise DataError(f"output dir {out_dir!r} appeared while building; pass --overwrite or another --out") from None
