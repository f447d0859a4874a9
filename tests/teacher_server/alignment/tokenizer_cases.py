"""Tokenizers for the alignment tests, each built offline and once per session.

- the repo's byte tokenizer and two byte-level BPE tokenizers (4096 and 1000 ids) trained
  on a seeded synthetic corpus of multi-byte words;
- two SentencePiece-style tokenizers with byte fallback, built by hand with the
  ``tokenizers`` library (no SentencePiece model file is available offline): a Unigram
  model with a ``Metaspace`` pre-tokenizer (Llama 3-era configuration, ``prepend_scheme``
  chosen) and the Llama 2 layout (the space replaced by ``'▁'`` in the normalizer, a
  ``Replace`` / ``ByteFallback`` / ``Fuse`` / ``Strip`` decoder).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from hypothesis import strategies as st

from devtools.tiny_model import byte_tokenizer, train_bpe_tokenizer

__all__ = [
    "MULTIBYTE",
    "TEXTS",
    "bpe",
    "byte_level",
    "corpus",
    "sentencepiece",
    "sentencepiece_legacy",
    "texts",
]

#: The text the brief names: 1-, 2-, 3- and 4-byte UTF-8 characters.
MULTIBYTE = "héllo wörld 日本語 🙂"

#: Texts every tokenizer here must spell back byte for byte.
TEXTS = [
    MULTIBYTE,
    "",
    " ",
    "a",
    "the quick brown fox jumps over the lazy dog",
    "  two  spaces\tand a tab\nand lines\n\n",
    "日本語のテキスト🙂🙂 mixed with ascii, ñ, ç, Ω, ж",
    "numbers 12345 and punctuation!?.,;:'\"()[]{}",
    "🙂" * 7 + "é" * 5,
]

_SYLLABLES = [
    "hé", "llo", "wö", "rld", "日本", "語", "🙂", "the", "qu", "ick", "ñ", "ça", "Ω",
    "ж", "数据", "an", "to", "ing", "er", "s", "ta", "ke", "mo", "ri", "ü", "ß", "€",
]  # fmt: skip


@functools.cache
def corpus() -> tuple[str, ...]:
    """A seeded corpus of 3000 sentences of random multi-byte words."""
    rng = np.random.default_rng(49)
    sentences = []
    for _ in range(3000):
        words = [
            "".join(rng.choice(_SYLLABLES, size=rng.integers(1, 5)))
            for _ in range(rng.integers(3, 12))
        ]
        sentences.append(" ".join(words) + rng.choice([".", "!", "?", ",", "\n"]))
    return (*sentences, *TEXTS)


@functools.cache
def byte_level() -> Any:
    """The repo's byte tokenizer (ids 0..255 the bytes, 256 and 257 special)."""
    return byte_tokenizer()


@functools.cache
def bpe(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on :func:`corpus`."""
    return train_bpe_tokenizer(corpus(), vocab_size)


#: The regular pieces of the hand-built SentencePiece vocabularies (with scores).
_PIECES = [
    "▁", "▁h", "é", "llo", "▁w", "ö", "rld", "A", "a", "b", "c", "d", "e", "h", "l",
    "o", "r", "w", "▁the", "▁qu", "ick", "▁a", "<|x|>", "日本",
]  # fmt: skip


def _unigram() -> Any:
    """A Unigram model: ``<unk>``, the 256 fallback bytes, then :data:`_PIECES`."""
    from tokenizers import models

    vocab = [("<unk>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(p, -1.0 - len(p) / 10) for p in _PIECES]
    return models.Unigram(vocab, unk_id=0, byte_fallback=True)


@functools.cache
def sentencepiece(prepend_scheme: str = "never") -> Any:
    """A SentencePiece-style tokenizer (Metaspace) with byte fallback, as transformers
    wraps one; ``<s>`` / ``</s>`` added as specials, a non-special added token
    ``<think>``."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(_unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.add_special_tokens(["<s>", "</s>"])
    tok.add_tokens(["<think>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@functools.cache
def sentencepiece_legacy() -> Any:
    """The Llama 2 layout: normalizer ``Prepend('▁')`` + ``Replace(' ', '▁')``, no
    pre-tokenizer, decoder ``Replace('▁', ' ')`` / ``ByteFallback`` / ``Fuse`` /
    ``Strip``."""
    from tokenizers import Tokenizer, decoders, normalizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(_unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def texts() -> st.SearchStrategy[str]:
    """Any text of valid Unicode scalars (no lone surrogates), multi-byte included."""
    alphabet = st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(list(MULTIBYTE + "日本語🙂ñçΩж€ß ")),
    )
    return st.text(alphabet=alphabet, max_size=40)
