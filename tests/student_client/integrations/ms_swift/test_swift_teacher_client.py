"""ms-swift 4.6.0's own teacher path around the plugin's client, against live teachers.

ms-swift is installed beside the project (``devtools.swift_install``: a folder of its
own, no GPU packages) and runs in a subprocess with that folder on ``PYTHONPATH``. The
driver loads the plugin as ``--external_plugins`` does (swift's ``import_external_file``),
builds the teacher clients with swift's own ``RolloutTrainerMixin._setup_teacher`` from a
``--teacher_model_server`` value (one URL, or swift's JSON list with tags for two
teachers), renders multi-turn chat samples whose completions are given as token ids with
swift's ``chatml`` template, builds the requests with swift's ``build_teacher_requests``,
routes and asks with swift's ``fetch_teacher_parsed_by_routing`` and
``_infer_teacher_requests`` (its ``RequestConfig``, its ``parse_prompt_logprobs``), and
assembles with swift's ``assemble_teacher_output`` (GKD, top-K) and
``assemble_teacher_completion_logprobs`` (GRPO's OPD-RL, the actual tokens). The tensors
are compared here with a dense float64 transformers forward of each teacher's weights."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from dense_reference import dense_logprobs_f64
from side_frameworks import run_driver, student_tokenizer

from devtools.swift_install import swift_env
from devtools.tiny_model import write_tiny_model
from student_client.integrations.ms_swift.plugin import PLUGIN_FILE
from student_client.integrations.ms_swift.teacher_client import SwiftTeacherClient
from topk_protocol.errors import InvalidRequestError

#: The tolerance of the verl plugin's test, against the float64 reference.
TOLERANCE = 2e-4
TOP_K = 8

#: Runs swift's teacher path: ARGV spec.json out.npz.
_DRIVER = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np, torch
from swift.utils import import_external_file
from swift.model import get_processor
from swift.template import get_template
from swift.rl_core.data import GKDSample, OnPolicySample
from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin
from swift.rlhf_trainers.gkd_helpers import (
    assemble_teacher_completion_logprobs, assemble_teacher_output, build_teacher_requests,
    encode_gkd_samples, fetch_teacher_parsed_by_routing)

spec = json.loads(Path(sys.argv[1]).read_text())
import_external_file(spec["plugin"])  # what --external_plugins does
processor = get_processor(spec["student"], model_type="qwen2", download_model=False)
template = get_template(processor, template_type="chatml")
template.set_mode("train")  # GKD's and GRPO's mode (swift's rlhf pipeline)

class Trainer(RolloutTrainerMixin):
    pass

def trainer(topk):
    t = object.__new__(Trainer)
    t.__dict__.update(
        _teacher_model=None, teacher_model_server=spec["server"],
        _teacher_use_disable_adapter=False, args=SimpleNamespace(), template=template,
        accelerator=SimpleNamespace(is_main_process=True, process_index=0),
        gkd_logits_topk=topk)
    t._setup_teacher()
    return t

def fetch(t, samples, requests, topk):
    return fetch_teacher_parsed_by_routing(
        samples, requests, t.teacher_configs, t.teacher_clients,
        gather_fn=t._gather_teacher_requests,
        infer_fn=lambda handle, client: t._infer_teacher_requests(handle, topk, client),
        scatter_fn=t._scatter_teacher_parsed, is_main_process=True)

out = {}
gkd = trainer(spec["topk"])
out["clients"] = np.array([type(c).__name__ for c in gkd.teacher_clients])
samples = [GKDSample(messages=s["messages"], response_token_ids=[s["response"]],
                     extra={"dataset": s["tag"]}) for s in spec["samples"]]
requests = build_teacher_requests(samples, template)
_, teacher_view, _ = encode_gkd_samples(samples, template)
inputs = template.data_collator(teacher_view)
parsed = fetch(gkd, samples, requests, spec["topk"])
teacher = assemble_teacher_output(parsed, inputs, spec["topk"], template.padding_free,
                                  torch.device("cpu"))
out["input_ids"] = inputs["input_ids"].numpy()
out["attention_mask"] = inputs["attention_mask"].numpy()
out["topk_logprobs"] = teacher.topk_logprobs.numpy()
out["topk_indices"] = teacher.topk_indices.numpy()
for i, r in enumerate(requests):
    out[f"encoded_{i}"] = np.array(gkd.teacher_clients[0].encode(r))

grpo = trainer(None)
on_policy = [OnPolicySample(messages=s["messages"], response_token_ids=[s["response"]],
                            extra={"dataset": s["tag"]}) for s in spec["samples"]]
requests = build_teacher_requests(on_policy, template)
parsed = fetch(grpo, on_policy, requests, 0)
lengths = [len(s["response"]) for s in spec["samples"]]
mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
for i, n in enumerate(lengths):
    mask[i, :n] = 1
completion = assemble_teacher_completion_logprobs(
    parsed, mask, torch.device("cpu"), [s.response_token_ids for s in on_policy])
out["completion_logprobs"] = completion.topk_logprobs.numpy()
out["completion_indices"] = completion.topk_indices.numpy()
for i, r in enumerate(requests):
    out[f"grpo_encoded_{i}"] = np.array(grpo.teacher_clients[0].encode(r))
np.savez(sys.argv[2], **out)
"""


def _samples(seed: int) -> list[dict]:
    """Multi-turn chats (a system prompt, an earlier exchange, a question), each with a
    student completion of token ids, routed by ``dataset`` tag."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((5, 37, 123)):
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Hi, I am user {i}."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "What is " + "six times seven? " * (i + 1)},
            {"role": "assistant", "content": None},
        ]
        completion = rng.integers(32, 127, n).tolist()  # printable bytes, as sampled
        out.append({"messages": messages, "response": completion, "tag": ("math", "code")[i % 2]})
    return out


def _unpadded(arrays: dict[str, np.ndarray], i: int) -> list[int]:
    return arrays["input_ids"][i][arrays["attention_mask"][i].astype(bool)].tolist()


@pytest.mark.vllm
def test_swift_s_teacher_path_on_live_teachers(
    vllm_teacher, teacher_factory, tiny_model_dir, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """GKD at K = 8 and GRPO's actual-token log-probs, two teachers routed by tag: the
    vLLM teacher of the tiny model and a transformers teacher of other weights."""
    other_dir = write_tiny_model(tmp_path / "other-teacher", seed=1)
    other = teacher_factory(["--backend", "transformers", "--model", str(other_dir)])
    server = json.dumps([
        {"url": f"topk-distill://{vllm_teacher.target}", "tags": ["math"]},
        {"url": f"topk-distill://{other.target}", "tags": ["code"]},
    ])  # fmt: skip
    samples = _samples(0)
    spec = {"student": str(tiny_model_dir), "server": server, "topk": TOP_K, "samples": samples}
    got = run_driver(_DRIVER, {"plugin": str(PLUGIN_FILE), **spec}, tmp_path, swift_env())
    assert got["clients"].tolist() == ["SwiftTeacherClient", "SwiftTeacherClient"]
    weights = {"math": tiny_model_dir, "code": other_dir}
    for i, sample in enumerate(samples):
        tokens = _unpadded(got, i)
        n = len(tokens)
        # the client renders what swift's trainer encodes: the same ids, the completion
        # as given, then the template's end of turn
        assert got[f"encoded_{i}"].tolist() == tokens
        start = tokens.index(sample["response"][0], n - len(sample["response"]) - 12)
        assert tokens[start : start + len(sample["response"])] == sample["response"]
        dense = dense_logprobs_f64(weights[sample["tag"]], tokens)[: n - 1]
        lps, ids = got["topk_logprobs"][i], got["topk_indices"][i]
        best = -np.sort(-dense, axis=-1)[:, :TOP_K]
        np.testing.assert_allclose(lps[: n - 1], best, rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(
            np.take_along_axis(dense, ids[: n - 1], -1), lps[: n - 1], rtol=0, atol=TOLERANCE
        )
        assert np.isneginf(lps[n - 1 :]).all()  # swift's fill past the sequence

        # GRPO: no end of turn after the completion; its tokens' own log-probs
        grpo = got[f"grpo_encoded_{i}"].tolist()
        count = len(sample["response"])
        assert grpo[-count:] == sample["response"] and grpo == tokens[: len(grpo)]
        dense = dense_logprobs_f64(weights[sample["tag"]], grpo)
        positions = np.arange(len(grpo) - count, len(grpo))
        np.testing.assert_array_equal(got["completion_indices"][i, :count, 0], sample["response"])
        np.testing.assert_allclose(
            got["completion_logprobs"][i, :count, 0],
            dense[positions - 1, sample["response"]],
            rtol=0,
            atol=TOLERANCE,
        )
    # the two teachers differ, so each sample matching its own shows where it was routed
    assert not np.allclose(
        dense_logprobs_f64(tiny_model_dir, _unpadded(got, 1))[:5],
        dense_logprobs_f64(other_dir, _unpadded(got, 1))[:5],
    )


@pytest.mark.vllm
def test_the_start_up_check_passes_a_matching_teacher(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    info = SwiftTeacherClient(vllm_teacher.target).check(
        student_tokenizer(tiny_model_dir), 8, "--s"
    )
    assert info.max_top_k == 256


@pytest.mark.vllm
def test_another_tokenizer_names_the_setting(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    other = student_tokenizer(tiny_model_dir, extra="<not-in-the-teacher>")
    with pytest.raises(ValueError, match=r"^--teacher_model_server: the teacher at .*tokenizer"):
        SwiftTeacherClient(vllm_teacher.target).check(other, 8, "--teacher_model_server")


@pytest.mark.vllm
def test_a_top_k_over_the_teacher_s_names_gkd_logits_topk(vllm_teacher, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"^--gkd_logits_topk: 300, but the teacher at"):
        SwiftTeacherClient(vllm_teacher.target).check(student_tokenizer(tiny_model_dir), 300, "--s")


def test_a_wrong_url_names_the_setting(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SwiftTeacherClient(f"127.0.0.1:{port}", retries=1, timeout_s=5)
    with pytest.raises(ValueError, match=r"^--teacher_model_server: the teacher at 127"):
        client.check(student_tokenizer(tiny_model_dir), 8, "--teacher_model_server")


@pytest.mark.parametrize("config", [None, {}, {"prompt_logprobs": None}])
def test_a_call_without_prompt_logprobs_names_the_field(config: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"^request_config.prompt_logprobs: a topk"):
        SwiftTeacherClient("127.0.0.1:1").infer([{"messages": []}], config)


def test_bad_prompt_logprobs_and_multi_modal_requests_name_the_field() -> None:
    client = SwiftTeacherClient("127.0.0.1:1")
    with pytest.raises(InvalidRequestError, match=r"^prompt_logprobs: expected an int >= 0"):
        client.infer([{"messages": []}], {"prompt_logprobs": -1})
    with pytest.raises(InvalidRequestError, match=r"^infer_requests\[\].images: a topk"):
        client.encode({"messages": [], "images": ["a.png"]})
    with pytest.raises(RuntimeError, match="no template bound"):
        client.encode({"messages": [{"role": "user", "content": "hi"}]})
    assert client.infer([], {"prompt_logprobs": 8}) == []
