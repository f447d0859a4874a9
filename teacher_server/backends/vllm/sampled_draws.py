"""Sampled payloads inside vLLM's worker: drawn from the rows the top-k comes from.

A sampled request's draw parameters (N, the seed, the sequence key, the proposal
temperature) travel to the worker in ``SamplingParams.extra_args[`` :data:`EXTRA_KEY` ``]``
(:func:`extra_args`), the way candidate ids do, and the worker's wrapped
``gather_logprobs`` (:mod:`teacher_server.backends.vllm.candidates`) calls
:func:`topk_protocol.sampling.sample_rows` on the *same* ``[rows, V]`` served log-probs
(``log_softmax(z / T)``) it takes the top-k from, for the request's prompt rows (payload
positions ``0 .. L-2``) and its generated-token row (position ``L-1``). No second forward,
no per-entry Python: the transformers backend calls the same function on its dense rows,
so both backends draw the same ids wherever their float32 distributions agree.

Columns the worker appends to a row (:class:`SampleColumns`, ``2N + 1`` of them, the
row's last): ``N`` drawn ids (``logprobs``: the teacher's log-probs at them), ``N`` counts
held in the id tensor (``logprobs`` 0), and one column whose ``logprobs`` entry is the
proposal's ``log Z`` (0 at ``tau`` = 1). The front end reads them back
(:func:`drawn_rows`) and builds the payload with
:func:`teacher_server.backends.base.sampled_arrays`, the transformers backend's own
conversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from topk_protocol import RequestOptions
from topk_protocol.sampling import SampledRows, sample_rows, sequence_sample_key

__all__ = ["EXTRA_KEY", "TOP_K", "SampleColumns", "drawn_rows", "extra_args", "spec_of"]

#: ``SamplingParams.extra_args`` key of a sampled request's draw parameters.
EXTRA_KEY = "topk_distill_samples"
#: The top-k vLLM is asked for with a sampled request: the least it serves (the payload's
#: columns are the draws; only the actual token's column 0 is read besides them).
TOP_K = 1


def extra_args(options: RequestOptions, token_ids: npt.NDArray[np.int32]) -> dict[str, Any]:
    """``extra_args`` entries sending a sampled request's draw parameters to the worker
    (64-bit values as decimal strings: extra args cross vLLM's process boundary)."""
    assert options.seed is not None  # RequestOptions requires it with samples
    spec = {
        "samples": options.samples,
        "seed": str(options.seed),
        "key": str(sequence_sample_key(token_ids)),
        "tau": options.proposal_temperature,
    }
    return {EXTRA_KEY: spec}


@dataclass(frozen=True)
class SampleColumns:
    """One request's draws, as extra log-prob columns (worker side; see the module doc)."""

    samples: int
    seed: int
    key: int
    tau: float

    @property
    def width(self) -> int:
        """Columns appended to each row: ``2N + 1``."""
        return 2 * self.samples + 1

    def columns(self, logprobs: Any, first: int, rows: int) -> tuple[Any, Any]:
        """``(ids, values)`` ``[rows, 2N + 1]`` for the served log-probs ``logprobs``
        ``[rows, V]`` of payload positions ``first .. first + rows - 1``."""
        import torch

        positions = torch.arange(first, first + rows, device=logprobs.device)
        got = sample_rows(logprobs, self.samples, self.seed, self.key, positions, self.tau)
        log_z = torch.zeros(rows, 1, dtype=torch.float32, device=logprobs.device)
        if got.log_normalizer is not None:
            log_z = got.log_normalizer[:, None]
        ids = torch.cat((got.ids, got.counts, torch.zeros_like(got.ids[:, :1])), dim=1)
        values = torch.cat((got.logprobs, torch.zeros_like(got.logprobs), log_z), dim=1)
        return ids, values


def spec_of(extra: dict[str, Any]) -> SampleColumns | None:
    """The :class:`SampleColumns` of a request's ``extra_args``, or None."""
    spec = extra.get(EXTRA_KEY)
    if not spec:
        return None
    samples, seed, key = int(spec["samples"]), int(spec["seed"]), int(spec["key"])
    return SampleColumns(samples, seed, key, float(spec["tau"]))


def drawn_rows(
    ids: npt.NDArray[Any], logprobs: npt.NDArray[Any], options: RequestOptions
) -> SampledRows:
    """The draws of rows the worker widened (their last ``2N + 1`` columns, ``[S, W]``)."""
    import torch

    n = options.samples
    ids = ids[:, ids.shape[1] - (2 * n + 1) :]
    logprobs = logprobs[:, logprobs.shape[1] - (2 * n + 1) :]
    counts = torch.from_numpy(np.ascontiguousarray(ids[:, n : 2 * n], dtype=np.int64))
    if bool((counts.sum(-1) != n).any()):
        raise RuntimeError(f"vLLM's sampled columns do not hold {n} draws a row (vLLM changed?)")
    log_z = None
    if options.proposal_normalizer:
        log_z = torch.from_numpy(np.ascontiguousarray(logprobs[:, 2 * n], dtype=np.float32))
    return SampledRows(
        torch.from_numpy(np.ascontiguousarray(ids[:, :n], dtype=np.int64)),
        counts,
        torch.from_numpy(np.ascontiguousarray(logprobs[:, :n], dtype=np.float32)),
        log_z,
    )
