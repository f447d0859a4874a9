"""SGLang's ``POST /generate`` on the session's vLLM teacher, sent the bodies slime and
miles send, post-processed as they do, against the dense transformers reference (float32,
within 2e-4): the actual tokens' log-probs, the top-K rows (ids equal where neighbours
are apart) and the ``token_ids_logprob`` log-probs; position 0 (SGLang's ``None``),
``logprob_start_len`` (-1 and > 0) and batches included. Every refusal a 4xx in SGLang's
error shape naming the field and the limit, after which the server keeps serving."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from dense_reference import dense_logprobs

from tests.conftest import ServerProcess

pytestmark = pytest.mark.vllm

#: The issue's bound on |served - dense reference| (float32 engine).
TOL = 2e-4
VOCAB = 512
K = 16


def _seqs() -> list[list[int]]:
    rng = np.random.default_rng(47)
    return [rng.integers(0, VOCAB, n).tolist() for n in (1, 2, 40, 97)]


def _post(server: ServerProcess, body: Any) -> requests.Response:
    return requests.post(f"{server.http}/generate", json=body, timeout=120)


def _slime_body(tokens: list[int], temperature: float = 1.0) -> dict[str, Any]:
    """The body of slime's ``reward_func`` (``slime/rollout/on_policy_distillation.py``
    in THUDM/slime): ``input_ids`` the sample's tokens, ``max_new_tokens`` 0,
    ``return_logprob``, ``logprob_start_len`` 0."""
    return {
        "input_ids": tokens,
        "sampling_params": {
            "temperature": temperature,
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def _slime_teacher_log_probs(reward: dict[str, Any], response_length: int) -> torch.Tensor:
    """slime's ``post_process_rewards``: ``meta_info.input_token_logprobs[1:]``' log-probs,
    the last ``response_length`` of them."""
    t = torch.tensor(
        [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float32
    )
    return t[-response_length:]


def test_slime_on_policy_distillation_call(
    vllm_teacher: ServerProcess, reference_backend: Any
) -> None:
    """slime's body, answered as SGLang shapes it; slime's post-processing gives the
    dense reference's log-probs of the actual tokens (position 0: None, skipped)."""
    for tokens in _seqs():
        r = _post(vllm_teacher, _slime_body(tokens, temperature=0.8))
        assert r.status_code == 200, r.text
        answer = r.json()
        meta = answer["meta_info"]
        assert answer["text"] == "" and answer["output_ids"] == []
        assert meta["prompt_tokens"] == len(tokens) and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["output_token_logprobs"] == []
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(tokens)
        assert entries[0] == [None, tokens[0], None]
        assert [e[1] for e in entries] == tokens and all(e[2] is None for e in entries)
        assert "input_top_logprobs" not in meta
        response_length = max(len(tokens) - 1, 1) // 2 or 1
        got = _slime_teacher_log_probs(answer, response_length).numpy()
        dense = dense_logprobs(reference_backend, tokens)
        want = np.array([dense[q - 1, tokens[q]] for q in range(1, len(tokens))], np.float32)
        want = want[-response_length:] if len(want) else want
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def _check_top(rows: list[Any], dense: np.ndarray, first_row: int, k: int) -> None:
    """``input_top_logprobs`` entries 1.. against the dense rows ``first_row ..``: values
    within TOL, ids equal where the neighbours are more than 2 TOL apart."""
    for j, entry in enumerate(rows):
        row = dense[first_row + j]
        order = np.argsort(-row, kind="stable")[:k]
        lps = np.array([e[0] for e in entry], np.float32)
        ids = [e[1] for e in entry]
        assert len(entry) == k and all(e[2] is None for e in entry)
        np.testing.assert_allclose(lps, row[order], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(lps, row[ids], rtol=TOL, atol=TOL)  # each id's own value
        gaps = -np.diff(row[np.argsort(-row, kind="stable")[: k + 1]])
        for c in range(k):
            apart = (c == 0 or gaps[c - 1] > 2 * TOL) and gaps[c] > 2 * TOL
            if apart:
                assert ids[c] == int(order[c]), (j, c)


def test_top_logprobs_and_token_ids_logprob_with_a_start(
    vllm_teacher: ServerProcess, reference_backend: Any
) -> None:
    """slime's multi-teacher top-k mode (``top_logprobs_num``, read from
    ``input_top_logprobs``) and miles' ``token_ids_logprob`` (read from
    ``input_token_ids_logprobs``), from ``logprob_start_len`` 0 and 25: the first entry
    is None whatever the start, entry ``i`` is position ``start + i``."""
    tokens = _seqs()[3]
    cands = [0, 7, 300, 511, tokens[10]]
    dense = dense_logprobs(reference_backend, tokens)
    for start in (0, 25):
        body = {
            **_slime_body(tokens),
            "logprob_start_len": start,
            "top_logprobs_num": K,
            "token_ids_logprob": cands,
        }
        r = _post(vllm_teacher, body)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        n = len(tokens) - start
        entries = meta["input_token_logprobs"]
        assert len(entries) == n and entries[0] == [None, tokens[start], None]
        got = np.array([e[0] for e in entries[1:]], np.float32)
        want = np.array([dense[q - 1, tokens[q]] for q in range(start + 1, len(tokens))])
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
        top = meta["input_top_logprobs"]
        assert len(top) == n and top[0] is None and meta["output_top_logprobs"] == []
        _check_top(top[1:], dense, start, K)
        by_id = meta["input_token_ids_logprobs"]
        assert len(by_id) == n and by_id[0] is None
        for j, entry in enumerate(by_id[1:]):
            assert [e[1] for e in entry] == cands
            lps = np.array([e[0] for e in entry], np.float32)
            np.testing.assert_allclose(lps, dense[start + j, cands], rtol=TOL, atol=TOL)


def test_per_position_token_ids_logprob(
    vllm_teacher: ServerProcess, reference_backend: Any
) -> None:
    """miles' per-position scoring (``_score_payload`` and ``_per_position_ids`` in
    ``miles/rollout/on_policy_distillation.py``, radixark/miles): ``temperature`` 0,
    ``logprob_start_len`` 0, ``token_ids_logprob_positions`` one id list per input
    position (empty over the prompt); read as miles does (``_trim_input_field``:
    ``values[1:][-response_length:]``, each entry a ``{id: logprob}`` map)."""
    tokens = _seqs()[2]
    prompt_len, response_length = 25, len(tokens) - 25
    rng = np.random.default_rng(7)
    per_pos: list[list[int]] = [[] for _ in range(prompt_len)]
    per_pos += [rng.choice(VOCAB, int(rng.integers(1, 6)), replace=False).tolist()
                for _ in range(response_length)]  # fmt: skip
    body = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob_positions": per_pos,
    }
    r = _post(vllm_teacher, body)
    assert r.status_code == 200, r.text
    values = r.json()["meta_info"]["input_token_ids_logprobs"]
    assert values[0] is None and len(values) == len(tokens)
    maps = [{int(e[1]): float(e[0]) for e in entries} for entries in values[1:][-response_length:]]
    dense = dense_logprobs(reference_backend, tokens)
    for j, got in enumerate(maps):
        q = prompt_len + j  # entry q: the distribution of x[q], dense row q - 1
        assert list(got) == per_pos[q]
        np.testing.assert_allclose(list(got.values()), dense[q - 1, per_pos[q]], rtol=TOL, atol=TOL)
    assert all(entries == [] for entries in values[1:prompt_len])
    short = {**body, "token_ids_logprob_positions": per_pos[:-1]}
    r = _post(vllm_teacher, short)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        f"token_ids_logprob_positions: {len(tokens) - 1} lists for the {len(tokens)} input"
    )


def test_batches_default_start_and_text(
    vllm_teacher: ServerProcess, reference_backend: Any, tiny_model_dir: Path
) -> None:
    """A batch of ``input_ids`` with per-item fields answers a list, one answer per
    sequence in order, each equal to its own request's; ``logprob_start_len`` -1 (the
    default) gives no input entries; a ``text`` and its token ids answer alike."""
    seqs = _seqs()
    body = {
        "input_ids": seqs,
        "return_logprob": True,
        "logprob_start_len": [0, -1, 3, 0],
        "top_logprobs_num": [0, 0, 4, 2],
        "rid": "group",
        "sampling_params": {"max_new_tokens": 0},
    }
    r = _post(vllm_teacher, body)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert isinstance(answers, list) and len(answers) == len(seqs)
    assert [a["meta_info"]["id"] for a in answers] == [f"group_{i}" for i in range(4)]
    assert answers[1]["meta_info"]["input_token_logprobs"] == []
    for i, (tokens, start, top) in enumerate(zip(seqs, [0, 2, 3, 0], [0, 0, 4, 2], strict=True)):
        if i == 1:
            continue
        one = {**_slime_body(tokens), "logprob_start_len": start, "top_logprobs_num": top}
        alone = _post(vllm_teacher, one).json()["meta_info"]
        got = answers[i]["meta_info"]
        for key in ("input_token_logprobs", "input_top_logprobs"):
            assert got.get(key) == alone.get(key), (i, key)
    # Without return_logprob: no log-prob fields at all.
    plain = _post(vllm_teacher, {"input_ids": seqs[2]}).json()["meta_info"]
    assert "input_token_logprobs" not in plain and plain["prompt_tokens"] == len(seqs[2])
    # text == its token ids, as the teacher's tokenizer encodes it.
    from transformers import AutoTokenizer

    text = "Distill the teacher, one position at a time."
    ids = AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)
    by_text_body = {k: v for k, v in _slime_body(ids).items() if k != "input_ids"}
    by_text = _post(vllm_teacher, {**by_text_body, "text": text})
    by_ids = _post(vllm_teacher, _slime_body(ids))
    assert by_text.status_code == 200, by_text.text
    assert (
        by_text.json()["meta_info"]["input_token_logprobs"]
        == (by_ids.json()["meta_info"]["input_token_logprobs"])
    )
    batch = _post(vllm_teacher, {**by_text_body, "text": [text, text]}).json()
    assert [a["meta_info"]["input_token_logprobs"] for a in batch] == [
        by_ids.json()["meta_info"]["input_token_logprobs"]
    ] * 2


def test_refusals_name_the_field_and_the_server_keeps_serving(
    vllm_teacher: ServerProcess,
) -> None:
    ok = _slime_body([1, 2, 3, 4])
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({**ok, "return_hidden_states": True}, 400,
         r"^return_hidden_states: true is not supported by this teacher \(hidden states"),
        ({**ok, "sampling_params": {"max_new_tokens": 16}}, 400,
         r"^sampling_params\.max_new_tokens: 16; this teacher generates nothing \(0 or 1\)"),
        ({**ok, "sampling_params": {"max_tokens": 1}}, 400,
         r"^sampling_params\.max_tokens: not a field of SGLang's SamplingParams"),
        ({**ok, "input_ids": [1, 2, 512]}, 400,
         r"^input_ids\[2\]: 512 is outside the vocabulary \[0, 512\)"),
        ({**ok, "input_ids": [[1, 2], [3, -1]]}, 400,
         r"^input_ids\[1\]\[1\]: -1 is outside the vocabulary"),
        ({**ok, "top_logprobs_num": 300}, 400,
         r"^top_logprobs_num: 300 is outside \[1, 256\] \(max_top_k\)"),
        ({**ok, "token_ids_logprob": [1, 600]}, 400,
         r"^token_ids_logprob\[1\]: 600 is outside the vocabulary"),
        ({**ok, "logprob_start_len": 5}, 400,
         r"^logprob_start_len: 5 is outside \[-1, 4\]"),
        ({**ok, "return_text_in_logprobs": 1}, 400,
         r"^return_text_in_logprobs: expected true or false, got 1"),
        ({**ok, "stream": True}, 400, r"^stream: not supported"),
        ({k: v for k, v in ok.items() if k != "input_ids"}, 400,
         r"^input_ids, text: give exactly one of them"),
        ({**{k: v for k, v in ok.items() if k != "input_ids"}, "text": ""}, 400,
         r'^text: "" encodes to no token'),
        ({**{k: v for k, v in ok.items() if k != "input_ids"}, "text": 5}, 400,
         r"^text: expected a string, got 5"),
        # A lone surrogate (valid JSON escape, no Unicode text): the tokenizer refuses it.
        ({**{k: v for k, v in ok.items() if k != "input_ids"}, "text": "ab\ud800"}, 400,
         r"^text: the teacher's tokenizer cannot encode it"),
        ({**ok, "input_ids": [[1, 2]], "logprob_start_len": [0, 0]}, 400,
         r"^logprob_start_len: 2 values for 1 sequences"),
    ]  # fmt: skip
    for body, status, pattern in cases:
        r = _post(vllm_teacher, body)
        assert r.status_code == status, (body, r.status_code, r.text)
        assert re.search(pattern, r.json()["error"]["message"]), (pattern, r.text)
    r = requests.post(f"{vllm_teacher.http}/generate", data=b"{nope", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: not valid JSON")
    # Still serving.
    r = _post(vllm_teacher, ok)
    assert r.status_code == 200 and len(r.json()["meta_info"]["input_token_logprobs"]) == 4
    metrics = requests.get(f"{vllm_teacher.http}/metrics", timeout=10).text
    assert 'code="OK",method="HTTP /generate"' in metrics
    assert 'code="INVALID_ARGUMENT",method="HTTP /generate"' in metrics
