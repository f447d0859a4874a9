"""The exact bytes of every token id of a tokenizer.

A Hugging Face tokenizer's vocabulary stores each token as a string in the model's own
alphabet, not as the bytes it stands for. The two alphabets served here:

- **byte-level BPE** (GPT-2, Qwen, Llama 3; the decoder is ``ByteLevel``): every byte is
  one printable character of GPT-2's table (``'Ġ'`` is the space 0x20, ``'Ċ'`` the
  newline); a token's bytes are its characters mapped back through that table.
- **SentencePiece** (Llama 2, Mistral, Gemma; a ``Metaspace`` or ``Replace('▁', ' ')``
  decoder, usually with byte fallback): ``'▁'`` is the space and the rest is UTF-8; with
  byte fallback, a piece ``<0xNN>`` is the single byte 0xNN.

Added tokens (special or not) are stored as plain text: their bytes are their content's
UTF-8, in both alphabets. Special tokens (and the model's unknown token) are flagged, so
that they are never matched to text.

Examples (the byte-level alphabet): ``'Ġhello'`` -> ``b' hello'``; ``'Ã©'`` -> ``b'\\xc3\\xa9'``
(``'é'``); the special ``'<|endoftext|>'`` -> ``b'<|endoftext|>'``, flagged. SentencePiece:
``'▁héllo'`` -> ``b' h\\xc3\\xa9llo'``; ``'<0xE6>'`` -> ``b'\\xe6'``, flagged as a fallback
byte.

A sequence's bytes are the concatenation of its tokens' bytes (:meth:`TokenBytes.join`).
That is the text the tokenizer was given after its normalizer (NFC for Qwen2) and with
any prefix space it inserts (SentencePiece's ``prepend_scheme`` ``"first"`` makes
``"hello"`` into ``'▁hello'``, bytes ``b' hello'``): the bytes a tokenizer's tokens stand
for, which :mod:`.boundaries` compares across two tokenizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BYTE_LEVEL", "SENTENCEPIECE", "TokenBytes", "token_bytes"]

#: The two alphabets (:attr:`TokenBytes.scheme`).
BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"

_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "▁"


@dataclass(frozen=True, eq=False)
class TokenBytes:
    """Per-id bytes of a vocabulary of ``V`` ids.

    Attributes:
        pieces: ``[V]`` object array of ``bytes``: the bytes token id ``i`` stands for;
            ``b''`` for an id the tokenizer does not define (a model may have more rows
            than its tokenizer has tokens).
        lengths: ``[V]`` int64, ``len(pieces[i])``.
        special: ``[V]`` bool: special tokens, the unknown token and undefined ids; their
            bytes are their content (``b''`` when undefined), never text to match.
        fallback: ``[V]`` bool: SentencePiece byte-fallback pieces ``<0xNN>`` (one byte
            each, which another piece may also stand for: ``<0x41>`` and ``A`` are both
            ``b'A'``).
        scheme: :data:`BYTE_LEVEL` or :data:`SENTENCEPIECE`.
    """

    pieces: npt.NDArray[np.object_]
    lengths: npt.NDArray[np.int64]
    special: npt.NDArray[np.bool_]
    fallback: npt.NDArray[np.bool_]
    scheme: str

    @property
    def vocab_size(self) -> int:
        """``V``: the number of ids the table covers."""
        return len(self.pieces)

    def join(self, ids: npt.ArrayLike) -> bytes:
        """The bytes of the token sequence ``ids`` (``[L]`` ints in ``[0, V)``)."""
        arr = self.checked_ids(ids)
        return b"".join(self.pieces[arr].tolist())

    def checked_ids(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """``ids`` as a ``[L]`` int64 array; ``ValueError`` unless every id is in ``[0, V)``."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"ids: expected [L] integers, got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise ValueError(f"ids: must lie in [0, {self.vocab_size}), got an id outside it")
        return arr


def token_bytes(tokenizer: Any, vocab_size: int | None = None) -> TokenBytes:
    """The bytes of every id of ``tokenizer``.

    Args:
        tokenizer: a ``transformers`` fast tokenizer (its ``backend_tokenizer`` is read) or
            a ``tokenizers.Tokenizer``.
        vocab_size: the number of ids to cover (a model's vocabulary, which may be larger
            than the tokenizer's); None: the tokenizer's largest id + 1.

    Returns:
        The :class:`TokenBytes` table.

    Raises:
        ValueError: a tokenizer of neither alphabet (WordPiece's ``##`` pieces, for one,
            do not say their bytes), or ``vocab_size`` below the tokenizer's ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ValueError(
            f"tokenizer: expected a fast tokenizer or a tokenizers.Tokenizer, got "
            f"{type(tokenizer).__name__}"
        )
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    added = {int(i): t for i, t in backend.get_added_tokens_decoder().items()}
    size = max([*vocab.values(), *added, -1]) + 1
    if vocab_size is not None:
        if vocab_size < size:
            raise ValueError(
                f"vocab_size: the tokenizer has ids up to {size - 1}, got {vocab_size}"
            )
        size = vocab_size

    scheme = _scheme(config)
    pieces: list[bytes] = [b""] * size
    special = np.ones(size, dtype=np.bool_)
    fallback = np.zeros(size, dtype=np.bool_)
    if scheme == BYTE_LEVEL:
        decode = _byte_level_decoder()
        for piece, i in vocab.items():
            value = decode(piece)
            pieces[i] = piece.encode("utf-8") if value is None else value
            special[i] = value is None
    else:
        byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in _types(
            config.get("decoder")
        )
        space = _metaspace_char(config)
        for piece, i in vocab.items():
            match = _FALLBACK_PIECE.fullmatch(piece) if byte_fallback else None
            if match is not None:
                pieces[i] = bytes([int(match.group(1), 16)])
                fallback[i] = True
            else:
                pieces[i] = piece.replace(space, " ").encode("utf-8")
            special[i] = False
    for i in _unknown_ids(model, vocab):
        special[i] = True
    for i, token in added.items():
        pieces[i] = str(token.content).encode("utf-8")
        special[i] = bool(token.special)
        fallback[i] = False

    table = np.empty(size, dtype=object)
    table[:] = pieces
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=size)
    return TokenBytes(table, lengths, special, fallback, scheme)


def _scheme(config: dict[str, Any]) -> str:
    """The alphabet a tokenizer's JSON configuration uses (ByteLevel decoder first)."""
    decoders = _types(config.get("decoder"))
    if "ByteLevel" in decoders:
        return BYTE_LEVEL
    model = config.get("model") or {}
    if (
        model.get("byte_fallback")
        or decoders & {"Metaspace", "ByteFallback"}
        or "Metaspace" in _types(config.get("pre_tokenizer"))
        or _METASPACE in _replace_patterns(config.get("decoder"))
    ):
        return SENTENCEPIECE
    raise ValueError(
        f"tokenizer: neither byte-level nor SentencePiece (model {model.get('type')}, "
        f"decoder {sorted(decoders) or None}): its pieces do not say their bytes"
    )


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every component of a (possibly nested ``Sequence``) decoder or pre-tokenizer."""
    if isinstance(node, dict):
        yield node
        for key in ("decoders", "pretokenizers"):
            for child in node.get(key) or []:
                yield from _nodes(child)


def _types(node: Any) -> set[str]:
    """The ``type`` names of a component tree."""
    return {str(n.get("type")) for n in _nodes(node)}


def _replace_patterns(node: Any) -> set[str]:
    """The strings a tree's ``Replace`` decoders replace by a space."""
    return {
        str((n.get("pattern") or {}).get("String"))
        for n in _nodes(node)
        if n.get("type") == "Replace" and n.get("content") == " "
    }


def _metaspace_char(config: dict[str, Any]) -> str:
    """The character SentencePiece uses for the space (``'▁'`` unless configured)."""
    for section in ("decoder", "pre_tokenizer"):
        for n in _nodes(config.get(section)):
            if n.get("type") == "Metaspace" and n.get("replacement"):
                return str(n["replacement"])
    return _METASPACE


def _unknown_ids(model: dict[str, Any], vocab: dict[str, int]) -> list[int]:
    """The model's unknown token (BPE/WordLevel ``unk_token``, Unigram ``unk_id``)."""
    ids = []
    if isinstance(model.get("unk_token"), str) and model["unk_token"] in vocab:
        ids.append(vocab[model["unk_token"]])
    if isinstance(model.get("unk_id"), int):
        ids.append(int(model["unk_id"]))
    return ids


def _byte_level_decoder() -> Any:
    """A function piece -> bytes for GPT-2's alphabet (None for a piece with a character
    outside it: not text the tokenizer produces from bytes)."""
    table = dict(zip(_byte_level_alphabet(), range(256), strict=True))
    translate = {ord(c): b for c, b in table.items()}
    alphabet = frozenset(table)

    def decode(piece: str) -> bytes | None:
        if not alphabet.issuperset(piece):
            return None
        return piece.translate(translate).encode("latin-1")

    return decode


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (byte ``b`` is the
    ``b``-th character)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return [chr(chars[b]) for b in range(256)]
