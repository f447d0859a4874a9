"""The bytes table of a tokenizer: every id's exact bytes, special tokens flagged.

The check throughout: the tokens a tokenizer gives a text, mapped through the table and
joined, are that text's UTF-8 bytes (after the tokenizer's normalizer and prefix space).
"""

from __future__ import annotations

import copy
import unicodedata
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis_profiles import examples

from teacher_server.alignment.token_bytes import BYTE_LEVEL, SENTENCEPIECE, token_bytes
from tests.teacher_server.alignment.tokenizer_cases import (
    MULTIBYTE,
    TEXTS,
    bpe,
    byte_level,
    sentencepiece,
    sentencepiece_legacy,
    texts,
)

BYTE_LEVEL_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "byte": byte_level,
    "bpe4096": lambda: bpe(4096),
    "bpe1000": lambda: bpe(1000),
}


def _nfc(text: str) -> bytes:
    """What a Qwen2-style tokenizer's tokens spell: the NFC form's UTF-8 (the byte
    tokenizer has no normalizer; NFC texts are the same either way)."""
    return unicodedata.normalize("NFC", text).encode("utf-8")


@pytest.mark.parametrize("name", sorted(BYTE_LEVEL_TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_spell_the_text(name: str, text: str) -> None:
    tok = BYTE_LEVEL_TOKENIZERS[name]()
    table = token_bytes(tok)
    assert table.scheme == BYTE_LEVEL
    ids = tok.encode(text, add_special_tokens=False)
    assert table.join(ids) == text.encode("utf-8")
    assert table.lengths[ids].sum() == len(text.encode("utf-8"))


@pytest.mark.parametrize("name", sorted(BYTE_LEVEL_TOKENIZERS))
@settings(max_examples=examples(60))
@given(text=texts())
def test_byte_level_tokens_spell_any_text(name: str, text: str) -> None:
    tok = BYTE_LEVEL_TOKENIZERS[name]()
    ids = tok.encode(text, add_special_tokens=False)
    assert token_bytes(tok).join(ids) == (_nfc(text) if name != "byte" else text.encode())


def test_the_trained_tokenizers_merge_multibyte_characters() -> None:
    """The BPE cases are not the byte tokenizer in disguise: their tokens span several
    bytes, multi-byte characters and characters split across tokens included."""
    for size in (4096, 1000):
        tok = bpe(size)
        ids = tok.encode(MULTIBYTE)
        table = token_bytes(tok)
        assert len(ids) < len(MULTIBYTE.encode())
        assert table.lengths[ids].max() > 3
        assert len(tok) == size
    assert len(bpe(4096).encode(MULTIBYTE)) <= len(bpe(1000).encode(MULTIBYTE))


def test_byte_tokenizer_table() -> None:
    table = token_bytes(byte_level())
    assert table.vocab_size == 258
    assert table.pieces[:256].tolist() == [bytes([b]) for b in range(256)]
    assert table.pieces[256:].tolist() == [b"<|endoftext|>", b"<|pad|>"]
    assert table.special.tolist() == [False] * 256 + [True, True]
    assert not table.fallback.any()
    assert table.lengths.tolist() == [1] * 256 + [13, 7]


@pytest.mark.parametrize("size", [4096, 1000])
def test_every_piece_is_what_the_tokenizer_decodes(size: int) -> None:
    """Whole-vocabulary check against the tokenizer's own decoder: each id's bytes, where
    they are valid UTF-8, are what ``decode([id])`` gives (the first 256 ids are the
    bytes themselves)."""
    tok = bpe(size)
    table = token_bytes(tok)
    checked = 0
    for i in range(table.vocab_size):
        try:
            text = table.pieces[i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode([i]) == text, i
        checked += 1
    assert checked > size // 2
    assert table.pieces[:256].tolist() == [bytes([b]) for b in range(256)]


def test_a_special_token_in_the_text_spells_its_content() -> None:
    tok = bpe(1000)
    table = token_bytes(tok)
    text = "héllo<|endoftext|>wörld"
    ids = tok.encode(text)
    assert 256 in ids and table.special[256]
    assert table.join(ids) == text.encode()
    assert not table.special[[i for i in ids if i != 256]].any()


def test_added_tokens_are_content_and_only_specials_are_flagged() -> None:
    tok = copy.deepcopy(bpe(1000))  # the shared one stays as trained
    tok.add_tokens(["<think>"])  # not special
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    table = token_bytes(tok)
    think = tok.convert_tokens_to_ids("<think>")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert table.pieces[think] == b"<think>" and not table.special[think]
    assert table.pieces[start] == b"<|im_start|>" and table.special[start]
    text = "a <think>b<|im_start|>c"
    assert table.join(tok.encode(text)) == text.encode()


def test_vocab_size_covers_a_larger_model() -> None:
    table = token_bytes(byte_level(), vocab_size=300)
    assert table.vocab_size == 300
    assert table.pieces[258:].tolist() == [b""] * 42
    assert table.special[258:].all() and (table.lengths[258:] == 0).all()
    with pytest.raises(ValueError, match="vocab_size"):
        token_bytes(byte_level(), vocab_size=257)


def test_a_tokenizer_of_neither_alphabet_is_refused() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "he": 1, "##llo": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="neither byte-level nor SentencePiece"):
        token_bytes(tok)
    with pytest.raises(ValueError, match="fast tokenizer"):
        token_bytes(object())


def test_ids_outside_the_table_are_refused() -> None:
    table = token_bytes(byte_level())
    with pytest.raises(ValueError, match=r"\[0, 258\)"):
        table.join([1, 258])
    with pytest.raises(ValueError, match=r"\[0, 258\)"):
        table.join([-1])
    with pytest.raises(ValueError, match="integers"):
        table.join(np.zeros((2, 2), dtype=np.int64))
    assert table.join([]) == b""


# -- SentencePiece ----------------------------------------------------------------------


def _spm_bytes(scheme: str, text: str) -> bytes:
    """What a SentencePiece tokenizer's tokens spell: the text, with the space the
    pre-tokenizer prepends (``first``: unless the text starts with one; the legacy
    normalizer: always, to a non-empty text). A ``'▁'`` (U+2581) in the text is the
    tokenizer's own word-boundary mark: it encodes it as it encodes a space, so its
    tokens spell a space there (no table can tell the two apart)."""
    raw = text.replace("▁", " ").encode("utf-8")
    if scheme == "legacy":
        return b" " + raw if raw else raw
    if scheme == "first":
        return raw if not raw or raw.startswith(b" ") else b" " + raw
    return raw


SPM: dict[str, Callable[[], Any]] = {
    "never": lambda: sentencepiece("never"),
    "first": lambda: sentencepiece("first"),
    "legacy": sentencepiece_legacy,
}


@pytest.mark.parametrize("scheme", sorted(SPM))
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_tokens_spell_the_text(scheme: str, text: str) -> None:
    tok = SPM[scheme]()
    table = token_bytes(tok)
    assert table.scheme == SENTENCEPIECE
    ids = tok.encode(text, add_special_tokens=False)
    assert table.join(ids) == _spm_bytes(scheme, text)


@pytest.mark.parametrize("scheme", sorted(SPM))
@settings(max_examples=examples(60))
@given(text=texts())
@example(text="▁")
@example(text="a▁b ▁")
def test_sentencepiece_tokens_spell_any_text(scheme: str, text: str) -> None:
    tok = SPM[scheme]()
    ids = tok.encode(text, add_special_tokens=False)
    assert token_bytes(tok).join(ids) == _spm_bytes(scheme, text)


def test_sentencepiece_table() -> None:
    tok = sentencepiece()
    table = token_bytes(tok)
    vocab = tok.get_vocab()
    # 1 + 256 fallback bytes, the pieces, then <s>, </s>, <think>
    assert table.pieces[1 : 1 + 256].tolist() == [bytes([b]) for b in range(256)]
    assert table.fallback[1 : 1 + 256].all() and table.fallback.sum() == 256
    assert table.pieces[vocab["▁h"]] == b" h"
    assert table.pieces[vocab["▁"]] == b" "
    assert table.pieces[vocab["é"]] == "é".encode()
    assert table.pieces[vocab["A"]] == b"A" == table.pieces[vocab["<0x41>"]]
    assert table.special[[vocab["<unk>"], vocab["<s>"], vocab["</s>"]]].all()
    assert not table.special[vocab["<think>"]] and table.pieces[vocab["<think>"]] == b"<think>"
    assert table.special.sum() == 3
    # characters outside the pieces come as fallback bytes, and spell the text
    ids = tok.encode("日本語", add_special_tokens=False)
    assert table.fallback[ids].sum() == 3
    assert table.join(ids) == "日本語".encode()
