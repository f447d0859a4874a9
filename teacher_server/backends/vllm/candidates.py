"""Candidate log-probs inside vLLM's worker: gathered in the pass that computes the top-k.

A request's candidate ids (``[S, C]`` for its positions ``[start, end)``, ``-1``
padding) travel to the worker in ``SamplingParams.extra_args[`` :data:`EXTRA_KEY` ``]``
(:func:`extra_args`). Written for vLLM 0.32's V1 model runner, where every served
log-prob row passes through ``Sampler.gather_logprobs(logprobs [N, V], K, token_ids)``,
called

- by the model runner's ``_get_prompt_logprobs_dict`` once per request with prompt
  log-probs, in the order of ``num_prompt_logprobs``, on that request's rows of this
  step (payload positions ``0 .. L-2``), written into a ``[L-1, K+1]`` tensor the runner
  keeps on the request; and
- by ``Sampler.forward`` once per engine step, on one row per request of the batch (in
  ``input_batch.req_ids`` order): the generated token's row, payload position ``L-1``.

:func:`install` wraps those two methods of one worker's model runner (instance
attributes; nothing global). While a wrapped call runs and a request of it has
candidates, ``gather_logprobs`` is wrapped too: it calls the top-k function in use (the
CPU kernel or vLLM's own) and appends the candidate columns, gathered from the *same*
``logprobs`` tensor with one vectorized gather (:func:`~teacher_server.backends.base.
gather_candidates`): no second forward, no second log-softmax, no per-entry Python. The
top-k columns are untouched, so they are the bytes a request without candidates gets.

Row layout the front end reads (:func:`candidate_columns`): a row's **last** ``C``
columns are its candidates. Prompt rows of a request with candidates are ``[K+1+C]``
wide (the wrapper allocates the runner's per-request tensor that wide before vLLM
would); a generated-token row of a step is ``K_max + 1 + C_max`` wide and each request's
candidates are right-aligned in it (``-1`` / NaN to their left), so a request finds its
own ``C`` at the end whatever the others asked. Rows of requests without candidates in
such a step carry padding columns that vLLM's own processor ignores (it reads the first
``K + 1``).

**Sampled payloads** ride the same wrappers: a sampled request's extra columns are its
draws (:mod:`teacher_server.backends.vllm.sampled_draws`), computed from the same
``logprobs`` rows by :func:`topk_protocol.sampling.sample_rows` in place of the gather.

The prompt wrapper replays the runner's loop bookkeeping (which requests, which rows)
to know whose rows each ``gather_logprobs`` call holds, and checks every call against
it (row count and target ids): if a vLLM version changes the loop, the request fails
with a message saying so, never with another request's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EXTRA_KEY", "candidate_columns", "extra_args", "install"]

#: ``SamplingParams.extra_args`` key of a request's candidate ids.
EXTRA_KEY = "topk_distill_candidates"
#: Attribute of the runner's per-request state caching its ``[L, C]`` candidate ids.
_CACHE_ATTR = "_topk_distill_candidate_rows"
_INSTALLED_ATTR = "_topk_distill_candidates_installed"


def extra_args(candidate_ids: np.ndarray, start: int, end: int) -> dict[str, Any]:
    """``extra_args`` entries sending ``[end - start, C]`` candidate ids to the worker."""
    ids = np.ascontiguousarray(candidate_ids, dtype="<i4")
    return {EXTRA_KEY: {"ids": ids.tobytes(), "c": int(ids.shape[1]), "start": start, "end": end}}


def candidate_columns(
    ids: np.ndarray, logprobs: np.ndarray, c: int
) -> tuple[np.ndarray, np.ndarray]:
    """The candidate part of rows the worker widened: their last ``c`` columns."""
    return ids[:, ids.shape[1] - c :], logprobs[:, logprobs.shape[1] - c :]


@dataclass(frozen=True)
class _CandidateColumns:
    """One request's candidate ids ``[L, C]`` int64 (row ``t``: payload position ``t``,
    ``-1`` outside its positions) and how they become extra columns."""

    rows: Any

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    def columns(self, logprobs: Any, first: int, rows: int) -> tuple[Any, Any]:
        """``(ids, values)`` ``[rows, C]`` for the log-probs of positions ``first ..``."""
        from teacher_server.backends.base import gather_candidates

        ids = self.rows[first : first + rows].to(logprobs.device)
        return ids, gather_candidates(logprobs, ids)


def _extra_of(state: Any, length: int) -> Any:
    """A request's extra columns (:class:`_CandidateColumns` or
    :class:`~teacher_server.backends.vllm.sampled_draws.SampleColumns`), or None; built once
    per request."""
    cached = getattr(state, _CACHE_ATTR, False)
    if cached is not False:
        return cached
    import torch

    from teacher_server.backends.vllm.sampled_draws import spec_of

    params = getattr(state, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get(EXTRA_KEY)
    found: Any = spec_of(extra)
    if spec:
        c, start, end = int(spec["c"]), int(spec["start"]), int(spec["end"])
        given = np.frombuffer(spec["ids"], dtype="<i4").reshape(end - start, c)
        full = np.full((length, c), -1, dtype=np.int64)
        full[start:end] = given
        found = _CandidateColumns(torch.from_numpy(full))
    setattr(state, _CACHE_ATTR, found)
    return found


@dataclass(frozen=True)
class _PromptCall:
    """One ``gather_logprobs`` call the prompt loop will make: whose rows, which."""

    req_id: str
    first: int  # prompt row (payload position) of its first row
    rows: int
    targets: list[int]
    extra: Any  # the request's extra columns (see _extra_of), or None


def _with_columns(inner: Any, columns: Any) -> Any:
    """``gather_logprobs`` that calls ``inner`` and appends ``columns(logprobs,
    token_ids)`` (``(ids, values)`` ``[N, E]`` tensors, or None) to its rows."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    def gather_logprobs(logprobs: Any, num_logprobs: int, token_ids: Any) -> Any:
        out = inner(logprobs, num_logprobs, token_ids)
        extra = columns(logprobs, token_ids)
        if extra is None:
            return out
        ids, values = extra
        return LogprobsTensors(
            torch.cat((out.logprob_token_ids, ids.to(out.logprob_token_ids.dtype)), dim=1),
            torch.cat((out.logprobs, values.to(out.logprobs.dtype)), dim=1),
            out.selected_token_ranks,
            *out[3:],
        )

    return gather_logprobs


class _Swap:
    """Replace ``sampler.gather_logprobs`` for one call, then put back what was there."""

    def __init__(self, sampler: Any, replacement: Any) -> None:
        self._sampler, self._replacement = sampler, replacement
        self._had = "gather_logprobs" in vars(sampler)
        self._before = vars(sampler).get("gather_logprobs")

    def __enter__(self) -> None:
        self._sampler.gather_logprobs = self._replacement

    def __exit__(self, *exc: object) -> None:
        if self._had:
            self._sampler.gather_logprobs = self._before
        else:
            del self._sampler.gather_logprobs


def _prompt_calls(runner: Any, num_scheduled_tokens: dict[str, int]) -> list[_PromptCall]:
    """The runner's prompt log-prob loop, replayed: the ``gather_logprobs`` calls it will
    make, in order. Widens the per-request output tensor of requests with candidates."""
    from vllm.v1.outputs import LogprobsTensors

    calls = []
    for req_id, k in runner.num_prompt_logprobs.items():
        n = num_scheduled_tokens.get(req_id)
        state = runner.requests.get(req_id)
        if n is None or state is None or state.prompt_token_ids is None:
            continue
        prompt = state.prompt_token_ids
        extra = _extra_of(state, len(prompt))
        if extra is not None and state.in_progress_prompt_logprobs_cpu is None:
            width = k + 1 + extra.width
            state.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(
                len(prompt) - 1, width
            )
        first = state.num_computed_tokens
        rows = min(n, len(prompt) - (first + 1))
        if rows <= 0:
            continue
        calls.append(
            _PromptCall(
                req_id,
                first,
                rows,
                list(prompt[first + 1 : first + 1 + rows]),
                extra,
            )
        )
    return calls


def _prompt_columns(calls: list[_PromptCall]) -> Any:
    """``columns`` for :func:`_with_columns` over the prompt loop's calls, in order."""
    pending = iter(calls)

    def columns(logprobs: Any, token_ids: Any) -> Any:
        call = next(pending, None)
        if call is None or int(logprobs.shape[0]) != call.rows:
            raise RuntimeError(
                "candidate log-probs: vLLM's prompt log-prob loop made a call this "
                "project's worker extension did not expect (vLLM changed?); refusing to "
                "attach candidates to the wrong rows"
            )
        if call.extra is None:
            return None
        if token_ids.cpu().tolist() != call.targets:
            raise RuntimeError(
                f"candidate log-probs: request {call.req_id}: the prompt rows vLLM "
                "gathered are not the ones expected (vLLM changed?)"
            )
        return call.extra.columns(logprobs, call.first, call.rows)

    return columns


def _generated_columns(runner: Any) -> Any:
    """``columns`` for :func:`_with_columns` over the generated-token rows of this step
    (``[N, E_max]``, each request's extra columns right-aligned, ``-1`` / NaN to their
    left; one call per request with extras), or None when no request of the batch has
    any. Also returns the batch's request count."""
    import torch

    per_row = []
    for req_id in runner.input_batch.req_ids:
        state = runner.requests.get(req_id)
        prompt = None if state is None else state.prompt_token_ids
        extra = None if prompt is None else _extra_of(state, len(prompt))
        per_row.append(None if prompt is None or extra is None else (extra, len(prompt) - 1))
    width = max((e.width for e, _ in filter(None, per_row)), default=0)
    if not width:
        return None, len(per_row)

    def columns(logprobs: Any, token_ids: Any) -> Any:
        ids = torch.full((len(per_row), width), -1, dtype=torch.int64, device=logprobs.device)
        values = torch.full(
            (len(per_row), width), torch.nan, dtype=torch.float32, device=logprobs.device
        )
        for i, row in enumerate(per_row):
            if row is not None:
                extra, last = row
                got_ids, got_values = extra.columns(logprobs[i : i + 1], last, 1)
                ids[i, width - extra.width :] = got_ids[0]
                values[i, width - extra.width :] = got_values[0]
        return ids, values

    return columns, len(per_row)


def install(runner: Any) -> str:
    """Wrap one worker's model runner so that requests with candidates get their
    candidate columns (see the module docstring); idempotent. Returns ``"ok"`` or
    ``"unavailable: <why>"``."""
    sampler: Any = getattr(runner, "sampler", None)
    original_prompt = getattr(runner, "_get_prompt_logprobs_dict", None)
    original_forward = getattr(sampler, "forward", None)
    if not callable(original_prompt) or not callable(original_forward):
        return "unavailable: the model runner has no _get_prompt_logprobs_dict / sampler.forward"
    if not callable(getattr(sampler, "gather_logprobs", None)):
        return "unavailable: the model runner's sampler has no gather_logprobs"
    if getattr(runner, _INSTALLED_ATTR, False):
        return "ok"

    def prompt_logprobs_dict(hidden_states: Any, num_scheduled_tokens: Any) -> Any:
        calls = _prompt_calls(runner, num_scheduled_tokens)
        if all(c.extra is None for c in calls):
            return original_prompt(hidden_states, num_scheduled_tokens)
        gather = _with_columns(sampler.gather_logprobs, _prompt_columns(calls))
        with _Swap(sampler, gather):
            return original_prompt(hidden_states, num_scheduled_tokens)

    def forward(logits: Any, *args: Any, **kwargs: Any) -> Any:
        columns, requests = _generated_columns(runner)
        if columns is None:
            return original_forward(logits, *args, **kwargs)
        if int(logits.shape[0]) != requests:
            raise RuntimeError(
                f"candidate log-probs: the sampler got {logits.shape[0]} rows for the "
                f"batch's {requests} requests (speculative decoding is not supported)"
            )
        gather = _with_columns(sampler.gather_logprobs, columns)
        with _Swap(sampler, gather):
            return original_forward(logits, *args, **kwargs)

    runner._get_prompt_logprobs_dict = prompt_logprobs_dict
    sampler.forward = forward
    setattr(runner, _INSTALLED_ATTR, True)
    return "ok"
