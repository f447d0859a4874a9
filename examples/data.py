"""Training text that exists on every machine, as byte-level token streams.

The corpus is the Python standard library's own ``.py`` sources
(``sysconfig.get_paths()["stdlib"]``, test suites and third-party packages left out),
in sorted path order. Every ``heldout_every``-th file (by that order) is held out, so the
split is by file and the same on every run. A second, clearly different corpus (for the
multi-teacher example, ``examples/mopd.py``) is the documentation that installed packages
ship (:func:`load_docs_corpus`): package descriptions and ``.txt`` / ``.rst`` / ``.md`` /
``.html`` files, prose and markup rather than code. Token ids follow
:func:`devtools.tiny_model.byte_tokenizer`: ids 0..255 are the bytes, files are
separated by ``<|endoftext|>`` (256).

The teacher's pretraining and the distillation demo both draw ``[B, T]`` windows from
these streams with :class:`WindowSampler` (random, seeded) or :func:`fixed_windows`
(evenly spaced, for evaluation).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "EOT_ID",
    "NUM_TOKENS",
    "PAD_ID",
    "ByteCorpus",
    "WindowSampler",
    "decode_bytes",
    "encode_bytes",
    "fixed_windows",
    "join_documents",
    "load_docs_corpus",
    "load_stdlib_corpus",
    "package_doc_files",
    "split_documents",
    "stdlib_root",
    "stdlib_source_files",
    "tokenize_corpus",
]

#: ``<|endoftext|>``: separates files in a stream.
EOT_ID = 256
#: ``<|pad|>``: never appears in a stream.
PAD_ID = 257
#: Ids the byte tokenizer defines (the model's vocabulary may be padded beyond this).
NUM_TOKENS = 258

#: Directory names skipped under the stdlib root: other people's packages, and the test
#: suites (which some distributions do not ship, so leaving them out keeps the corpus
#: alike across machines).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)

TokenStream = npt.NDArray[np.uint16]


def stdlib_root() -> Path:
    """Where this interpreter's standard library sources live."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """``.py`` files under ``root`` (default :func:`stdlib_root`), sorted by relative path,
    without those under :data:`EXCLUDED_DIRS`."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"root: {base} is not a directory")
    files = [
        p
        for p in base.rglob("*.py")
        if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(base).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def encode_bytes(data: bytes | str) -> TokenStream:
    """Byte-level ids of ``data`` (``str`` is encoded as UTF-8)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)


def decode_bytes(ids: Sequence[int] | npt.NDArray[Any] | torch.Tensor) -> str:
    """Text of byte ids; ``<|endoftext|>`` becomes a newline, other specials are dropped."""
    arr = np.asarray(ids.tolist() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
    arr = np.where(arr == EOT_ID, ord("\n"), arr)
    return bytes(arr[(arr >= 0) & (arr < 256)].astype(np.uint8)).decode("utf-8", "replace")


def join_documents(docs: Iterable[bytes]) -> TokenStream:
    """One stream: ``doc0 <|endoftext|> doc1 <|endoftext|> ...``."""
    parts: list[TokenStream] = []
    eot = np.array([EOT_ID], dtype=np.uint16)
    for doc in docs:
        parts.extend((encode_bytes(doc), eot))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def split_documents(stream: TokenStream) -> list[bytes]:
    """The documents of a byte stream (:func:`join_documents` undone)."""
    ends = np.flatnonzero(stream == EOT_ID)
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [stream[a:b].astype(np.uint8).tobytes() for a, b in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class ByteCorpus:
    """Train and held-out token streams (read-only ``uint16`` arrays)."""

    train: TokenStream
    heldout: TokenStream
    train_files: int
    heldout_files: int
    root: str
    heldout_every: int
    #: sha256 over the relative paths and contents of the files read.
    fingerprint: str
    source: str = "python-stdlib"

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (sizes, split, fingerprint)."""
        return {
            "source": self.source,
            "root": self.root,
            "train_files": self.train_files,
            "heldout_files": self.heldout_files,
            "heldout_every": self.heldout_every,
            "train_tokens": len(self.train),
            "heldout_tokens": len(self.heldout),
            "fingerprint": self.fingerprint,
        }


@functools.lru_cache(maxsize=4)
def load_stdlib_corpus(
    root: str | Path | None = None, *, heldout_every: int = 10, max_bytes: int | None = None
) -> ByteCorpus:
    """Read the corpus. File ``i`` (in :func:`stdlib_source_files` order) is held out when
    ``i % heldout_every == heldout_every - 1``. ``max_bytes`` stops reading once that many
    bytes were read (the split of the files read stays the same). Cached per arguments."""
    base = Path(root) if root is not None else stdlib_root()
    return _read_corpus(stdlib_source_files(base), base, "python-stdlib", heldout_every, max_bytes)


#: Suffixes of the documentation files :func:`package_doc_files` collects.
DOC_SUFFIXES = frozenset({".txt", ".rst", ".md", ".html"})


def package_doc_files(root: str | Path | None = None) -> list[Path]:
    """The documentation installed packages ship under ``root`` (default: this
    interpreter's ``purelib``): every package's ``METADATA`` (its description) and every
    :data:`DOC_SUFFIXES` file it installed, sorted by path relative to ``root``. The
    packages' own file lists (``RECORD``, through :mod:`importlib.metadata`) say what is
    there, so the tree is not walked."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["purelib"])
    if not base.is_dir():
        raise FileNotFoundError(f"root: {base} is not a directory")
    found: set[str] = set()
    for dist in importlib.metadata.distributions(path=[str(base)]):
        for f in dist.files or ():
            rel = f.as_posix()
            is_meta = f.name == "METADATA" and f.parent.name.endswith(".dist-info")
            is_doc = Path(rel).suffix.lower() in DOC_SUFFIXES and ".dist-info/" not in rel
            inside = not rel.startswith("..")
            if (is_meta or is_doc) and inside and (base / rel).is_file():
                found.add(rel)
    return [base / rel for rel in sorted(found)]


@functools.lru_cache(maxsize=4)
def load_docs_corpus(
    root: str | Path | None = None, *, heldout_every: int = 10, max_bytes: int | None = None
) -> ByteCorpus:
    """The installed packages' documentation (:func:`package_doc_files`) as a corpus, split
    by file like :func:`load_stdlib_corpus`. Cached per arguments."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["purelib"])
    return _read_corpus(package_doc_files(base), base, "package-docs", heldout_every, max_bytes)


def _read_corpus(
    files: list[Path], base: Path, source: str, heldout_every: int, max_bytes: int | None
) -> ByteCorpus:
    if heldout_every < 2:
        raise ValueError(f"heldout_every: must be >= 2, got {heldout_every}")
    digest = hashlib.sha256()
    train_docs: list[bytes] = []
    heldout_docs: list[bytes] = []
    total = 0
    for i, path in enumerate(files):
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes()
        total += len(data)
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + data + b"\0")
        (heldout_docs if i % heldout_every == heldout_every - 1 else train_docs).append(data)
    if not train_docs or not heldout_docs:
        raise ValueError(
            f"root: {base} gives {len(train_docs)} train and {len(heldout_docs)} held-out "
            f"files; need at least one of each"
        )
    train, heldout = join_documents(train_docs), join_documents(heldout_docs)
    train.flags.writeable = False
    heldout.flags.writeable = False
    return ByteCorpus(
        train=train,
        heldout=heldout,
        train_files=len(train_docs),
        heldout_files=len(heldout_docs),
        root=str(base),
        heldout_every=heldout_every,
        fingerprint=digest.hexdigest(),
        source=source,
    )


def tokenize_corpus(corpus: ByteCorpus, tokenizer: Any) -> ByteCorpus:
    """``corpus`` re-tokenized by ``tokenizer`` (a ``transformers`` fast tokenizer whose
    ``<|endoftext|>`` is :data:`EOT_ID` and whose ids fit ``uint16``, e.g.
    :func:`devtools.tiny_model.train_bpe_tokenizer`): each document's text (UTF-8, an
    invalid byte read as U+FFFD) encoded and joined with ``<|endoftext|>`` as before.
    ``source`` and ``fingerprint`` name the tokenizer too."""
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer: {len(tokenizer)} ids do not fit uint16 streams")
    if tokenizer.convert_tokens_to_ids("<|endoftext|>") != EOT_ID:
        raise ValueError(f"tokenizer: <|endoftext|> must be id {EOT_ID}")

    def encode(stream: TokenStream) -> TokenStream:
        texts = [doc.decode("utf-8", "replace") for doc in split_documents(stream)]
        rows = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)
        eot = np.array([EOT_ID], dtype=np.uint16)
        out = np.concatenate(
            [a for r in rows["input_ids"] for a in (np.asarray(r, np.uint16), eot)]
        )
        out.flags.writeable = False
        return out

    digest = hashlib.sha256(corpus.fingerprint.encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    return replace(
        corpus,
        train=encode(corpus.train),
        heldout=encode(corpus.heldout),
        fingerprint=digest.hexdigest(),
        source=f"{corpus.source}, BPE {len(tokenizer)}",
    )


class WindowSampler:
    """Random ``[batch_size, length]`` int64 windows of a stream, reproducible from ``seed``.

    ``length`` is what the model sees plus one when the caller wants inputs and shifted
    targets from the same window.
    """

    def __init__(self, stream: TokenStream, *, batch_size: int, length: int, seed: int = 0):
        if batch_size < 1 or length < 1:
            raise ValueError(f"batch_size, length: must be >= 1, got {batch_size}, {length}")
        if len(stream) < length:
            raise ValueError(f"length: {length} exceeds the stream's {len(stream)} tokens")
        self.stream = stream
        self.batch_size = batch_size
        self.length = length
        self._rng = np.random.default_rng(seed)
        self._offsets = np.arange(length)

    def sample(self) -> torch.Tensor:
        """The next batch, ``[batch_size, length]`` int64."""
        starts = self._rng.integers(0, len(self.stream) - self.length + 1, size=self.batch_size)
        return torch.from_numpy(self.stream[starts[:, None] + self._offsets].astype(np.int64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.sample()


def fixed_windows(stream: TokenStream, *, length: int, count: int) -> torch.Tensor:
    """``[count, length]`` int64 windows at evenly spaced offsets (same on every call)."""
    if count < 1 or length < 1:
        raise ValueError(f"count, length: must be >= 1, got {count}, {length}")
    if len(stream) < length:
        raise ValueError(f"length: {length} exceeds the stream's {len(stream)} tokens")
    starts = np.linspace(0, len(stream) - length, num=count).astype(np.int64)
    return torch.from_numpy(stream[starts[:, None] + np.arange(length)].astype(np.int64))
