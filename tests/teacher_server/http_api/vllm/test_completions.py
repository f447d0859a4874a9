"""vLLM's ``/v1/completions`` (``echo``, ``logprobs``, text prompts, batches) and token-in
``/inference/v1/generate`` on the session's vLLM teacher, sent the bodies rllm and
Prime-RL send, post-processed as they do, against the dense transformers reference
(float32, within 2e-4): the prompt tokens' log-probs (position 0 ``None``), the top-K
entries (ids equal where neighbours are apart). A text prompt and its token ids answer
alike; every refusal is a 4xx naming the field, after which the server keeps serving."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from dense_reference import dense_logprobs

from tests.conftest import ServerProcess

pytestmark = pytest.mark.vllm

TOL = 2e-4
VOCAB = 512
K = 8


def _seqs() -> list[list[int]]:
    rng = np.random.default_rng(48)
    return [rng.integers(0, VOCAB, n).tolist() for n in (1, 3, 60)]


def _model(server: ServerProcess) -> str:
    models = requests.get(f"{server.http}/v1/models", timeout=30).json()
    return str(models["data"][0]["id"])


def _post(server: ServerProcess, path: str, body: Any) -> requests.Response:
    return requests.post(f"{server.http}{path}", json=body, timeout=120)


def _want_actual(dense: np.ndarray, seq: list[int]) -> np.ndarray:
    return np.array([dense[p - 1, seq[p]] for p in range(1, len(seq))], np.float32)


def _check_entry(entry: dict[str, Any], row: np.ndarray, token: int, k: int) -> int:
    """One vLLM prompt log-prob entry against dense row ``row`` (the distribution of
    ``token``): the prompt token first, its value and its true rank in the vocabulary
    (``1 + #{v : row[v] > row[token]}``; entries within rounding of it may count either
    way); the top ``k`` by rank, ids equal where neighbours are apart. Returns the prompt
    token's rank."""
    keys = list(entry)
    assert keys[0] == str(token)  # vLLM's order: the prompt token first
    rank = entry[str(token)]["rank"]
    surely_above = int(np.count_nonzero(row > row[token] + 2 * TOL))
    maybe_above = int(np.count_nonzero(row > row[token] - 2 * TOL)) - 1  # not itself
    assert 1 + surely_above <= rank <= 1 + maybe_above, (rank, surely_above, maybe_above)
    for key, value in entry.items():
        np.testing.assert_allclose(value["logprob"], row[int(key)], rtol=TOL, atol=TOL)
    order = np.argsort(-row, kind="stable")
    by_rank = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= k)
    assert [r for r, _ in by_rank] == list(range(1, k + 1))
    sorted_row = row[order[: k + 1]]
    for r, t in by_rank:
        apart_before = r == 1 or sorted_row[r - 2] - sorted_row[r - 1] > 2 * TOL
        apart_after = sorted_row[r - 1] - sorted_row[r] > 2 * TOL
        if apart_before and apart_after:
            assert t == int(order[r - 1]), (r, t)
    return int(rank)


def test_rllm_compute_logprobs_echo_call(
    vllm_teacher: ServerProcess, reference_backend: Any, tiny_model_dir: Path
) -> None:
    """rllm's ``OpenAIEngine.compute_logprobs`` (``rllm/engine/rollout/openai_engine.py``
    in rllm-org/rllm): ``completions.create(model, prompt=ids, max_tokens=1, echo=True,
    logprobs=1, temperature=1.0, top_p=1.0)``; it reads
    ``choices[0].logprobs.token_logprobs[:usage.prompt_tokens]``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _model(vllm_teacher)
    for seq in _seqs():
        body = {
            "model": model,
            "prompt": seq,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 1.0,
            "top_p": 1.0,
        }
        r = _post(vllm_teacher, "/v1/completions", body)
        assert r.status_code == 200, r.text
        response = r.json()
        choice = response["choices"][0]
        prompt_length = response["usage"]["prompt_tokens"]
        assert prompt_length == len(seq) and response["usage"]["completion_tokens"] == 0
        prompt_logprobs = choice["logprobs"]["token_logprobs"][:prompt_length]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(seq)
        dense = dense_logprobs(reference_backend, seq)
        got = np.array(prompt_logprobs[1:], np.float32)
        np.testing.assert_allclose(got, _want_actual(dense, seq), rtol=TOL, atol=TOL)
        # vLLM's echo layout: the prompt's text and tokens, top_logprobs keyed by token
        # text (the prompt token and the top 1), text offsets.
        lp = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(seq)
        assert lp["tokens"] == [tokenizer.decode([t]) for t in seq]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(seq))]
        assert lp["top_logprobs"][0] is None
        for p, top in enumerate(lp["top_logprobs"][1:], 1):
            assert 1 <= len(top) <= 2 and lp["tokens"][p] in top
        assert len(choice["prompt_logprobs"]) == len(seq)


def test_openai_client_echo_with_prompt_logprobs(
    vllm_teacher: ServerProcess, reference_backend: Any, tiny_model_dir: Path
) -> None:
    """The ``openai`` Python client, as ms-swift and rllm use it:
    ``completions.create(model, prompt, max_tokens=1, echo=True,
    extra_body={"prompt_logprobs": K})`` with token ids and with the same text; every
    prompt entry (vLLM's extra field on the choice) against the dense reference."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = OpenAI(base_url=f"{vllm_teacher.http}/v1", api_key="unused", max_retries=0)
    model = _model(vllm_teacher)
    seq = _seqs()[2]
    text = tokenizer.decode(seq)
    ids = tokenizer.encode(text)
    for prompt, tokens in ((seq, seq), (text, ids)):
        out = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=1,
            echo=True,
            temperature=1.0,
            extra_body={"prompt_logprobs": K},
        )
        choice = out.choices[0]
        assert out.usage is not None and out.usage.prompt_tokens == len(tokens)
        entries = (choice.model_extra or {})["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(tokens)
        dense = dense_logprobs(reference_backend, tokens)
        ranks = [_check_entry(e, dense[p - 1], tokens[p], K) for p, e in enumerate(entries[1:], 1)]
        assert max(ranks) > K + 1  # outside the top K: the true rank, not K + 1
        assert choice.text == text


def test_text_prompts_prompt_logprobs_and_batches(
    vllm_teacher: ServerProcess, reference_backend: Any, tiny_model_dir: Path
) -> None:
    """ms-swift / vime style: a *text* prompt (the teacher tokenizes), ``echo``,
    ``max_tokens`` 0, ``prompt_logprobs=K``; rllm's ``prompt_logprobs`` reading
    (``lp[str(tid)]["logprob"]`` per prompt id). The text and its ids answer alike, in a
    batch too; entries carry ``decoded_token`` for text prompts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["The teacher scores every position.", "Second prompt, a little longer than that."]
    ids = [tokenizer.encode(t) for t in texts]
    body = {"prompt": texts, "max_tokens": 0, "echo": True, "prompt_logprobs": K}
    r = _post(vllm_teacher, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and [c["text"] for c in choices] == texts
    for choice, seq in zip(choices, ids, strict=True):
        dense = dense_logprobs(reference_backend, seq)
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(seq)
        # rllm's post-processing of prompt_logprobs.
        got = [float(lp[str(tid)]["logprob"]) for tid, lp in zip(seq[1:], entries[1:], strict=True)]
        np.testing.assert_allclose(got, _want_actual(dense, seq), rtol=TOL, atol=TOL)
        for p, entry in enumerate(entries[1:], 1):
            _check_entry(entry, dense[p - 1], seq[p], K)
            assert all(v["decoded_token"] == tokenizer.decode([int(t)]) for t, v in entry.items())
    by_ids = _post(vllm_teacher, "/v1/completions", {**body, "prompt": ids, "echo": False})
    assert by_ids.status_code == 200, by_ids.text
    for a, b in zip(by_ids.json()["choices"], choices, strict=True):
        stripped = [
            None
            if e is None
            else {t: {"logprob": v["logprob"], "rank": v["rank"]} for t, v in e.items()}
            for e in b["prompt_logprobs"]
        ]
        assert a["prompt_logprobs"] == stripped and a["text"] == ""


def test_prime_rl_token_in_generate(vllm_teacher: ServerProcess, reference_backend: Any) -> None:
    """Prime-RL's ``prefill_logprobs`` (``src/prime_rl/utils/client.py`` in
    PrimeIntellect-ai/prime-rl): ``POST /inference/v1/generate`` with ``model``,
    ``token_ids`` and ``sampling_params`` ``{max_tokens: 1, temperature: 1.0, top_p: 1.0,
    prompt_logprobs: 1}``; the answer validated as vLLM's ``GenerateResponse`` (the
    installed vLLM's model) and flattened as Prime-RL does (the first value of each
    entry, 0.0 for the leading token)."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponse

    model = _model(vllm_teacher)
    for seq in _seqs():
        body = {
            "model": model,
            "token_ids": seq,
            "sampling_params": {
                "max_tokens": 1,
                "temperature": 1.0,
                "top_p": 1.0,
                "prompt_logprobs": 1,
            },
        }
        r = _post(vllm_teacher, "/inference/v1/generate", body)
        assert r.status_code == 200, r.text
        response = TypeAdapter(GenerateResponse).validate_json(r.content)
        flat: list[float] = []
        for entry in response.prompt_logprobs or []:
            if not entry:
                flat.append(0.0)
                continue
            first = next(iter(entry.values()))
            lp = first.logprob if hasattr(first, "logprob") else first.get("logprob")
            flat.append(float(lp) if lp is not None else 0.0)
        assert len(flat) == len(seq) and flat[0] == 0.0
        dense = dense_logprobs(reference_backend, seq)
        np.testing.assert_allclose(flat[1:], _want_actual(dense, seq), rtol=TOL, atol=TOL)
        entries = r.json()["prompt_logprobs"][1:]
        ranks = [_check_entry(e, dense[p - 1], seq[p], 1) for p, e in enumerate(entries, 1)]
        assert len(seq) < 60 or max(ranks) > 2  # the true rank, not K + 1


def _refused(r: requests.Response, status: int, pattern: str, nested: bool) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    message = error["message"] if nested else error
    assert re.search(pattern, message), (pattern, r.text)


def test_refusals_name_the_field_and_the_server_keeps_serving(
    vllm_teacher: ServerProcess,
) -> None:
    ok = {"prompt": [[1, 2, 3]], "prompt_logprobs": 4}
    gen = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}
    c, g = "/v1/completions", "/inference/v1/generate"
    cases: list[tuple[str, dict[str, Any], str]] = [
        (c, {**ok, "max_tokens": 2}, r"^max_tokens: 2; this teacher generates nothing"),
        (c, {**ok, "n": 2}, r"^n: 2; only n = 1 is served"),
        (c, {**ok, "prompt_logprobs": 300}, r"^prompt_logprobs: 300 is outside \[1, 256\]"),
        (c, {**ok, "prompt": [[1, 512]]}, r"^prompt\[0\]\[1\]: 512 is outside the vocabulary"),
        (c, {**ok, "prompt": ""}, r'^prompt: "" encodes to no token'),
        (c, {**ok, "prompt": ["ok", "ab\ud800"]},
         r"^prompt\[1\]: the teacher's tokenizer cannot encode it"),
        (c, {"prompt": [[1, 2]], "echo": True}, r"^prompt_logprobs: missing"),
        (c, {**ok, "truncate_prompt_tokens": 2},
         r"^truncate_prompt_tokens: 2 is not supported by this teacher \(the prompt is scored"),
        (c, {**ok, "logprobs": "yes"}, r'^logprobs: expected an int, got "yes"'),
        (g, {**gen, "sampling_params": {"max_tokens": 5, "prompt_logprobs": 1}},
         r"^sampling_params\.max_tokens: 5; this teacher generates nothing"),
        (g, {**gen, "token_ids": [1, 512]}, r"^token_ids\[1\]: 512 is outside the vocabulary"),
        (g, {**gen, "sampling_params": {"prompt_logprobs": 257}},
         r"^sampling_params\.prompt_logprobs: 257 is outside \[1, 256\]"),
        (g, {**gen, "sampling_params": {**gen["sampling_params"], "flat_logprobs": True}},
         r"^sampling_params\.flat_logprobs: true is not supported by this teacher"),
        (g, {**gen, "sampling_params": {"max_tokens": 1}},
         r"^sampling_params\.prompt_logprobs: missing"),
        (g, {**gen, "sampling_params": {"prompt_logprobs": 1, "temperature": 0.5}},
         r"^sampling_params\.temperature: the request asks for 0\.5"),
    ]  # fmt: skip
    for path, body, pattern in cases:
        _refused(_post(vllm_teacher, path, body), 400, pattern, path != "/v1/completions")
    for path in ("/v1/completions", "/inference/v1/generate"):
        r = requests.post(f"{vllm_teacher.http}{path}", data=b"[1,", timeout=60)
        _refused(r, 400, r"^body: not valid JSON", path != "/v1/completions")
    assert _post(vllm_teacher, "/v1/completions", ok).status_code == 200
    assert _post(vllm_teacher, "/inference/v1/generate", gen).status_code == 200
    metrics = requests.get(f"{vllm_teacher.http}/metrics", timeout=10).text
    assert 'code="OK",method="HTTP /inference/v1/generate"' in metrics
    assert 'code="INVALID_ARGUMENT",method="HTTP /inference/v1/generate"' in metrics
