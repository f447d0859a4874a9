"""The multi-teacher client against two live teachers on two different tiny models (the
session's vLLM teacher, and a transformers-backed one on other weights): random routings
of ragged batches, sub-ranges and attention masks give, row for row and bit for bit, what
each row's teacher answers when asked directly; the connect-time checks refuse a teacher
with another vocabulary, naming it, before any request."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ServerProcess, free_port, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_aio import requests_ok

from devtools.tiny_model import write_tiny_model
from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.blocking import TeacherClient
from student_client.clients.multi_teacher import AsyncMultiTeacherClient, MultiTeacherClient
from student_client.clients.routing import check_agreement
from student_client.clients.targets import RetryPolicy
from student_client.data.batch import ScoreBatch
from student_client.data.payload import TeacherPayload
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.multi_replay import MultiReplayClient
from student_client.offline.record_cli import main as record_main
from student_client.offline.replay_client import ReplayClient
from topk_protocol import RequestOptions, TeacherInfo
from topk_protocol.errors import (
    InvalidRequestError,
    NotRecordedError,
    TeacherError,
    TeacherMismatchError,
    TeacherUnavailableError,
    VocabMismatchError,
)

pytestmark = pytest.mark.vllm

K = 8
NAMES = ("vllm", "other")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (seed 1: other weights, same vocabulary and tokenizer)."""
    return write_tiny_model(tmp_path_factory.mktemp("other-model"), seed=1)


def _other_args(model: Path) -> list[str]:
    return ["--backend", "transformers", "--model", str(model), "--max-top-k", "64"]


@pytest.fixture(scope="module")
def other_teacher(
    other_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A transformers-backed teacher on :func:`other_model`."""
    server = start_server(_other_args(other_model), tmp_path_factory.mktemp("other") / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clients(
    vllm_teacher: ServerProcess, other_teacher: ServerProcess
) -> Iterator[tuple[MultiTeacherClient, dict[str, TeacherClient]]]:
    targets = {"vllm": vllm_teacher.target, "other": other_teacher.target}
    direct = {name: TeacherClient(t) for name, t in targets.items()}
    with MultiTeacherClient(targets) as multi:
        yield multi, direct
    for c in direct.values():
        c.close()


def _fields(p: TeacherPayload, b: int | slice) -> list[torch.Tensor]:
    """The payload's tensors at row ``b``, floats as their bits (NaN compares equal)."""
    assert p.sampled_logprobs is not None
    return [
        p.ids[b],
        p.logprobs[b].view(torch.int32),
        p.sampled_logprobs[b].view(torch.int32),
        p.mask[b],
    ]


def _assert_row_equal(got: TeacherPayload, b: int, want: TeacherPayload) -> None:
    """Row ``b`` of the routed payload is row 0 of the direct one, bit for bit (the routed
    payload may be padded further: those rows are padding)."""
    s = want.ids.shape[1]
    for g, w in zip(_fields(got, b), _fields(want, 0), strict=True):
        assert torch.equal(g[:s], w), b
        assert not g[s:].any()  # padding: zeros, mask False
    assert int(got.position_start[b]) == int(want.position_start[0])
    assert int(got.lengths[b]) == int(want.lengths[0])


@st.composite
def routed_batches(draw: st.DrawFn) -> dict[str, Any]:
    b = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 40), min_size=b, max_size=b))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    seqs = [rng.integers(0, 512, size=n) for n in lengths]
    teachers = draw(st.lists(st.sampled_from(NAMES), min_size=b, max_size=b))
    spans = None
    if draw(st.booleans()):
        spans = []
        for n in lengths:
            start = draw(st.integers(0, n))
            spans.append((start, draw(st.integers(start, n))))
    return {"seqs": seqs, "teachers": teachers, "spans": spans, "masked": draw(st.booleans())}


def _padded(seqs: list[np.ndarray], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), 257, dtype=torch.int64)
    mask = torch.zeros((len(seqs), t), dtype=torch.int64)
    for i, s in enumerate(seqs):
        cols = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, cols] = torch.from_numpy(s)
        mask[i, cols] = 1
    return ids, mask


@settings(
    max_examples=examples(10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=routed_batches())
def test_random_routings_equal_each_teacher_asked_directly(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]], case: dict[str, Any]
) -> None:
    multi, direct = clients
    seqs, teachers, spans = case["seqs"], case["teachers"], case["spans"]
    if case["masked"]:
        ids, mask = _padded(seqs, left=len(seqs) % 2 == 0)
        cols = None
        if spans is not None:  # the same ranges, as columns of the padded batch
            off = [int(m.argmax()) for m in mask]
            cols = [(a + o, b + o) for (a, b), o in zip(spans, off, strict=True)]
        got = multi.score(ids, K, teacher=teachers, attention_mask=mask, positions=cols)
        (streamed,) = multi.stream(
            [ScoreBatch(ids, positions=cols, attention_mask=mask, teacher=teachers)], K
        )
        for b, name in enumerate(teachers):
            want = direct[name].score(
                ids[b : b + 1],
                K,
                attention_mask=mask[b : b + 1],
                positions=None if cols is None else [cols[b]],
            )
            _assert_row_equal(got, b, want)
    else:
        got = multi.score(seqs, K, teacher=teachers, positions=spans)
        (streamed,) = multi.stream([ScoreBatch(seqs, positions=spans, teacher=teachers)], K)
        for b, name in enumerate(teachers):
            want = direct[name].score([seqs[b]], K, positions=None if spans is None else [spans[b]])
            _assert_row_equal(got, b, want)
    assert got.teachers == tuple(teachers)
    for a, c in zip(_fields(got, slice(None)), _fields(streamed, slice(None)), strict=True):
        assert torch.equal(a, c)


def test_stream_in_input_order_with_depth(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]],
) -> None:
    """A stream of routed batches (one-teacher batches among them) comes back in input
    order, each batch equal to its score() answer; dtype and K pass through."""
    multi, _ = clients
    rng = np.random.default_rng(7)
    batches = []
    for i in range(9):
        seqs = [rng.integers(0, 512, size=int(rng.integers(4, 30))) for _ in range(3)]
        route = [NAMES[(i + j) % 2] for j in range(3)] if i % 3 else ["other"] * 3
        batches.append(ScoreBatch(seqs, teacher=route))
    out = list(multi.stream(batches, 4, depth=3, dtype="float32"))
    assert [p.teachers for p in out] == [tuple(b.teacher) for b in batches]
    # The same request options as one RequestOptions (as the single-teacher client takes).
    opts = RequestOptions(4, dtype="float32", include_sampled=False)
    for p, b in zip(out, batches, strict=True):
        want = multi.score(b.sequences, 4, teacher=b.teacher, dtype="float32")
        assert p.dtype == "float32" and p.top_k == 4
        assert torch.equal(p.ids, want.ids) and torch.equal(p.logprobs, want.logprobs)
        by_options = multi.score(b.sequences, opts, teacher=b.teacher)
        assert by_options.sampled_logprobs is None and by_options.dtype == "float32"
        assert torch.equal(by_options.logprobs, want.logprobs)


def test_async_client_routes_concurrently(
    vllm_teacher: ServerProcess, other_teacher: ServerProcess
) -> None:
    async def run() -> TeacherPayload:
        targets = {"a": vllm_teacher.target, "b": {"target": other_teacher.target, "retries": 1}}
        async with AsyncMultiTeacherClient(targets, expect_vocab_size=512) as client:
            infos = await client.connect()
            assert set(infos) == {"a", "b"} and infos["b"].backend == "transformers"
            return await client.score([[1, 2, 3], [4, 5]], K, teacher=[1, 0])

    p = asyncio.run(run())
    assert p.teachers == ("b", "a") and p.lengths.tolist() == [3, 2]


def test_bad_routing_names_the_field(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]],
) -> None:
    multi, _ = clients
    with pytest.raises(InvalidRequestError, match=r"teacher\[1\]: 'math' is not one of"):
        multi.score([[1, 2], [3, 4]], K, teacher=["vllm", "math"])
    with pytest.raises(InvalidRequestError, match="teacher: 1 names for 2 sequences"):
        multi.score([[1, 2], [3, 4]], K, teacher=["vllm"])
    with pytest.raises(InvalidRequestError, match="teacher: missing"):
        list(multi.stream([[[1, 2]]], K))
    with pytest.raises(TypeError, match="dtpye: not a request option; the options are"):
        multi.score([[1, 2]], K, teacher="other", dtpye="float32")
    assert multi.score([[1, 2]], K, teacher="other").teachers == ("other",)


def test_a_teacher_that_stays_down_fails_naming_it(vllm_teacher: ServerProcess) -> None:
    down = f"127.0.0.1:{free_port()}"
    targets = {"up": vllm_teacher.target, "down": down}
    with (
        MultiTeacherClient(targets, retries=1, backoff_s=0.05) as client,
        pytest.raises(TeacherUnavailableError, match=f"teacher 'down': .*{down}"),
    ):
        client.score([[1, 2]], K, teacher=["up"])


def test_teacher_with_another_vocabulary_is_refused_at_connect(
    vllm_teacher: ServerProcess, tmp_path: Path, teacher_factory: Any
) -> None:
    """A teacher on a 640-token model: refused before the first request, naming it."""
    model = write_tiny_model(tmp_path / "wide", seed=2, vocab_size=640)
    wide = teacher_factory(["--backend", "transformers", "--model", str(model)])
    before = [requests_ok(s, "Score") for s in (vllm_teacher, wide)]
    with (
        MultiTeacherClient({"base": vllm_teacher.target, "wide": wide.target}) as client,
        pytest.raises(
            VocabMismatchError, match=r"teacher 'wide' \(127\.0\.0\.1:\d+\): vocab_size: 640"
        ),
    ):
        client.score([[1, 2, 3]], K, teacher=["base"])
    assert [requests_ok(s, "Score") for s in (vllm_teacher, wide)] == before
    with (
        MultiTeacherClient(
            {"base": vllm_teacher.target, "wide": wide.target}, expect_vocab_size=512
        ) as client,
        pytest.raises(VocabMismatchError, match=r"teacher 'wide'.*the student expects 512"),
    ):
        client.connect()


def _info(**kw: Any) -> TeacherInfo:
    base: dict[str, Any] = dict(
        model_name="m", vocab_size=512, max_top_k=8, tokenizer_fingerprint="fp",
        schema_version=1, supported_dtypes=("float16",), backend="x",
        max_tokens_per_request=0, max_message_bytes=0, max_sequence_length=0,
    )  # fmt: skip
    return TeacherInfo(**{**base, **kw})


def test_agreement_rules() -> None:
    targets = {"a": ["h:1"], "b": ["h:2", "h:3"]}
    check_agreement({"a": _info(), "b": _info(model_name="other")}, targets)
    with pytest.raises(
        VocabMismatchError, match=r"teacher 'b' \(h:2, h:3\): tokenizer_fingerprint"
    ):
        check_agreement({"a": _info(), "b": _info(tokenizer_fingerprint="zz")}, targets)
    with pytest.raises(TeacherMismatchError, match=r"teacher 'b'.*T = 2.*one temperature"):
        check_agreement({"a": _info(), "b": _info(teacher_temperature=2.0)}, targets)
    with pytest.raises(ValueError, match="teacher name"):
        MultiTeacherClient({"../x": "h:1"})
    with pytest.raises(ValueError, match=r"teachers\['a'\]: \['record_to'\] apply to every"):
        MultiTeacherClient({"a": {"target": "h:1", "record_to": "x"}})


def _heavy_batches(seed: int, n: int) -> list[ScoreBatch]:
    """``n`` batches of 2 long rows for teacher ``a`` (the replicated one: busy when its
    replica dies) and 2 short rows for ``b``, interleaved."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        long = [rng.integers(0, 512, size=int(rng.integers(300, 600))) for _ in range(2)]
        short = [rng.integers(0, 512, size=24) for _ in range(2)]
        out.append(ScoreBatch([long[0], short[0], long[1], short[1]], teacher=list("abab")))
    return out


def test_replica_sigkilled_mid_stream(
    vllm_teacher: ServerProcess,
    other_teacher: ServerProcess,
    other_model: Path,
    teacher_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Teacher ``a`` has two replicas; one is SIGKILLed mid-stream. Every row arrives
    once, in order, equal to a direct answer; only ``a``'s parts wait and retry: ``b``'s
    parts take no longer than before the kill plus one retry interval."""
    spare = teacher_factory(_other_args(other_model))
    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    retries: list[str] = []
    score, give_up = AsyncTeacherClient.score, RetryPolicy.give_up

    async def timed(self: AsyncTeacherClient, *args: Any, **kwargs: Any) -> TeacherPayload:
        t0 = time.monotonic()
        out = await score(self, *args, **kwargs)
        spans["a" if len(self.targets) == 2 else "b"].append((t0, time.monotonic()))
        return out

    def counted(
        self: RetryPolicy, failures: int, last: TeacherError, targets: Sequence[str]
    ) -> None:
        # Which teacher's client failed a try (a's has two replicas). Not the target: the
        # fail-over may already have moved to the surviving replica.
        retries.append("a" if len(targets) == 2 else "b")
        give_up(self, failures, last, targets)

    monkeypatch.setattr(AsyncTeacherClient, "score", timed)
    monkeypatch.setattr(RetryPolicy, "give_up", counted)
    batches = _heavy_batches(3, 16)
    retry_s = 1.0  # backoff_s: the first retry waits 0.5-1 s
    targets = {"a": [other_teacher.target, spare.target], "b": vllm_teacher.target}
    out: list[TeacherPayload] = []
    with MultiTeacherClient(targets, backoff_s=retry_s) as client:
        for i, p in enumerate(client.stream(batches, K, depth=4)):
            out.append(p)
            if i == 3:
                t_kill = time.monotonic()
                spare.proc.send_signal(signal.SIGKILL)
                spare.proc.wait(10)
    assert len(out) == len(batches) and retries and set(retries) == {"a"}
    with TeacherClient(other_teacher.target) as a, TeacherClient(vllm_teacher.target) as b:
        for p, batch in zip(out, batches, strict=True):
            assert p.teachers == tuple("abab")
            seqs = batch.sequences
            for rows, direct in (([0, 2], a), ([1, 3], b)):
                want = direct.score([seqs[r] for r in rows], K)
                for j, r in enumerate(rows):
                    _assert_row_equal(p, r, _row(want, j))
    before = [t1 - t0 for t0, t1 in spans["b"] if t1 < t_kill]
    after = [t1 - t0 for t0, t1 in spans["b"] if t0 >= t_kill - 0.1]
    slow_a = max(t1 - t0 for t0, t1 in spans["a"])
    print(
        f"b parts: before the kill max {max(before):.3f} s (n={len(before)}), after max "
        f"{max(after):.3f} s (n={len(after)}); slowest a part {slow_a:.3f} s; "
        f"{len(retries)} retries of a"
    )
    assert max(after) <= max(before) + retry_s


def _row(p: TeacherPayload, j: int) -> TeacherPayload:
    """Row ``j`` of a payload as a one-row payload."""
    n = int(p.lengths[j])
    sampled = None if p.sampled_logprobs is None else p.sampled_logprobs[j : j + 1, :n]
    return replace(
        p,
        ids=p.ids[j : j + 1, :n],
        logprobs=p.logprobs[j : j + 1, :n],
        sampled_logprobs=sampled,
        mask=p.mask[j : j + 1, :n],
        position_start=p.position_start[j : j + 1],
        lengths=p.lengths[j : j + 1],
    )


def test_multi_teacher_recording_replays_byte_identically(
    vllm_teacher: ServerProcess,
    other_teacher: ServerProcess,
    tmp_path: Path,
    teacher_factory: Any,
) -> None:
    """``record_to=`` keeps each row's teacher; ReplayClient, the payload dataset and the
    replay server (one teacher of the recording) give the live rows back, bit for bit."""
    rec = tmp_path / "rec"
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 512, size=17)  # scored by both teachers: two different rows
    batches = []
    for i in range(4):
        seqs = [shared] + [rng.integers(0, 512, size=int(rng.integers(3, 30))) for _ in range(4)]
        route = ["vllm", "other", "vllm", "other", "other"] if i % 2 else ["other"] + ["vllm"] * 4
        batches.append(ScoreBatch(seqs, teacher=route))
    targets = {"vllm": vllm_teacher.target, "other": other_teacher.target}
    with MultiTeacherClient(targets, record_to=rec) as client:
        live = list(client.stream(batches, K, dtype="float32"))

    with MultiReplayClient(rec) as replay:
        assert replay.names == ["vllm", "other"] and set(replay.info()) == {"vllm", "other"}
        again = list(replay.stream(batches, K, dtype="float32"))
        for got, want in zip(again, live, strict=True):
            assert got.teachers == want.teachers
            for a, b in zip(_fields(got, slice(None)), _fields(want, slice(None)), strict=True):
                assert torch.equal(a, b)
        with pytest.raises(NotRecordedError, match=r"teacher 'vllm': .*not recorded"):
            replay.score([[1, 2, 3]], K, teacher="vllm")

    # The payload dataset: every recorded row with its teacher column.
    rows = {}
    for p, batch in zip(live, batches, strict=True):
        for b, (seq, name) in enumerate(zip(batch.sequences, batch.teacher, strict=True)):
            rows[(name, seq.astype("<i4").tobytes())] = _row(p, b)
    ds = PayloadDataset(rec, include_sampled=True)
    assert ds.teachers == ["vllm", "other"] and len(ds) == len(rows)
    for i in range(len(ds)):
        item = ds[i]
        assert item.teacher is not None
        want = rows[(item.teacher, item.token_ids.numpy().astype("<i4").tobytes())]
        n = int(want.lengths[0])
        got = item.arrays
        assert np.array_equal(got.ids, want.ids[0, :n].numpy())
        assert got.logprobs.tobytes() == want.logprobs[0, :n].numpy().tobytes()
        assert want.sampled_logprobs is not None and got.sampled_logprobs is not None
        assert got.sampled_logprobs.tobytes() == want.sampled_logprobs[0, :n].numpy().tobytes()
    collated = collate_payloads([ds[i] for i in range(len(ds))])
    assert collated.teachers == tuple(ds[i].teacher for i in range(len(ds)))

    # One teacher of the recording: as a single-teacher replay, and served by the server.
    seqs = [s for b in batches for s, t in zip(b.sequences, b.teacher, strict=True) if t == "other"]
    with ReplayClient(rec, teacher="other") as one:
        single = one.score(seqs, K, dtype="float32")
    server = teacher_factory(
        ["--backend", "replay", "--recording", str(rec), "--replay-teacher", "other"]
    )
    with TeacherClient(server.target) as c:
        served = c.score(seqs, K, dtype="float32")
    for j, seq in enumerate(seqs):
        want = rows[("other", seq.astype("<i4").tobytes())]
        _assert_row_equal(single, j, want)
        _assert_row_equal(served, j, want)

    # teacher-record with two named teachers and a teacher column: the same rows.
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"input_ids": s.tolist(), "teacher_id": t})
        for b in batches
        for s, t in zip(b.sequences, b.teacher, strict=True)
    ]
    corpus.write_text("\n".join(lines) + "\n")
    cli = [
        "--teacher", f"vllm={vllm_teacher.target}", "--teacher", f"other={other_teacher.target}",
        "--input", str(corpus), "--output", str(tmp_path / "cli"), "--top-k", str(K),
        "--dtype", "float32", "--batch-size", "3",
    ]  # fmt: skip
    assert record_main(cli) == 0
    by_cli = PayloadDataset(tmp_path / "cli", include_sampled=True)
    assert len(by_cli) == len(rows)
    for i in range(len(by_cli)):
        item = by_cli[i]
        assert item.teacher is not None
        want = rows[(item.teacher, item.token_ids.numpy().astype("<i4").tobytes())]
        assert item.arrays.logprobs.tobytes() == want.logprobs[0].numpy().tobytes()
    assert record_main(cli) == 0  # resumes: nothing left to score


def test_trainer_routes_by_column_and_logs_per_teacher(
    vllm_teacher: ServerProcess, other_teacher: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``TopKDistillationTrainer(teacher={...})`` scores each row by the teacher its
    column names: the first step's losses (overall and per teacher) are those of the
    hand-computed loss on payloads asked of each row's teacher; ``kd_*/<name>`` logged."""
    import copy

    from transformers import AutoTokenizer, Qwen2ForCausalLM, TrainingArguments

    from devtools.tiny_model import tiny_qwen2_config
    from student_client.integrations.hf_trainer import (
        DistillationConfig,
        TopKDistillationTrainer,
        teacher_column_collator,
    )
    from student_client.losses import TeacherTargets, topk_kl_loss

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "right"
    torch.manual_seed(0)
    student = Qwen2ForCausalLM(
        tiny_qwen2_config(hidden_size=32, num_layers=1, head_dim=16, initializer_range=0.02)
    )
    rng = np.random.default_rng(5)
    examples = [
        {
            "input_ids": rng.integers(0, 256, size=int(rng.integers(6, 21))).tolist(),
            "domain": str(rng.choice(NAMES)),
        }
        for _ in range(16)
    ]
    pad = teacher_column_collator(lambda f: tokenizer.pad(f, return_tensors="pt"), "domain")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    targets = {"vllm": vllm_teacher.target, "other": other_teacher.target}
    trainer = TopKDistillationTrainer(
        model=copy.deepcopy(student),
        args=args,
        train_dataset=examples,
        data_collator=pad,
        teacher=targets,
        teacher_column="domain",
        distill=DistillationConfig(RequestOptions(K), prefetch_depth=2),
    )
    trainer.train()
    trainer.close()
    logs = [r for r in trainer.state.log_history if "kd_loss" in r]
    assert len(logs) == 4
    first = logs[0]

    batch = pad(examples[:4])
    names = batch["domain"]
    with MultiTeacherClient(targets) as client:
        payload = client.score(
            batch["input_ids"], K, teacher=names, attention_mask=batch["attention_mask"]
        )
    assert payload.teachers == tuple(names)
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def loss(rows: list[int]) -> float:
        value, _ = topk_kl_loss(
            logits[rows],
            TeacherTargets(payload.ids[rows], payload.logprobs[rows], mask=payload.mask[rows]),
        )
        return float(value.detach())

    assert first["kd_loss"] == pytest.approx(loss(list(range(4))), abs=1e-5)
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        assert first[f"kd_loss/{name}"] == pytest.approx(loss(rows), abs=1e-5)
    for row in logs:
        assert any(k.startswith("kd_teacher_mass/") for k in row)


def test_reverse_kl_advantage_against_each_rows_own_teacher(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]],
) -> None:
    """The reverse-KL advantage of the sampled tokens (``losses.onpolicy``) from a routed
    payload is, row for row, the one from that row's own teacher asked directly (and
    differs from another teacher's)."""
    from student_client.losses.onpolicy import reverse_kl_advantage, sampled_token_logprobs

    multi, direct = clients
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 512, size=n) for n in (12, 7, 12, 9)]
    ids, mask = _padded(seqs, left=False)
    teachers = ["vllm", "other", "other", "vllm"]
    torch.manual_seed(0)
    logits = torch.randn(4, ids.shape[1], 512)
    student = sampled_token_logprobs(logits[:, :-1], ids[:, 1:])  # [B, T-1]: log q(x[t+1])

    def advantage(p: TeacherPayload, rows: slice) -> torch.Tensor:
        assert p.sampled_logprobs is not None
        return reverse_kl_advantage(student[rows], p.sampled_logprobs[:, :-1], p.mask[:, :-1])

    routed = multi.score(ids, K, teacher=teachers, attention_mask=mask)
    adv = advantage(routed, slice(None))
    assert bool((adv != 0).any())
    for b, name in enumerate(teachers):
        want = direct[name].score(ids[b : b + 1], K, attention_mask=mask[b : b + 1])
        assert torch.equal(adv[b : b + 1], advantage(want, slice(b, b + 1)))
    other = direct["vllm"].score(ids[1:2], K, attention_mask=mask[1:2])
    assert not torch.equal(adv[1:2], advantage(other, slice(1, 2)))


def test_replay_server_needs_the_teacher_of_a_multi_teacher_recording(tmp_path: Path) -> None:
    from teacher_server.backends.replay_backend import replay_path
    from topk_protocol.recording.multi_recording import write_manifest

    write_manifest(tmp_path, ["a", "b"])
    with pytest.raises(ValueError, match=r"multi-teacher recording of \['a', 'b'\]"):
        replay_path(str(tmp_path), None)
    assert replay_path(str(tmp_path), "b") == tmp_path / "b"
    with pytest.raises(ValueError, match="single-teacher recording"):
        replay_path(str(tmp_path / "b"), "b")
