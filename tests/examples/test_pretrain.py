"""The demo's default teacher: corpus split, window sampling, and a (tiny) real pretraining
run that writes a model directory transformers and the teacher server's backend load."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from examples.data import (
    EOT_ID,
    WindowSampler,
    decode_bytes,
    fixed_windows,
    load_stdlib_corpus,
    split_documents,
    stdlib_source_files,
    tokenize_corpus,
)
from examples.teacher_pretrain import (
    MARKER_NAME,
    PretrainConfig,
    build_default_teacher,
    read_marker,
    teacher_corpus,
)
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions


def tiny_config(**overrides: Any) -> PretrainConfig:
    """Small enough for a test on 2 shared cores, big enough to learn something."""
    fields: dict[str, Any] = dict(
        batch_size=8, seq_len=64, eval_windows=8, warmup_steps=5, corpus_max_bytes=2_000_000
    )
    return PretrainConfig(**{**fields, **overrides})


# -- corpus ----------------------------------------------------------------------------------


def _fake_stdlib(root: Path, n: int = 25) -> list[bytes]:
    """``n`` modules (in sorted order) plus files that must be left out."""
    docs = []
    for i in range(n):
        data = f"# module {i:02d}\nx = {i}\n".encode()
        sub = root / ("pkg" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"m{i:02d}.py").write_bytes(data)
        docs.append(data)
    for skipped in ("site-packages/foo.py", "test/test_x.py", "pkg/tests/t.py", "m.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_bytes(b"SKIP ME\n")
    return docs


def test_corpus_splits_by_file_every_nth(tmp_path: Path) -> None:
    _fake_stdlib(tmp_path)
    files = stdlib_source_files(tmp_path)
    rel = [p.relative_to(tmp_path).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) == 25
    assert not any("site-packages" in r or "test" in r for r in rel)
    corpus = load_stdlib_corpus(tmp_path, heldout_every=10)
    assert (corpus.train_files, corpus.heldout_files) == (23, 2)
    heldout_docs = [files[9].read_bytes(), files[19].read_bytes()]
    assert decode_bytes(corpus.heldout) == "\n".join(d.decode() for d in heldout_docs) + "\n"
    assert int((corpus.train == EOT_ID).sum()) == 23 and corpus.train[-1] == EOT_ID
    assert b"SKIP ME" not in decode_bytes(corpus.train).encode()
    for doc in heldout_docs:  # held-out files never leak into training
        assert doc.decode() not in decode_bytes(corpus.train)
    assert not corpus.train.flags.writeable
    same = load_stdlib_corpus(tmp_path, heldout_every=10)
    assert same.fingerprint == corpus.fingerprint


def test_real_stdlib_corpus_loads() -> None:
    corpus = load_stdlib_corpus(max_bytes=2_000_000)
    assert corpus.train_files > 0 and corpus.heldout_files > 0
    assert len(corpus.train) > 8 * len(corpus.heldout) > 0
    text = decode_bytes(corpus.train[:20_000])
    assert "def " in text or "import " in text
    assert int(corpus.train.max()) <= EOT_ID


def test_window_sampler_is_seeded_and_cuts_real_windows() -> None:
    stream = np.arange(1000, dtype=np.uint16) % 251
    a = WindowSampler(stream, batch_size=4, length=33, seed=7)
    b = WindowSampler(stream, batch_size=4, length=33, seed=7)
    c = WindowSampler(stream, batch_size=4, length=33, seed=8)
    xa, xb, xc = a.sample(), b.sample(), c.sample()
    assert xa.shape == (4, 33) and xa.dtype == torch.int64
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    for row in xa:  # each row is a contiguous slice of the stream
        starts = [s for s in np.flatnonzero(stream == int(row[0])) if s + 33 <= len(stream)]
        assert any(np.array_equal(stream[s : s + 33], row.numpy()) for s in starts)
    w1, w2 = fixed_windows(stream, length=50, count=5), fixed_windows(stream, length=50, count=5)
    assert torch.equal(w1, w2) and w1[0, 0] == 0 and int(w1[-1, -1]) == int(stream[-1])
    with pytest.raises(ValueError, match="length"):
        WindowSampler(stream, batch_size=1, length=1001)


# -- pretraining -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher trained for exactly 40 steps (no wall-clock cap: on a loaded machine a cap
    would cut the run short and the step count would depend on the load)."""
    cfg = tiny_config(train_seconds=0, max_steps=40, seed=0)
    return build_default_teacher(tmp_path_factory.mktemp("cache") / "teacher", config=cfg)


def test_pretraining_writes_a_complete_teacher_that_learned(teacher_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER_NAME):
        assert (teacher_dir / name).is_file(), name
    marker = read_marker(teacher_dir)
    assert marker is not None
    m = marker["metrics"]
    assert marker["config"]["max_steps"] == 40 and m["steps"] == 40
    # Random init is near uniform over 320 ids (ln 320 = 5.77 nats).
    assert m["initial_heldout_ce"] > 5.0
    assert m["heldout_ce"] < m["initial_heldout_ce"] - 1.0
    assert m["last_train_loss"] < m["first_train_loss"] - 1.0
    assert 0.0 < m["heldout_top8_mass"] < m["heldout_top16_mass"] <= 1.0
    assert m["corpus"]["heldout_files"] > 0
    config = json.loads((teacher_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 320


def test_cached_teacher_is_reused_without_training(teacher_dir: Path) -> None:
    marker_before = (teacher_dir / MARKER_NAME).read_text()
    weights_mtime = (teacher_dir / "model.safetensors").stat().st_mtime_ns
    budget_s = 1000.0
    t0 = time.monotonic()
    again = build_default_teacher(teacher_dir, train_seconds=budget_s, seed=1)
    # Not a step of training: it took not even a hundredth of the budget it was given.
    assert time.monotonic() - t0 < budget_s / 100
    assert again == teacher_dir
    assert (teacher_dir / MARKER_NAME).read_text() == marker_before
    assert (teacher_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert not [p for p in teacher_dir.parent.iterdir() if ".building-" in p.name]


def test_teacher_loads_with_transformers(teacher_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids == list(b"def f(x):\n    return x")
    assert tok.convert_tokens_to_ids("<|endoftext|>") == EOT_ID
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 320)
    # It learned Python: after "return" the next byte is far likelier a space than "Q".
    prefix = torch.tensor([list(b"    return")])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=prefix).logits[0, -1], -1)
    assert lp[ord(" ")] > lp[ord("Q")]


def test_teacher_serves_through_the_transformers_backend(teacher_dir: Path) -> None:
    from teacher_server.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(teacher_dir, max_top_k=16)
    asyncio.run(backend.start())
    assert backend.info.vocab_size == 320
    tokens = np.frombuffer(b"import os\nimport sys\n", dtype=np.uint8).astype(np.int32)
    scored = asyncio.run(backend.score(ParsedSequence(tokens, 0, len(tokens)), RequestOptions(16)))
    assert scored.ids.shape == (len(tokens), 16)
    assert np.all(np.diff(scored.logprobs, axis=1) <= 0)
    mass = np.exp(scored.logprobs).sum(axis=1)
    assert np.all(mass <= 1.0 + 1e-5) and mass.mean() > 0.3
    assert np.isnan(scored.sampled_logprobs[-1]) and np.isfinite(scored.sampled_logprobs[:-1]).all()


def test_time_budget_build_into_an_empty_directory(tmp_path: Path) -> None:
    """The CLI's default path: a wall-clock budget; an existing empty directory (a fresh
    volume mount point) is fine, a foreign non-empty one is refused and left alone."""
    target = tmp_path / "mounted"
    target.mkdir()
    cfg = tiny_config(train_seconds=2.0, seed=0)
    t0 = time.monotonic()
    out = build_default_teacher(target, config=cfg)
    marker = read_marker(out)
    assert out == target and marker is not None
    m = marker["metrics"]
    # It trained for its budget, and the call took that long and a little more.
    assert m["steps"] >= 1 and cfg.train_seconds <= m["train_seconds"] < time.monotonic() - t0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="cache_dir"):
        build_default_teacher(foreign, config=cfg)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_same_seed_and_steps_give_the_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = tiny_config(train_seconds=0, max_steps=3, seed=3)
    a = load_file(build_default_teacher(tmp_path / "a", config=cfg) / "model.safetensors")
    b = load_file(build_default_teacher(tmp_path / "b", config=cfg) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- a BPE vocabulary ------------------------------------------------------------------------


def test_bpe_tokenizer_keeps_the_byte_ids_and_learns_merges() -> None:
    from devtools.tiny_model import byte_tokenizer, train_bpe_tokenizer

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda"]
    texts = [f"def {a}_{b}(value):\n    return value + {b}\n" for a in words for b in words]
    tok = train_bpe_tokenizer(texts, 300)
    assert len(tok) == 300
    byte_tok = byte_tokenizer()
    for special in ("<|endoftext|>", "<|pad|>"):  # the same ids as the byte tokenizer's
        assert tok.convert_tokens_to_ids(special) == byte_tok.convert_tokens_to_ids(special)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == EOT_ID
    text = "def beta_gamma(value):\n    return value + gamma\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges learned
    assert max(ids) < 300 and min(ids) >= 0
    # A single byte not merged with anything keeps its byte id.
    assert tok("\x07", add_special_tokens=False)["input_ids"] == [7]
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(texts, 257)


def test_tokenize_corpus_keeps_documents_and_split(tmp_path: Path) -> None:
    from devtools.tiny_model import train_bpe_tokenizer

    _fake_stdlib(tmp_path, n=30)
    files = stdlib_source_files(tmp_path)
    corpus = load_stdlib_corpus(tmp_path, heldout_every=10)
    assert split_documents(corpus.train) == [
        f.read_bytes() for i, f in enumerate(files) if i % 10 != 9
    ]
    tok = train_bpe_tokenizer((d.decode() for d in split_documents(corpus.train)), 280)
    bpe = tokenize_corpus(corpus, tok)
    assert bpe.source == f"python-stdlib, BPE {len(tok)}" and 258 < len(tok) <= 280
    assert bpe.fingerprint != corpus.fingerprint
    assert int((bpe.train == EOT_ID).sum()) == corpus.train_files
    assert int((bpe.heldout == EOT_ID).sum()) == corpus.heldout_files
    assert len(bpe.train) < len(corpus.train) and not bpe.train.flags.writeable
    for stream, tokens in ((corpus.train, bpe.train), (corpus.heldout, bpe.heldout)):
        assert tok.decode(tokens.tolist()).replace("<|endoftext|>", "\n") == decode_bytes(stream)


def test_bpe_teacher_trains_saves_its_tokenizer_and_retokenizes(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = tiny_config(
        tokenizer="bpe", vocab_size=384, train_seconds=0, max_steps=3, corpus_max_bytes=300_000
    )
    out = build_default_teacher(tmp_path / "bpe", config=cfg)
    marker = read_marker(out)
    assert marker is not None and marker["config"]["tokenizer"] == "bpe"
    m = marker["metrics"]
    assert m["steps"] == 3 and m["heldout_bytes_per_token"] > 1.5
    assert m["initial_heldout_ce"] > m["heldout_unigram_ce"] > 0
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 384 and json.loads((out / "config.json").read_text())["vocab_size"] == 384
    corpus = teacher_corpus(out)
    assert corpus.source.endswith("BPE 384") and int(corpus.train.max()) < 384
    # Whatever class a loader picks for the directory (transformers: Qwen2Tokenizer, by
    # the model type), the tokens are those of the tokenizer as saved (and trained on).
    saved = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    byte_corpus = load_stdlib_corpus(max_bytes=300_000)
    for loaded in (tok, saved):
        assert np.array_equal(corpus.heldout, tokenize_corpus(byte_corpus, loaded).heldout)
    text = "caf\u00e9 = 'cafe\u0301'  # \u00fc\n\tif x:\n        return  x<<2\n"
    assert tok(text)["input_ids"] == saved(text)["input_ids"]
    with pytest.raises(ValueError, match="tokenizer"):
        PretrainConfig(tokenizer="words")
