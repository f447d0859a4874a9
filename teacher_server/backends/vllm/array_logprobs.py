"""The array log-prob path: vLLM's top-k log-prob arrays straight to the payload.

One of the vLLM hooks (:data:`~teacher_server.backends.vllm.hooks.ARRAY_LOGPROBS`: the
versions it was checked against, its fallback).

vLLM's engine core sends the front-end process, per request, the prompt log-probs as a
``LogprobsTensors`` (``[rows, K+1]`` int32 token ids and float32 log-probs, column 0 the
actual next token, columns 1..K the top-K in descending order, and ``[rows]`` the actual
token's rank in the vocabulary, which the engine core counts; ``rows`` = prompt length - 1,
delivered in one or more chunks) and the generated token's log-probs as a
``LogprobsLists`` (numpy, ``[1, K_max+1]``, where ``K_max`` is the largest K in that
engine step's batch). vLLM's own ``LogprobsProcessor`` then turns every entry into a
Python object (``.tolist()`` and a Python loop per position), which costs several
microseconds per position at K = 64.

The hook: the backend marks its requests (``SamplingParams.extra_args``), and
:func:`attach` wraps ``add_request`` of one engine's output processor so that a
marked request gets an :class:`ArrayLogprobsProcessor` (a ``LogprobsProcessor`` whose two
``_update_*`` methods keep the arrays as they arrive, by reference). ``RequestOutput``
then carries :class:`LogprobArrays` in place of ``prompt_logprobs`` and
``outputs[0].logprobs``, and :func:`topk_payload` builds the payload with numpy. Requests
without the mark (and every other engine) are untouched.

:func:`hook_problem` checks, at start-up, that the installed vLLM is a version this was
written for and that the hook point still behaves as expected (a synthetic engine output
goes through vLLM's stock processor and through ours, and must give the same entries);
the backend falls back to the ``flat_logprobs`` path with one warning otherwise
(:func:`~teacher_server.backends.vllm.hooks.report`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.backends.vllm import hooks
from teacher_server.backends.vllm.candidates import candidate_columns
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays

__all__ = [
    "LOGPROBS_PATHS",
    "MARKER",
    "LogprobArrays",
    "attach",
    "hook_problem",
    "payload_from_output",
    "processor_for",
    "sampled_payload",
    "sampling_overrides",
    "select_path",
    "topk_payload",
]

#: ``--logprobs-path`` choices: ``auto`` (arrays where the hook checks out, else flat),
#: ``arrays`` (required: fail at start-up if the hook does not check out; any version),
#: ``flat`` (vLLM's ``flat_logprobs`` lists, converted with numpy).
LOGPROBS_PATHS = ("auto", "arrays", "flat")

#: Key in ``SamplingParams.extra_args`` that marks a request for the array path.
MARKER = "topk_distill_arrays"

log = logging.getLogger(__name__)

#: One chunk of rows as the engine sent it: ``(ids [r, C], logprobs [r, C], ranks [r])``.
Rows = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]


class LogprobArrays:
    """Log-prob rows of one request as they arrived: chunks of ``(ids [r, C], logprobs
    [r, C], ranks [r])``, column 0 the actual token, columns 1..K the top-K (C >= K+1),
    ``ranks`` the actual token's rank in the vocabulary."""

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks: list[Rows] = []

    def append_chunk(
        self, ids: npt.NDArray[Any], logprobs: npt.NDArray[Any], ranks: npt.NDArray[Any]
    ) -> None:
        self.chunks.append((ids, logprobs, ranks))

    def __len__(self) -> int:
        return sum(len(ids) for ids, _, _ in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def __repr__(self) -> str:
        return f"LogprobArrays(rows={len(self)}, chunks={len(self.chunks)})"


@dataclass(frozen=True)
class _Out:
    """The ``[S, ...]`` arrays :func:`_fill` writes: top-K ``ids`` / ``lps`` ``[S, K]``, the
    actual token's log-prob ``actual`` and ``ranks`` ``[S]``, and the candidate columns
    ``cand`` (``(ids, logprobs)`` ``[S, C]``) or None."""

    ids: npt.NDArray[np.int32]
    lps: npt.NDArray[np.float32]
    actual: npt.NDArray[np.float32]
    ranks: npt.NDArray[np.int32]
    cand: tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]] | None

    @classmethod
    def empty(cls, s: int, k: int, c: int) -> _Out:
        cand = (np.empty((s, c), np.int32), np.empty((s, c), np.float32)) if c else None
        return cls(
            np.empty((s, k), np.int32),
            np.empty((s, k), np.float32),
            np.empty(s, np.float32),
            np.empty(s, np.int32),
            cand,
        )

    def rows(self, rows: slice) -> _Out:
        cand = None if self.cand is None else (self.cand[0][rows], self.cand[1][rows])
        return _Out(self.ids[rows], self.lps[rows], self.actual[rows], self.ranks[rows], cand)


def _fill(chunks: Sequence[Rows], start: int, stop: int, k: int, out: _Out) -> None:
    """Copy rows ``[start, stop)`` of the concatenated chunks into ``out``'s ``[stop -
    start, ...]`` arrays: top-K columns into ``ids`` / ``lps``, column 0 into ``actual``,
    the ranks into ``ranks`` and, with ``out.cand``, the last C columns
    (:func:`~teacher_server.backends.vllm.candidates.candidate_columns`)."""
    cand = out.cand
    c = 0 if cand is None else cand[0].shape[1]
    offset = 0
    for c_ids, c_lps, c_ranks in chunks:
        n = len(c_ids)
        lo, hi = max(start - offset, 0), min(stop - offset, n)
        if lo < hi:
            if c_ids.shape[1] < k + 1 + c or c_lps.shape != c_ids.shape:
                raise RuntimeError(
                    f"vLLM log-prob rows have shape {c_ids.shape} / {c_lps.shape}; "
                    f"expected [rows, >= {k + 1 + c}] for K = {k}, C = {c}"
                )
            dst = slice(offset + lo - start, offset + hi - start)
            out.ids[dst] = c_ids[lo:hi, 1 : k + 1]
            out.lps[dst] = c_lps[lo:hi, 1 : k + 1]
            out.actual[dst] = c_lps[lo:hi, 0]
            out.ranks[dst] = c_ranks[lo:hi]
            if cand is not None:
                got_ids, got_lps = candidate_columns(c_ids[lo:hi], c_lps[lo:hi], c)
                cand[0][dst] = got_ids
                cand[1][dst] = got_lps
        offset += n


def _rows(
    chunks: tuple[Sequence[Rows], Sequence[Rows]], length: int, k: int, span: range, c: int
) -> _Out:
    """Positions ``[start, end)`` of a sequence of ``length`` tokens: ``ids`` /
    ``lps`` ``[S, K]`` (the top-K columns as they came), ``actual`` and ``ranks`` ``[S]``
    (NaN and 0 at the last when ``end == length``) and, for ``c > 0``, the rows' last
    ``c`` columns (``cand``, ``(ids, logprobs)`` ``[S, c]``; else None). ``chunks``: those
    of the prompt rows (``length - 1`` rows in all; row ``t`` predicts ``x[t+1]``) and of
    the generated token's rows (row 0 is the distribution after the whole sequence)."""
    prompt, sample = chunks
    start, end = span.start, span.stop
    rows = sum(len(i) for i, _, _ in prompt)
    if rows != length - 1:
        raise RuntimeError(f"vLLM returned {rows} prompt log-prob rows; expected {length - 1}")
    s = end - start
    out = _Out.empty(s, k, c)
    p_end = min(end, length - 1)
    _fill(prompt, start, p_end, k, out)
    if end == length:
        if sum(len(i) for i, _, _ in sample) < 1:
            raise RuntimeError("vLLM returned no log-probs for the generated token")
        _fill(sample, 0, 1, k, out.rows(slice(s - 1, s)))
        out.actual[-1] = np.nan  # no next token: the generated one is not part of it
        out.ranks[-1] = 0
    return out


def topk_payload(
    prompt: Sequence[Rows],
    sample: Sequence[Rows],
    length: int,
    k: int,
    start: int,
    end: int,
    candidate_ids: npt.NDArray[np.int32] | None = None,
) -> SequenceArrays:
    """Payload positions ``[start, end)`` of a sequence of ``length`` tokens.

    ``prompt``: chunks of the prompt rows (``length - 1`` rows in all; row ``t`` predicts
    ``x[t+1]``); ``sample``: the generated token's rows (row 0 is the distribution after
    the whole sequence, used when ``end == length``). Returns ``ids`` ``[S, K]``,
    ``logprobs`` ``[S, K]`` sorted descending, ``sampled_logprobs`` and ``sampled_ranks``
    ``[S]`` (the actual next token's log-prob and its rank, counted by the engine) with
    ``S = end - start``, NaN and 0 at the last when ``end == length``; with
    ``candidate_ids`` (``[S, C]``, the request's), ``candidate_logprobs`` ``[S, C]`` from
    the rows' last C columns, which the worker gathered at exactly those ids (checked: a
    mismatch raises).
    """
    c = 0 if candidate_ids is None else int(candidate_ids.shape[1])
    out = _rows((prompt, sample), length, k, range(start, end), c)
    ids, lps, cand = out.ids, out.lps, out.cand
    s = end - start
    if cand is not None and not np.array_equal(cand[0], np.asarray(candidate_ids)):
        raise RuntimeError("vLLM's candidate columns do not hold the request's candidate ids")
    # vLLM's top-k comes sorted; sort (stably, as the flat path does) only if it is not.
    if s and k > 1 and not np.all(lps[:, :-1] >= lps[:, 1:]):
        order = np.argsort(-lps, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, axis=1)
        lps = np.take_along_axis(lps, order, axis=1)
    return SequenceArrays(
        ids,
        lps,
        out.actual,
        start,
        candidate_ids=None if cand is None else candidate_ids,
        candidate_logprobs=None if cand is None else cand[1],
        sampled_ranks=out.ranks,
    )


def sampled_payload(out: Any, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
    """The sampled payload of a final ``RequestOutput`` of a marked sampled request
    (:mod:`teacher_server.backends.vllm.sampled_draws`): the rows' draw columns, converted as
    the transformers backend converts its draws
    (:func:`teacher_server.backends.base.sampled_arrays`)."""
    from teacher_server.backends.base import sampled_arrays
    from teacher_server.backends.vllm.sampled_draws import TOP_K, drawn_rows

    prompt, sample = _arrays_of(out)
    s = sequence
    width = 2 * options.samples + 1
    chunks = (prompt.chunks, sample.chunks)
    out = _rows(chunks, len(s.token_ids), TOP_K, range(s.start, s.end), width)
    if out.cand is None:  # width >= 1: never
        raise RuntimeError("sampled payload: the engine rows carry no draw columns")
    drawn = drawn_rows(out.cand[0], out.cand[1], options)
    return sampled_arrays(drawn, out.actual if options.include_sampled else None, s.start)


def _arrays_of(out: Any) -> tuple[LogprobArrays, LogprobArrays]:
    """The prompt and generated-token rows of a final ``RequestOutput`` of a marked request."""
    prompt = out.prompt_logprobs
    sample = out.outputs[0].logprobs
    if not isinstance(prompt, LogprobArrays) or not isinstance(sample, LogprobArrays):
        raise RuntimeError(
            "the request was not handled by the array log-prob path "
            f"(got {type(prompt).__name__} / {type(sample).__name__})"
        )
    return prompt, sample


def payload_from_output(out: Any, k: int, sequence: ParsedSequence) -> SequenceArrays:
    """:func:`topk_payload` of a final ``RequestOutput`` of a marked request that scored
    ``sequence`` (its length, positions and candidate ids) at K = ``k``."""
    prompt, sample = _arrays_of(out)
    s = sequence
    return topk_payload(
        prompt.chunks, sample.chunks, len(s.token_ids), k, s.start, s.end, s.candidate_ids
    )


def sampling_overrides() -> dict[str, Any]:
    """``SamplingParams`` fields that send a request down the array path: the mark, and
    one final output only (no intermediate ``RequestOutput`` per prefill chunk)."""
    from vllm.sampling_params import RequestOutputKind

    return {"extra_args": {MARKER: True}, "output_kind": RequestOutputKind.FINAL_ONLY}


@functools.cache
def _processor_class() -> type:
    import torch
    from vllm.v1.engine.logprobs import LogprobsProcessor

    class ArrayLogprobsProcessor(LogprobsProcessor):
        """vLLM's ``LogprobsProcessor`` that keeps the engine's arrays (no Python object
        per entry). ``prompt_logprobs`` / ``logprobs`` are :class:`LogprobArrays`."""

        def _update_prompt_logprobs(self, prompt_logprobs_tensors: Any) -> None:
            ids, lps, ranks = prompt_logprobs_tensors[:3]
            if lps.dtype == torch.bfloat16:  # numpy has no bfloat16 (vLLM sends float32)
                lps = lps.float()
            rows: Any = self.prompt_logprobs  # a LogprobArrays (see processor_for)
            # Views of the received message, no copy; kept until the payload is built.
            rows.append_chunk(ids.cpu().numpy(), lps.cpu().numpy(), ranks.cpu().numpy())

        def _update_sample_logprobs(self, logprobs_lists: Any) -> None:
            ids, lps, ranks = logprobs_lists[:3]
            rows: Any = self.logprobs  # a LogprobArrays (see processor_for)
            rows.append_chunk(ids, lps, ranks)
            for value in lps[:, 0].tolist():  # one per generated token
                self.cumulative_logprob += value

    return ArrayLogprobsProcessor


def processor_for(num_logprobs: int | None, num_prompt_logprobs: int | None) -> Any:
    """A fresh array processor for one request."""
    return _processor_class()(
        tokenizer=None,
        logprobs=LogprobArrays(),
        prompt_logprobs=LogprobArrays(),
        cumulative_logprob=0.0,
        num_logprobs=num_logprobs,
        num_prompt_logprobs=num_prompt_logprobs,
    )


def attach(output_processor: Any) -> None:
    """Give the marked requests of one engine's output processor (``AsyncLLM.
    output_processor``) the array processor; idempotent.

    Wraps ``add_request`` on that instance only: the stock method registers the request
    (with vLLM's processor) before the engine core sees it, then the wrapper swaps in an
    ``ArrayLogprobsProcessor`` if the request carries :data:`MARKER` in
    ``SamplingParams.extra_args``.
    """
    op = output_processor
    if getattr(op, "_topk_distill_arrays", False):
        return
    original = op.add_request
    states = op.request_states

    def add_request(request: Any, *args: Any, **kwargs: Any) -> None:
        new = request.request_id not in states
        original(request, *args, **kwargs)
        params = request.sampling_params
        if new and params is not None and (params.extra_args or {}).get(MARKER):
            state = states.get(request.request_id)
            if state is not None:
                state.logprobs_processor = processor_for(params.logprobs, params.prompt_logprobs)

    op.add_request = add_request
    op._topk_distill_arrays = True


def _self_check() -> str | None:
    """Feed one synthetic engine output (two prompt chunks, a generated-token row wider
    than K + 1) to vLLM's stock ``flat_logprobs`` processor and to ours; the entries must
    agree. Returns what differs, or None."""
    import torch
    from vllm.logprobs import create_prompt_logprobs, create_sample_logprobs
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    k, rows = 3, 5
    rng = np.random.default_rng(0)
    p_ids = rng.integers(0, 100, (rows, k + 1)).astype(np.int32)
    p_lps = -np.sort(rng.random((rows, k + 1)), axis=1).astype(np.float32)
    s_ids = rng.integers(0, 100, (1, k + 3)).astype(np.int32)
    s_lps = -np.sort(rng.random((1, k + 3)), axis=1).astype(np.float32)
    ranks = np.arange(7, 7 + rows, dtype=np.int32)  # distinct: a mix-up shows
    stock: Any = LogprobsProcessor(
        tokenizer=None,
        logprobs=create_sample_logprobs(True),
        prompt_logprobs=create_prompt_logprobs(True),
        cumulative_logprob=0.0,
        num_logprobs=k,
        num_prompt_logprobs=k,
    )
    ours = processor_for(k, k)
    for lo, hi, sample in ((0, 2, None), (2, rows, (s_ids, s_lps))):
        out = EngineCoreOutput(
            request_id="topk-distill-self-check",
            new_token_ids=[] if sample is None else [int(s_ids[0, 0])],
            new_logprobs=(
                None if sample is None else LogprobsLists(*sample, np.full(1, 3, np.int32))
            ),
            new_prompt_logprobs_tensors=LogprobsTensors(
                torch.from_numpy(p_ids[lo:hi]),
                torch.from_numpy(p_lps[lo:hi]),
                torch.from_numpy(ranks[lo:hi]),
            ),
        )
        stock.update_from_output(out)
        ours.update_from_output(out)
    flat_p, flat_s = stock.prompt_logprobs, stock.logprobs
    # The stock container starts with an empty row for the first prompt token.
    want_p = [_flat_entry(flat_p, a, b) for a, b in _spans(flat_p)][1:]
    want_s = [_flat_entry(flat_s, a, b) for a, b in _spans(flat_s)]
    got_p = _entries(ours.prompt_logprobs, k)
    got_s = _entries(ours.logprobs, k)
    if want_p != got_p:
        return "prompt log-prob entries differ from vLLM's own processor"
    if want_s != got_s:
        return "generated-token log-prob entries differ from vLLM's own processor"
    if stock.cumulative_logprob != ours.cumulative_logprob:
        return "cumulative log-prob differs from vLLM's own processor"
    return None


def _spans(flat: Any) -> list[tuple[int, int]]:
    return list(zip(flat.start_indices, flat.end_indices, strict=True))


#: One position's entries for the self-check: ids, log-probs, the actual token's rank.
_Entry = tuple[list[int], list[float], int]


def _flat_entry(flat: Any, a: int, b: int) -> _Entry:
    return flat.token_ids[a:b], flat.logprobs[a:b], flat.ranks[a]


def _entries(arrays: LogprobArrays, k: int) -> list[_Entry]:
    return [
        (i[: k + 1].tolist(), lp[: k + 1].tolist(), int(r))
        for ids, lps, ranks in arrays.chunks
        for i, lp, r in zip(ids, lps, ranks, strict=True)
    ]


def hook_problem(engine: Any = None, *, check_version: bool = True) -> str | None:
    """Why the array path cannot be used with the installed vLLM (and ``engine``, if given),
    or None when it can. ``check_version=False`` skips only the version check."""
    try:
        version = hooks.installed_version()
    except ImportError as exc:
        return f"vLLM cannot be imported ({exc})"
    if check_version and (problem := hooks.version_problem(hooks.ARRAY_LOGPROBS)) is not None:
        return problem
    if engine is not None:
        op = getattr(engine, "output_processor", None)
        if not callable(getattr(op, "add_request", None)) or not isinstance(
            getattr(op, "request_states", None), dict
        ):
            return "the engine has no output_processor.add_request / request_states"
    try:
        problem = _self_check()
    except Exception as exc:  # any drift in vLLM's classes shows up here
        return f"vLLM {version}: the hook self-check failed ({type(exc).__name__}: {exc})"
    return None if problem is None else f"vLLM {version}: {problem}"


def select_path(requested: str, engine: Any) -> str:
    """Resolve ``requested`` (one of :data:`LOGPROBS_PATHS`) to ``"arrays"`` or ``"flat"``
    for ``engine`` and :func:`attach` the hook when arrays are used. ``auto`` reports the
    hook installed or fallen back (:func:`~teacher_server.backends.vllm.hooks.report`);
    ``arrays`` raises when the hook does not check out."""
    if requested not in LOGPROBS_PATHS:
        raise ValueError(f"logprobs_path: {requested!r} is not one of {', '.join(LOGPROBS_PATHS)}")
    if requested == "flat":
        return "flat"
    problem = hook_problem(engine, check_version=requested == "auto")
    if problem is not None:
        if requested == "arrays":
            raise RuntimeError(
                f"logprobs_path arrays: the array log-prob path cannot be used: {problem}"
            )
        hooks.report(hooks.ARRAY_LOGPROBS, problem)
        return "flat"
    untested = hooks.version_problem(hooks.ARRAY_LOGPROBS)
    if requested == "arrays" and untested is not None:
        log.warning("array log-prob path forced on an untested vLLM: %s", untested)
    attach(engine.output_processor)
    hooks.report(hooks.ARRAY_LOGPROBS, None)
    return "arrays"
