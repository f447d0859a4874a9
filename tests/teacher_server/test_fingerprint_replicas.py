"""Replicas that agree: real teacher servers (transformers backend on the tiny model)
announce their answers to the canaries; one with another dtype or a perturbed checkpoint
is kept from becoming ready by ``--expect-fingerprint`` and refused by a client given
several targets; matching replicas are never refused."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from devtools.launch import TeacherProcess, start_teacher
from student_client import TeacherClient
from teacher_server.answer_fingerprint import announce_fingerprint, score_canaries
from topk_protocol.errors import TeacherMismatchError
from topk_protocol.fingerprint import (
    CANARY_TOP_K,
    AnswerFingerprint,
    FingerprintFileError,
    canary_sequences,
    differences,
    load_fingerprint,
)


def _serve(tmp: Path, name: str, model: Path, *extra: str) -> TeacherProcess:
    return start_teacher(
        ["--backend", "transformers", "--model", str(model), "--served-model-name", "tiny",
         *extra],
        tmp / f"{name}.log",
    )  # fmt: skip


def _info_json(server: TeacherProcess) -> dict[str, object]:
    with urllib.request.urlopen(f"{server.http}/v1/info", timeout=30) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def perturbed_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm's weights scaled by 1.01: another revision of
    the same checkpoint (same tokenizer, same shapes)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, TeacherProcess]]:
    """``good``: float32; ``twin``: float32 again, started later and told to agree with
    ``good`` (a restart of the same replica); ``half``: bfloat16 next to them."""
    tmp = tmp_path_factory.mktemp("replicas")
    started: dict[str, TeacherProcess] = {}
    try:
        started["good"] = _serve(tmp, "good", tiny_model_dir, "--dtype", "float32")
        (tmp / "good-info.json").write_text(json.dumps(_info_json(started["good"])))
        started["twin"] = _serve(
            tmp, "twin", tiny_model_dir, "--dtype", "float32",
            "--expect-fingerprint", str(tmp / "good-info.json"),
        )  # fmt: skip
        started["half"] = _serve(tmp, "half", tiny_model_dir, "--dtype", "bfloat16")
        yield started
    finally:
        for s in started.values():
            s.stop()


def _fingerprint_of(server: TeacherProcess) -> AnswerFingerprint:
    with TeacherClient(server.target) as client:
        fp = client.info().answer_fingerprint
    assert fp is not None
    return fp


def test_announced_on_getinfo_and_v1_info_and_stable_across_restart(
    replicas: dict[str, TeacherProcess], tmp_path: Path
) -> None:
    good, twin = replicas["good"], replicas["twin"]
    fp = _fingerprint_of(good)
    assert (fp.canary, fp.ids.shape, fp.engine_dtype, fp.model_name) == (
        "v1:4x64",
        (256, CANARY_TOP_K),
        "float32",
        "tiny",
    )
    (tmp_path / "info.json").write_text(json.dumps(_info_json(good)))
    from_http = load_fingerprint(tmp_path / "info.json")
    assert np.array_equal(from_http.ids, fp.ids)
    assert np.array_equal(from_http.logprobs, fp.logprobs)
    # A second process of the same engine on the same machine: the same answers.
    assert differences(_fingerprint_of(twin), fp) == []
    assert "answer fingerprint agrees with" in twin.log()


def test_stable_under_concurrent_load(replicas: dict[str, TeacherProcess]) -> None:
    """The canaries scored again while other streams run give the announced answers."""
    good = replicas["good"]
    fp = _fingerprint_of(good)
    stop = threading.Event()
    rng = np.random.default_rng(0)
    noise = [[rng.integers(0, 256, size=n).tolist() for n in (40, 90, 17)] for _ in range(8)]

    def load() -> None:
        with TeacherClient(good.target) as client:
            while not stop.is_set():
                for _ in client.stream(noise, 16, depth=4):
                    pass

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with TeacherClient(good.target) as client:
            canaries = [s.tolist() for s in canary_sequences(client.info().vocab_size)]
            payloads = [client.score([c], CANARY_TOP_K, dtype="float32") for c in canaries]
    finally:
        stop.set()
        for t in threads:
            t.join()
    again = AnswerFingerprint(
        fp.canary,
        np.concatenate([p.ids[0].numpy() for p in payloads]).astype(np.int32),
        np.concatenate([p.logprobs[0].numpy() for p in payloads]),
        fp.drift,
        fp.engine_dtype,
    )
    assert differences(again, fp) == []


def test_other_dtype_differs_and_expect_fingerprint_keeps_it_from_ready(
    replicas: dict[str, TeacherProcess], tiny_model_dir: Path, tmp_path: Path
) -> None:
    good, half = replicas["good"], replicas["half"]
    problems = differences(_fingerprint_of(half), _fingerprint_of(good))
    assert problems[0] == "engine dtype: bfloat16, the reference float32"
    assert any(p.startswith("log-probs: differ by up to") for p in problems)
    ref = tmp_path / "good-info.json"
    ref.write_text(json.dumps(_info_json(good)))
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        _serve(tmp_path, "refused", tiny_model_dir, "--dtype", "bfloat16",
               "--expect-fingerprint", str(ref))  # fmt: skip
    log = str(e.value)
    assert f"expect_fingerprint {ref}: this teacher (model 'tiny', dtype bfloat16)" in log
    assert "engine dtype: bfloat16, the reference float32" in log


def test_perturbed_checkpoint_is_kept_from_ready(
    replicas: dict[str, TeacherProcess], perturbed_model: Path, tmp_path: Path
) -> None:
    ref = tmp_path / "good-info.json"
    ref.write_text(json.dumps(_info_json(replicas["good"])))
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        _serve(tmp_path, "perturbed", perturbed_model, "--dtype", "float32",
               "--expect-fingerprint", str(ref))  # fmt: skip
    assert "does not answer like the reference" in str(e.value)
    assert "log-probs: differ by up to" in str(e.value)


def test_client_with_several_targets_uses_only_the_agreeing_replicas(
    replicas: dict[str, TeacherProcess], caplog: pytest.LogCaptureFixture
) -> None:
    good, twin, half = replicas["good"], replicas["twin"], replicas["half"]
    rng = np.random.default_rng(1)
    batches = [[rng.integers(0, 256, size=n).tolist() for n in (33, 12)] for _ in range(6)]
    with TeacherClient(good.target) as direct:
        want = list(direct.stream(batches, 8, depth=2))
    with (
        caplog.at_level(logging.WARNING, logger="student_client.clients.agreement"),
        TeacherClient([half.target, good.target, twin.target]) as client,
    ):
        got = list(client.stream(batches, 8, depth=2))
        for _ in range(4):  # round robin over the agreeing two only
            client.score(batches[0], 8)
            assert client.current_target in (good.target, twin.target)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.ids, w.ids) and torch.equal(g.logprobs, w.logprobs)
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1  # the matching replicas are not refused
    assert refusals[0].startswith(
        f"replica {half.target} (model 'tiny', dtype bfloat16) refused: its answers to the "
        f"canary sequences disagree with replica {good.target} (model 'tiny', dtype float32): "
        "engine dtype: bfloat16, the reference float32; log-probs: differ by up to"
    )


def test_a_fingerprint_file_that_does_not_parse_is_named(
    reference_backend: object, tmp_path: Path
) -> None:
    bad = tmp_path / "ref.json"
    bad.write_text("{")
    with pytest.raises(FingerprintFileError, match=re.escape(f"fingerprint file {bad}: not JSON")):
        asyncio.run(announce_fingerprint(reference_backend, bad))  # type: ignore[arg-type]
    fp = asyncio.run(score_canaries(reference_backend))  # type: ignore[arg-type]
    assert fp is not None
    (tmp_path / "fp.json").write_text(fp.to_json())
    asyncio.run(announce_fingerprint(reference_backend, tmp_path / "fp.json"))  # type: ignore[arg-type]
    other = AnswerFingerprint(fp.canary, fp.ids, fp.logprobs + 0.5, fp.drift, "float32", "x")
    (tmp_path / "other.json").write_text(other.to_json())
    with pytest.raises(TeacherMismatchError, match=r"log-probs: differ by up to 0\.5"):
        asyncio.run(announce_fingerprint(reference_backend, tmp_path / "other.json"))  # type: ignore[arg-type]
