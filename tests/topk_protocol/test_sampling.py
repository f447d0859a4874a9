"""Sampled payloads in the protocol: the draws (reproducible, invariant, distributed as the
teacher's), the request options and their bad input, the codec and sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_checks import chi_square_p_value, equal_mass_chi_square

from teacher_server.validation import Limits, parse_request
from topk_protocol import RequestOptions, SequenceArrays, build_request, pb
from topk_protocol.checks import MAX_SAMPLES, TeacherLimits, check_samples
from topk_protocol.codec import decode_sequence, encode_sequence
from topk_protocol.errors import InvalidRequestError
from topk_protocol.sampling import draw_uniforms, sample_rows, sequence_sample_key

ALPHA = 1e-3


def _dense(rows: int = 37, vocab: int = 1000, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, vocab, generator=g) * scale, -1)


def test_draws_depend_only_on_seed_sequence_and_position() -> None:
    lp = _dense()
    key = sequence_sample_key(np.arange(40, dtype=np.int32))
    whole = sample_rows(lp, 16, 7, key, torch.arange(3, 40))
    part = sample_rows(lp[10:20], 16, 7, key, torch.arange(13, 23))  # another block
    assert torch.equal(whole.ids[10:20], part.ids)
    assert torch.equal(whole.counts[10:20], part.counts)
    assert bool((whole.counts.sum(-1) == 16).all())
    other_seed = sample_rows(lp, 16, 8, key, torch.arange(3, 40))
    other_key = sample_rows(lp, 16, 7, key + 1, torch.arange(3, 40))
    assert not torch.equal(whole.ids, other_seed.ids)
    assert not torch.equal(whole.ids, other_key.ids)
    # distinct ids ascending, padding (count 0) after them with id 0 and log-prob 0
    drawn = whole.counts > 0
    assert bool((whole.ids[~drawn] == 0).all()) and bool((whole.logprobs[~drawn] == 0).all())
    torch.testing.assert_close(whole.logprobs[drawn], torch.gather(lp, 1, whole.ids)[drawn])


def test_uniforms_cover_the_unit_interval_evenly() -> None:
    u = draw_uniforms(2**64 - 1, 2**63 + 5, torch.arange(2000), 200).flatten()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=100, min=0.0, max=1.0)
    expected = u.numel() / 100
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square_p_value(statistic, 99) > ALPHA


@pytest.mark.parametrize("tau", [1.0, 0.5, 2.0])
def test_counts_fit_the_distribution_they_are_drawn_from(tau: float) -> None:
    lp = _dense(rows=200)
    rows = sample_rows(lp, MAX_SAMPLES, 3, 99, torch.arange(200), tau)
    proposal = torch.log_softmax(lp.double() / tau, -1)
    p_value = chi_square_p_value(*equal_mass_chi_square(rows.ids, rows.counts, proposal))
    assert p_value > ALPHA, f"draws do not fit the proposal at tau {tau}: p = {p_value:.2e}"
    if tau != 1.0:  # the test has power: the draws do not fit p itself
        wrong = chi_square_p_value(*equal_mass_chi_square(rows.ids, rows.counts, lp))
        assert wrong < ALPHA
        assert rows.log_normalizer is not None
        torch.testing.assert_close(
            rows.log_normalizer.double(),
            torch.logsumexp(lp.double() / tau, -1),
            rtol=1e-6,
            atol=1e-6,
        )


def test_request_options_rules_name_field_and_limit() -> None:
    ok = RequestOptions(16, samples=16, seed=3)
    assert ok.sampled and not ok.proposal_normalizer
    cases = [
        (
            {"samples": MAX_SAMPLES + 1, "seed": 1},
            rf"samples: {MAX_SAMPLES + 1} is outside \[0, {MAX_SAMPLES}\]",
        ),
        ({"samples": -1, "seed": 1}, r"samples: -1 is outside"),
        ({"samples": 16}, r"seed: required with samples 16"),
        ({"seed": 4}, r"seed: applies to sampled payloads only"),
        ({"samples": 16, "seed": 2**64}, r"seed: .* is outside \[0, 18446744073709551615\]"),
        (
            {"samples": 16, "seed": 1, "proposal_temperature": 0.0},
            r"proposal_temperature: 0.0 is not",
        ),
        ({"samples": 16, "seed": 1, "proposal_temperature": float("nan")}, r"proposal_temperature"),
        ({"proposal_temperature": 2.0}, r"proposal_temperature: applies to sampled payloads only"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            RequestOptions(16, **kwargs)
    with pytest.raises(InvalidRequestError, match=r"top_k: 8, .* top_k must equal samples \(16\)"):
        RequestOptions(8, samples=16, seed=1)


def test_teacher_limits_on_samples() -> None:
    check_samples(0, TeacherLimits(512, 64))  # not sampled: no limit applies
    with pytest.raises(
        InvalidRequestError,
        match=r"samples: 16, but this teacher serves no sampled payloads \(max_samples 0\)",
    ):
        check_samples(16, TeacherLimits(512, 64))
    with pytest.raises(
        InvalidRequestError, match=r"samples: 100 is outside \[1, 50\] \(max_samples\)"
    ):
        check_samples(100, TeacherLimits(512, 64, max_samples=50))


def test_requests_round_trip_and_unsampled_ones_stay_byte_identical() -> None:
    seqs = [[1, 2, 3, 4]]
    plain = build_request(seqs, 8, request_id="r")
    manual = pb.ScoreRequest(request_id="r", top_k=8, dtype=pb.LOGPROB_DTYPE_FLOAT16)
    manual.sequences.add(token_ids=np.asarray([1, 2, 3, 4], "<i4").tobytes())
    assert plain.SerializeToString() == manual.SerializeToString()
    sampled = build_request(seqs, 16, samples=16, seed=2**64 - 1, proposal_temperature=0.7)
    back = RequestOptions.from_proto(pb.ScoreRequest.FromString(sampled.SerializeToString()))
    assert back == RequestOptions(16, samples=16, seed=2**64 - 1, proposal_temperature=0.7)
    assert back.recorded() == {
        "samples": 16,
        "seed": 2**64 - 1,
        "proposal_temperature": 0.7,
        "student_tokenizer": None,
    }


def test_codec_carries_counts_and_normalizer() -> None:
    lp = _dense(rows=5, vocab=300)
    rows = sample_rows(lp, 24, 1, 2, torch.arange(5), 1.5)
    assert rows.log_normalizer is not None
    arrays = SequenceArrays(
        rows.ids.numpy(),
        rows.logprobs.numpy(),
        np.full(5, -1.5, np.float32),
        7,
        sample_counts=rows.counts.numpy().astype(np.uint8),
        proposal_log_normalizer=rows.log_normalizer.numpy(),
    )
    msg = encode_sequence(arrays, dtype="float32")
    opts = RequestOptions(24, "float32", samples=24, seed=1, proposal_temperature=1.5)
    assert (
        len(msg.ids)
        + len(msg.logprobs)
        + len(msg.sampled_logprobs)
        + len(msg.sample_counts)
        + len(msg.proposal_log_normalizer)
        == 5 * opts.bytes_per_row()
    )
    assert opts.bytes_per_row() == 24 * (4 + 4 + 1) + 4 + 4
    back = decode_sequence(pb.SequencePayload.FromString(msg.SerializeToString()))
    assert back.sample_counts is not None and back.proposal_log_normalizer is not None
    np.testing.assert_array_equal(back.sample_counts, arrays.sample_counts)
    np.testing.assert_array_equal(back.ids, arrays.ids)
    np.testing.assert_array_equal(back.proposal_log_normalizer, arrays.proposal_log_normalizer)
    chunks = [back.rows(0, 2), back.rows(2, 5)]
    joined = SequenceArrays.concat(chunks)
    assert joined.sample_counts is not None
    np.testing.assert_array_equal(joined.sample_counts, arrays.sample_counts)


def test_sampling_refuses_packing_and_candidate_ids_by_name() -> None:
    """A sampled request takes the default encoding and no candidate ids: refused by
    name in the options, in build_request and on the server's parse."""
    with pytest.raises(InvalidRequestError, match=r"encoding: 'packed' does not carry sampled"):
        RequestOptions(8, samples=8, seed=1, encoding="packed")
    cand = [np.zeros((4, 2), np.int32)]
    with pytest.raises(InvalidRequestError, match=r"candidate_ids\[0\]: candidate ids are not"):
        build_request([[1, 2, 3, 4]], 8, samples=8, seed=1, candidate_ids=cand)
    req = build_request([[1, 2, 3, 4]], 8, samples=8, seed=1)
    req.sequences[0].candidate_ids = cand[0].astype("<i4").tobytes()
    req.sequences[0].num_candidates = 2
    limits = Limits(vocab_size=512, max_top_k=64, max_samples=16, max_candidates=8)
    with pytest.raises(
        InvalidRequestError, match=r"sequences\[0\]\.candidate_ids: candidate ids are not scored"
    ):
        parse_request(req, limits)
    req.ClearField("samples")
    req.ClearField("seed")
    assert parse_request(req, limits).sequences[0].num_candidates == 2  # top-k: served
