"""Sampled payloads: ``N`` draws per position from the teacher's distribution, reproducibly.

A sampled request (``samples`` N, ``seed``) asks, for every position, for N independent
draws from the teacher's served distribution ``p`` (or from the proposal
``q ~ p^(1/tau)`` with ``proposal_temperature`` tau). The answer holds each row's distinct
drawn ids, how often each was drawn and the teacher's log-probs at them
(:func:`sample_rows`); the student trains on the empirical target (counts / N, or the
importance weights ``counts / N * p / q``), whose cross-entropy gradient is an unbiased
estimate of the full forward-KL gradient (``student_client.losses.sampled``).

**Reproducibility.** The uniforms of draw ``j`` at absolute position ``t`` of a sequence
are a hash of ``(seed, sequence key, t, j)`` (:func:`draw_uniforms`), where the sequence
key hashes all of the sequence's tokens (:func:`sequence_sample_key`). Nothing else enters:
the same sequence gives the same draws whatever the batch it travels in, its index there,
the position range asked, the stream chunking, the backend's row blocks and the device,
so a recording replays exactly what a live teacher answers. A draw is the inverse CDF of
the (float64) distribution at its uniform. The hash is MurmurHash3's 32-bit mixing over
these words, computed with int64 tensor arithmetic (vectorised; no per-entry Python): a
counter-based generator, where a ``torch.Generator`` per position would need a Python
loop over positions and gives different streams on CPU and CUDA.

Pure torch; used by the teacher's backends and by offline tools that draw a payload from
dense teacher log-probs.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

__all__ = [
    "SampledRows",
    "draw_uniforms",
    "sample_rows",
    "sequence_sample_key",
]

_KEY_DOMAIN = b"topk-distill/sample/v1"
_M32 = 0xFFFFFFFF
#: Rows per block of the ``[rows, V]`` float64 CDF (bounds the extra memory at large V).
_BLOCK_ELEMENTS = 1 << 24


def sequence_sample_key(token_ids: bytes | npt.ArrayLike) -> int:
    """The 64-bit key of a sequence in the draws: sha256 of its int32 little-endian ids."""
    if not isinstance(token_ids, bytes | bytearray | memoryview):
        token_ids = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.sha256(_KEY_DOMAIN + bytes(token_ids)).digest()[:8], "little")


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)``, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3(words: list[Tensor | int]) -> Tensor:
    """MurmurHash3 (x86, 32-bit, seed 0) of a fixed-length list of 32-bit words
    (tensors broadcast together, ints as constants); int64 tensors in ``[0, 2^32)``."""
    h: Tensor | int = 0
    for w in words:
        k = _mul32(torch.as_tensor(w, dtype=torch.int64) & _M32, 0xCC9E2D51)
        k = _mul32(_rotl32(k, 15), 0x1B873593)
        h = _rotl32(k ^ h, 13)
        h = (_mul32(h, 5) + 0xE6546B64) & _M32
    assert isinstance(h, Tensor)
    h = h ^ (4 * len(words))
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def draw_uniforms(seed: int, sequence_key: int, positions: Tensor, samples: int) -> Tensor:
    """Uniforms in ``[0, 1)`` with 53 random bits, ``[S, N]`` float64.

    Args:
        seed: the request's seed, ``[0, 2^64)``.
        sequence_key: :func:`sequence_sample_key` of the sequence.
        positions: ``[S]`` absolute positions (any integer dtype).
        samples: ``N``.
    """
    device = positions.device
    pos = positions.to(torch.int64).unsqueeze(1)
    draw = torch.arange(samples, dtype=torch.int64, device=device).unsqueeze(0)
    words: list[Tensor | int] = [
        seed & _M32,
        (seed >> 32) & _M32,
        sequence_key & _M32,
        (sequence_key >> 32) & _M32,
        pos,
        draw,
    ]
    high = _murmur3([*words, 0]) >> 5  # 27 bits
    low = _murmur3([*words, 1]) >> 6  # 26 bits
    return (high * 67108864 + low).to(torch.float64) / 9007199254740992.0


class SampledRows(NamedTuple):
    """A sampled payload's rows (``K = N`` columns; padding columns have count 0, id 0
    and log-prob 0).

    - ``ids``: ``[S, N]`` int64, each row's distinct drawn ids ascending, then padding.
    - ``counts``: ``[S, N]`` int64, draws of each id; a row sums to N.
    - ``logprobs``: ``[S, N]`` float32, the teacher's log-probs at ``ids``.
    - ``log_normalizer``: ``[S]`` float32, ``log Z`` of the proposal
      ``q = p^(1/tau) / Z``; None when ``tau`` is 1 (the draws are from ``p``).
    """

    ids: Tensor
    counts: Tensor
    logprobs: Tensor
    log_normalizer: Tensor | None


def sample_rows(
    logprobs: Tensor,
    samples: int,
    seed: int,
    sequence_key: int,
    positions: Tensor,
    proposal_temperature: float = 1.0,
) -> SampledRows:
    """Draw ``samples`` ids per row from dense teacher log-probs, as a teacher serves them.

    Args:
        logprobs: ``[S, V]`` the teacher's served log-probs (``log_softmax(z / T)``), any
            float dtype; row ``i`` is absolute position ``positions[i]``.
        samples: ``N >= 1`` draws per row.
        seed: the request's seed, ``[0, 2^64)``.
        sequence_key: :func:`sequence_sample_key` of the sequence the rows belong to.
        positions: ``[S]`` absolute positions of the rows.
        proposal_temperature: draw from ``q ~ p^(1/tau)`` (tau > 1 flattens, < 1
            sharpens); 1 draws from ``p``.

    Returns:
        :class:`SampledRows` on ``logprobs``' device. The same arguments give the same
        rows whatever block of rows they come in (see the module doc).
    """
    rows, vocab = logprobs.shape
    ids = torch.zeros(rows, samples, dtype=torch.int64, device=logprobs.device)
    counts = torch.zeros_like(ids)
    values = torch.zeros(rows, samples, dtype=torch.float32, device=logprobs.device)
    tempered = proposal_temperature != 1.0
    log_z = torch.zeros(rows, dtype=torch.float32, device=logprobs.device) if tempered else None
    block = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, block):  # one pass per block of rows, not per entry
        part = slice(start, min(start + block, rows))
        lp = logprobs[part].to(torch.float64)
        proposal = lp
        if log_z is not None:
            scaled = lp / proposal_temperature
            norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
            proposal = scaled - norm
            log_z[part] = norm.squeeze(-1).to(torch.float32)
        cdf = torch.cumsum(proposal.exp(), dim=-1)
        u = draw_uniforms(seed, sequence_key, positions[part], samples) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u.to(cdf.device), right=True).clamp_max_(vocab - 1)
        ids[part], counts[part] = _distinct_counts(drawn)
        values[part] = torch.gather(lp, 1, ids[part]).to(torch.float32)
    values = torch.where(counts > 0, values, torch.zeros((), dtype=values.dtype))
    return SampledRows(ids, counts, values, log_z)


def _distinct_counts(drawn: Tensor) -> tuple[Tensor, Tensor]:
    """``[n, N]`` drawn ids -> each row's distinct ids (ascending, then 0) and counts."""
    ordered, _ = torch.sort(drawn, dim=1)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    slot = torch.cumsum(first, dim=1) - 1
    counts = torch.zeros_like(ordered).scatter_add_(1, slot, torch.ones_like(ordered))
    ids = torch.zeros_like(ordered).scatter_(1, slot, ordered)
    return ids, counts
