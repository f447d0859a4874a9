"""Write a tiny Qwen2 model directory (weights + byte-level tokenizer) for tests and examples,
and the byte-level BPE tokenizers the examples train.

The architecture follows docs/vllm.md: it loads in vLLM's CPU backend (head_dim 64; 16
fails in the CPU attention kernel) and in transformers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

__all__ = [
    "TINY_SERVE_ARGS",
    "byte_tokenizer",
    "tiny_qwen2_config",
    "train_bpe_tokenizer",
    "write_tiny_model",
]

#: ``teacher-server serve`` flags for the tiny model with the vLLM backend, as the tests'
#: shared server and the recorded fixture (``scripts/record_fixture.py``) use them:
#: float32 weights (comparable to the transformers reference), K up to 256.
TINY_SERVE_ARGS = [
    "--dtype", "float32",
    "--max-top-k", "256",
    "--max-model-len", "4096",
    "--max-num-batched-tokens", "16384",
    "--max-tokens-per-request", "65536",
]  # fmt: skip

#: Special tokens placed right after the 256 byte tokens.
EXTRA_TOKENS = ["<|endoftext|>", "<|pad|>"]


def byte_tokenizer() -> Any:
    """A byte-level tokenizer: ids 0..255 are the bytes, 256.. the special tokens.

    Returns a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(EXTRA_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EXTRA_TOKENS[0],
        pad_token=EXTRA_TOKENS[1],
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` ids learned from ``texts`` by the
    ``tokenizers`` library's trainer, returned as a ``transformers`` ``Qwen2Tokenizer``.

    Ids 0..255 are the bytes and 256.. the special tokens, as in :func:`byte_tokenizer`
    (so a stream joined with ``<|endoftext|>`` = 256 means the same in both); the merged
    tokens follow in the order they were learned. The training uses Qwen2's own
    normalizer (NFC) and pre-tokenizer: transformers (and vLLM through it) load a Qwen2
    model directory's tokenizer as ``Qwen2Tokenizer`` whatever its ``tokenizer_class``
    says, and that class sets both, so the tokens a model is trained on are the tokens
    every loader of its directory produces.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    merged_ids = vocab_size - 256 - len(EXTRA_TOKENS)
    if merged_ids < 0:
        raise ValueError(f"vocab_size: must be >= {256 + len(EXTRA_TOKENS)}, got {vocab_size}")
    qwen2 = Qwen2Tokenizer().backend_tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = qwen2.normalizer
    tok.pre_tokenizer = qwen2.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merged_ids,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # tokenizers writes a merge as a pair (0.20+) or as one "a b" string (before).
    pairs = (
        m.split(" ") if isinstance(m, str) else m
        for m in json.loads(tok.to_str())["model"]["merges"]
    )
    merges = [(a, b) for a, b in pairs]
    return Qwen2Tokenizer(
        vocab=_byte_level_vocab(merges),
        merges=cast(Any, merges),  # pairs, which its BPE takes (annotated: str | list[str])
        eos_token=EXTRA_TOKENS[0],
        pad_token=EXTRA_TOKENS[1],
    )


def _byte_level_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Bytes 0..255 (as GPT-2's printable characters), then :data:`EXTRA_TOKENS`, then one
    id per merge (its result), in merge order."""
    vocab = {c: b for b, c in enumerate(_bytes_to_unicode())}
    vocab.update({t: 256 + i for i, t in enumerate(EXTRA_TOKENS)})
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def tiny_qwen2_config(
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    max_position_embeddings: int = 8192,
    initializer_range: float = 0.2,
) -> Any:
    """A ``transformers.Qwen2Config`` for a tiny model (docs/vllm.md)."""
    from transformers import Qwen2Config

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=257,
        torch_dtype="float32",
    )
    return Qwen2Config(**fields)


def write_tiny_model(path: str | Path, *, seed: int = 0, **config_kwargs: Any) -> Path:
    """Write random weights + config + byte tokenizer to ``path`` and return it.

    ``initializer_range`` defaults to 0.2 (not 0.02) so that the next-token distribution
    is peaked rather than nearly uniform: top-k ids are then well separated, which makes
    engine-vs-reference comparisons meaningful.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**config_kwargs))
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a tiny random Qwen2 model directory.")
    ap.add_argument("path")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_model(args.path, seed=args.seed, vocab_size=args.vocab_size))


if __name__ == "__main__":
    main()
