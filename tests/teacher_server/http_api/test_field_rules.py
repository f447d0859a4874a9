"""The one rule for every framework route's body fields (``bodies.FieldRules``), field by
field, on the parsers of vLLM's ``/v1/completions`` and ``/inference/v1/generate``,
SGLang's ``/generate`` and TRL 1.10's ``/get_sequence_logprobs/``:

- every field a route ignores is accepted, answered as without it, and reported with
  its label (the field, or ``(undeclared)``);
- every field a route refuses is a 400-class refusal naming it when given a value that
  would change the answer, and accepted when its value changes nothing;
- the lists match the stock server's own request model: vLLM's ``CompletionRequest``
  field by field (imported from the installed vLLM); SGLang's ``GenerateReqInput`` and
  ``SamplingParams`` as of sgl-project/sglang ``python/sglang/srt/managers/io_struct.py``
  and ``python/sglang/srt/sampling/sampling_params.py`` (not installed here: SGLang is
  a GPU server); TRL 1.10's ``SequenceLogprobsRequest`` read from the pinned release's
  ``trl/scripts/vllm_serve.py`` (a class defined inside a function: read, not imported);
- SGLang's ``SamplingParams`` refuses a key it does not declare, so ``/generate`` does too.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import pytest
from pinned_clients import installed_apart

from teacher_server.http_api.bodies import UNDECLARED, FieldRules
from teacher_server.http_api.sglang.protocol import (
    GENERATE_RULES as SGLANG_RULES,
)
from teacher_server.http_api.sglang.protocol import SAMPLING_RULES, parse_generate
from teacher_server.http_api.trl import SEQUENCE_RULES, parse_sequence_logprobs
from teacher_server.http_api.vllm.protocol import (
    COMPLETIONS_RULES,
    GENERATE_RULES,
    GENERATE_SAMPLING_RULES,
    parse_completions,
    parse_token_generate,
)
from teacher_server.validation import Limits
from topk_protocol import pb
from topk_protocol.errors import InvalidRequestError

LIMITS = Limits(vocab_size=512, max_top_k=64)
INFO = pb.TeacherInfo(model_name="tiny", teacher_temperature=1.0)
COMPLETIONS = {"prompt": [[1, 2, 3]], "max_tokens": 1, "prompt_logprobs": 2}
TOKEN_GENERATE: dict[str, Any] = {
    "token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2},
}
SGLANG = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0}
TRL = {"sequences": [[1, 2, 3]], "prompt_lengths": [1], "top_logprobs": 2}
#: A value that changes something, for any field (not null, false, [] or {}).
SOME_VALUE = 7


def _completions(extra: dict[str, Any]) -> Any:
    return parse_completions({**COMPLETIONS, **extra}, INFO, LIMITS, None)


def _token_generate(extra: dict[str, Any], sampling: dict[str, Any] | None = None) -> Any:
    params = {**TOKEN_GENERATE["sampling_params"], **(sampling or {})}
    return parse_token_generate(
        {**TOKEN_GENERATE, **extra, "sampling_params": params}, INFO, LIMITS
    )


def _sglang(extra: dict[str, Any], sampling: dict[str, Any] | None = None) -> Any:
    return parse_generate({**SGLANG, **extra, "sampling_params": sampling or {}}, None, LIMITS)


def _trl(extra: dict[str, Any]) -> Any:
    return parse_sequence_logprobs({**TRL, **extra}, INFO, LIMITS)


ROUTES = {
    "completions": (COMPLETIONS_RULES, _completions),
    "token_generate": (GENERATE_RULES, _token_generate),
    "token_generate.sampling_params": (
        GENERATE_SAMPLING_RULES,
        lambda extra: _token_generate({}, extra),
    ),
    "sglang": (SGLANG_RULES, _sglang),
    "sglang.sampling_params": (SAMPLING_RULES, lambda extra: _sglang({}, extra)),
    "trl": (SEQUENCE_RULES, _trl),
}
PREFIX = {
    "token_generate.sampling_params": "sampling_params.",
    "sglang.sampling_params": "sampling_params.",
}


def _cases(kind: str) -> list[Any]:
    out = []
    for route, (rules, _) in ROUTES.items():
        names = rules.ignored if kind == "ignored" else frozenset(rules.refused)
        out += [pytest.param(route, name, id=f"{route}:{name}") for name in sorted(names)]
    return out


@pytest.mark.parametrize(("route", "name"), _cases("ignored"))
def test_every_ignored_field_is_accepted_and_reported(route: str, name: str) -> None:
    _, parse = ROUTES[route]
    plain = parse({})
    parsed = parse({name: SOME_VALUE})
    assert parsed.score_request().SerializeToString() != b""
    plain_request, request = plain.score_request(), parsed.score_request()
    plain_request.request_id = request.request_id = ""
    assert request == plain_request
    path = PREFIX.get(route, "") + name
    assert [(f.path, f.label) for f in parsed.ignored_fields] == [(path, path)]


@pytest.mark.parametrize(("route", "name"), _cases("refused"))
def test_every_refused_field_is_refused_by_name(route: str, name: str) -> None:
    _, parse = ROUTES[route]
    path = PREFIX.get(route, "") + name
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(path)}: 7 is not supported"):
        parse({name: SOME_VALUE})
    # A value that changes nothing is accepted, and not reported as ignored.
    assert parse({name: None}).ignored_fields == ()


@pytest.mark.parametrize("route", ["completions", "token_generate", "sglang", "trl"])
def test_an_undeclared_field_is_accepted_and_ignored_as_the_stock_server_does(route: str) -> None:
    _, parse = ROUTES[route]
    parsed = parse({"max_new_tokens": 0, "a_field_no_server_has": {"x": 1}})
    labels = {(f.path, f.label) for f in parsed.ignored_fields}
    assert labels == {("max_new_tokens", UNDECLARED), ("a_field_no_server_has", UNDECLARED)}


def test_sglang_sampling_params_refuse_an_undeclared_key_as_sglang_does() -> None:
    with pytest.raises(
        InvalidRequestError,
        match=r"^sampling_params\.max_tokens: not a field of SGLang's SamplingParams",
    ):
        _sglang({}, {"max_tokens": 1})


def test_read_ignored_and_refused_do_not_overlap() -> None:
    for rules, _ in ROUTES.values():
        assert not rules.read & rules.ignored
        assert not (rules.read | rules.ignored) & frozenset(rules.refused)


def test_completions_rules_name_every_field_of_vllms_completion_request() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    declared = set(protocol.CompletionRequest.model_fields)
    assert COMPLETIONS_RULES.declared == declared


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: SGLang's ``GenerateReqInput`` fields (sgl-project/sglang, io_struct.py), with the
#: ``token_ids_logprob_positions`` extension this teacher reads on top.
SGLANG_GENERATE_REQ_INPUT = _names(
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes "
    "mm_content_hashes use_audio_in_video video_config sampling_params return_logprob "
    "logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask "
    "return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_top_logprobs_b64 "
    "stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len "
    "return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor "
    "positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room "
    "bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank "
    "disagg_prefill_dp_rank kv_router_hint routing_key conversation_id http_worker_ipc "
    "background require_reasoning max_thinking_tokens priority extra_key no_logs "
    "custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header "
    "received_time need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch "
    "min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config "
    "multi_item_delimiter_indices cache_salt"
)
#: SGLang's ``SamplingParams`` API fields (sampling_params.py).
SGLANG_SAMPLING_PARAMS = _names(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p "
    "frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema regex "
    "ebnf structural_tag ignore_eos skip_special_tokens spaces_between_special_tokens "
    "no_stop_trim custom_params stream_interval logit_bias sampling_seed"
)


@pytest.mark.parametrize(
    ("rules", "stock"),
    [
        (SGLANG_RULES, SGLANG_GENERATE_REQ_INPUT | {"token_ids_logprob_positions"}),
        (SAMPLING_RULES, SGLANG_SAMPLING_PARAMS),
    ],
)
def test_sglang_rules_name_every_field_of_its_models(rules: FieldRules, stock: frozenset) -> None:
    assert rules.declared == stock


def test_trl_rules_name_every_field_of_trls_sequence_logprobs_request() -> None:
    """TRL 1.10's own request model, read from the pinned release's source."""
    trl = installed_apart("trl-1.10.0", ["trl==1.10.0"], "trl/generation/vllm_client.py")
    tree = ast.parse((trl / "trl" / "scripts" / "vllm_serve.py").read_text())
    (model,) = [
        n for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "SequenceLogprobsRequest"
    ]  # fmt: skip
    declared = {
        n.target.id
        for n in model.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    # A pydantic BaseModel with no model_config: extra keys are ignored, not refused.
    assert [b.id for b in model.bases if isinstance(b, ast.Name)] == ["BaseModel"]
    assert not any(isinstance(n, ast.Assign) for n in model.body)
    assert SEQUENCE_RULES.declared == declared
    assert not SEQUENCE_RULES.refuse_undeclared


@pytest.mark.parametrize("route", ["completions", "token_generate", "sglang", "trl"])
def test_a_student_tokenizer_is_refused_by_name_on_every_route(route: str) -> None:
    """``student_tokenizer`` would change what the ids mean: never ignored."""
    _, parse = ROUTES[route]
    with pytest.raises(
        InvalidRequestError, match=r'^student_tokenizer: "qwen" is not served on this route'
    ):
        parse({"student_tokenizer": "qwen"})
