"""axolotl's online-teacher KD (``kd_online_server: vllm | sglang``) against this
teacher's HTTP port, with axolotl's own code: ``OnlineTeacherCollator.
fetch_online_logprobs_vllm`` and ``fetch_online_logprobs_sglang`` of axolotl 0.19.0
(``src/axolotl/integrations/kd/collator_online_teacher.py`` in axolotl-ai-cloud/axolotl),
installed ``pip --no-deps --target`` into a cache beside the project and run in a
subprocess. Its vLLM-mode body (a batch of token prompts, ``echo``, ``logprobs: true``,
``prompt_logprobs`` and ``top_logprobs`` K, no ``model``, no ``max_tokens``, and
``max_new_tokens``, ``skip_special_tokens``, ``sampling_params`` that vLLM ignores) and
its SGLang-mode body (a batch of ``input_ids``, ``echo``, ``return_text_in_logprobs``)
are sent as its code sends them, and its post-processing (top-K truncation, the optional
renormalization, the label mask) turns the answers into targets, compared with the dense
transformers reference within 2e-4 (ids equal where neighbours are apart); batches,
a one-token sequence and position 0 included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from dense_reference import dense_logprobs
from pinned_clients import installed_apart, run_apart

from tests.conftest import ServerProcess

pytestmark = pytest.mark.vllm

#: The issue's bound on |served - dense reference| (float32 engine).
TOL = 2e-4
VOCAB = 512
K = 8
#: axolotl's release whose client is checked, and what its module needs beyond this
#: project's environment (installed without dependencies, like it).
AXOLOTL = "0.19.0"
EXTRA = ["orjson==3.13.0", "addict==2.4.0"]
PAD_LABEL = -100


@pytest.fixture(scope="module")
def axolotl_dir() -> Path:
    return installed_apart(
        f"axolotl-{AXOLOTL}",
        [f"axolotl=={AXOLOTL}", *EXTRA],
        "axolotl/integrations/kd/collator_online_teacher.py",
    )


#: Runs in a subprocess: axolotl's module imported with its package ``__init__``s
#: skipped (they import the trainer stack: peft, accelerate plugins), then its two fetch
#: methods called on a collator holding the attributes its ``__init__`` sets.
_CALL = """
import importlib, json, sys, types
import requests
target, base_url, mode, batch, labels, top_k, normalize = json.loads(sys.argv[1])
sys.path.insert(0, target)
for name in ("axolotl", "axolotl.integrations", "axolotl.integrations.kd", "axolotl.utils",
             "axolotl.utils.data", "axolotl.utils.collators"):
    package = types.ModuleType(name)
    package.__path__ = [target + "/" + name.replace(".", "/")]
    sys.modules[name] = package
module = importlib.import_module("axolotl.integrations.kd.collator_online_teacher")
assert module.__file__.startswith(target), module.__file__
collator = module.OnlineTeacherCollator.__new__(module.OnlineTeacherCollator)
collator.kd_online_server_base_url = base_url
collator.kd_online_topk = top_k
collator.kd_temperature = 1.0
collator.kd_online_server = mode
collator.http_session = requests.Session()
collator.kd_online_timeout = 120
collator.kd_cache_dir = None
collator.kd_normalize_topk = normalize
fetch = getattr(collator, "fetch_online_logprobs_" + mode)
print(json.dumps(fetch(batch, labels)))
"""


def _fetch(
    axolotl_dir: Path,
    server: ServerProcess,
    mode: str,
    batch: list[list[int]],
    labels: list[list[int]],
    normalize: bool,
) -> dict[str, Any]:
    args = [str(axolotl_dir), server.http, mode, batch, labels, K, normalize]
    out, _ = run_apart(axolotl_dir, _CALL, args)
    assert isinstance(out, dict)
    return out


def _batch() -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(61)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (1, 2, 40, 97)]
    labels = [list(s) for s in seqs]
    labels[2][:10] = [PAD_LABEL] * 10  # the prompt part of a sample: masked
    return seqs, labels


def _renormalized(lps: np.ndarray) -> np.ndarray:
    """axolotl's ``normalize_logprobs``: the K log-probs as a distribution over the K."""
    wide = lps.astype(np.float64)
    return (wide - np.logaddexp.reduce(wide)).astype(np.float32)


def _check_row(
    got_ids: list[int],
    got_lps: list[float],
    want_ids: np.ndarray,
    dense_row: np.ndarray,
    normalize: bool,
) -> None:
    """One target row against the reference: each id's log-prob within TOL (after
    axolotl's renormalization with ``normalize``), the same values as the reference's
    ids, and the same ids wherever the reference's neighbours are further apart than TOL."""
    at_got = dense_row[got_ids]
    expected = _renormalized(at_got) if normalize else at_got
    np.testing.assert_allclose(got_lps, expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.sort(at_got), np.sort(dense_row[want_ids]), rtol=0, atol=TOL)
    values = dense_row[want_ids]
    for j, (g, w) in enumerate(zip(got_ids, want_ids.tolist(), strict=True)):
        near = [abs(values[j] - values[i]) < 2 * TOL for i in range(len(values)) if i != j]
        if not any(near):
            assert g == w, (j, got_ids, want_ids)


def _top(dense_row: np.ndarray, k: int, exclude: int | None = None) -> np.ndarray:
    order = np.argsort(-dense_row, kind="stable")
    if exclude is not None:
        order = order[order != exclude]
    return order[:k]


@pytest.mark.parametrize("normalize", [False, True])
def test_vllm_mode_body_and_post_processing(
    vllm_teacher: ServerProcess, reference_backend: Any, axolotl_dir: Path, normalize: bool
) -> None:
    """``fetch_online_logprobs_vllm``: position ``p`` of a sequence holds, in vLLM's
    order, the actual token ``x[p]`` then the top-K without it, cut to K; position 0 is
    skipped and the rows padded at the end (axolotl's layout)."""
    seqs, labels = _batch()
    got = _fetch(axolotl_dir, vllm_teacher, "vllm", seqs, labels, normalize)
    assert len(got["target_token_ids"]) == len(seqs)
    for b, seq in enumerate(seqs):
        dense = dense_logprobs(reference_backend, seq)
        ids, lps, mask = (got[k][b] for k in ("target_token_ids", "target_logprobs", "target_mask"))
        assert len(ids) == len(lps) == len(mask) == len(seq)
        for p in range(1, len(seq)):
            row = dense[p - 1]
            want = np.concatenate([[seq[p]], _top(row, K - 1, exclude=seq[p])])
            _check_row(ids[p - 1], lps[p - 1], want, row, normalize)
            assert mask[p - 1] == [0 if labels[b][p] == PAD_LABEL else 1] * K
        assert lps[-1] == [-float("inf")] * K and mask[-1] == [0] * K  # axolotl's padding


@pytest.mark.parametrize("normalize", [False, True])
def test_sglang_mode_body_and_post_processing(
    vllm_teacher: ServerProcess, reference_backend: Any, axolotl_dir: Path, normalize: bool
) -> None:
    """``fetch_online_logprobs_sglang``: position 0 padded (SGLang's ``None``), position
    ``p`` the top-K of ``p(. | x[:p])`` from ``input_top_logprobs`` (each entry with its
    text: ``return_text_in_logprobs``)."""
    seqs, labels = _batch()
    got = _fetch(axolotl_dir, vllm_teacher, "sglang", seqs, labels, normalize)
    for b, seq in enumerate(seqs):
        dense = dense_logprobs(reference_backend, seq)
        ids, lps, mask = (got[k][b] for k in ("target_token_ids", "target_logprobs", "target_mask"))
        assert len(ids) == len(seq)
        assert lps[0] == [-float("inf")] * K and mask[0] == [0] * K
        for p in range(1, len(seq)):
            row = dense[p - 1]
            _check_row(ids[p], lps[p], _top(row, K), row, normalize)
            assert mask[p] == [0 if labels[b][p] == PAD_LABEL else 1] * K


def test_the_ignored_fields_are_counted_and_the_text_is_the_tokens(
    vllm_teacher: ServerProcess, tiny_model_dir: Path
) -> None:
    """The fields axolotl sends that the stock servers ignore are accepted, counted in
    ``/metrics`` by route and field; SGLang mode's entries carry each token's text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body: dict[str, Any] = {
        "input_ids": [[5, 6, 7]],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "echo": True,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False},
    }
    answer = requests.post(f"{vllm_teacher.http}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    meta = answer.json()[0]["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 5, tokenizer.decode([5])]
    for entry in meta["input_token_logprobs"][1:] + meta["input_top_logprobs"][1]:
        assert entry[2] == tokenizer.decode([entry[1]])
    completions: dict[str, Any] = {
        "prompt": [[5, 6, 7]],
        "echo": True,
        "logprobs": True,
        "prompt_logprobs": 2,
        "top_logprobs": 2,
        "max_new_tokens": 0,
        "skip_special_tokens": False,
        "temperature": 1.0,
        "sampling_params": {"max_tokens": 0},
    }
    answer = requests.post(f"{vllm_teacher.http}/v1/completions", json=completions, timeout=60)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 3
    # logprobs: true is vLLM's logprobs=1: the echoed prompt's tokens with one top entry.
    assert len(choice["logprobs"]["top_logprobs"][1]) >= 1
    metrics = requests.get(f"{vllm_teacher.http}/metrics", timeout=10).text
    for method, field in [
        ("HTTP /generate", "(undeclared)"),
        ("HTTP /generate", "sampling_params.temperature"),
        ("HTTP /generate", "sampling_params.skip_special_tokens"),
        ("HTTP /v1/completions", "(undeclared)"),
        ("HTTP /v1/completions", "skip_special_tokens"),
    ]:
        line = f'topk_teacher_http_ignored_fields_total{{field="{field}",method="{method}"}}'
        assert line in metrics, (line, [m for m in metrics.splitlines() if "ignored" in m])
