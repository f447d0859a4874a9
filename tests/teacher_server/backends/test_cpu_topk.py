"""The CPU top-k kernel against a plain oracle: a stable descending sort (ties: lower id
first), the target's value gathered, its rank counted. Odd shapes, peaked rows, heavy
ties, rows that are all one value, and the inputs it refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("numba")

import torch

from teacher_server.backends import cpu_topk
from teacher_server.backends.cpu_topk import MAX_K_FRACTION, topk_with_target


def _oracle(
    scores: torch.Tensor, k: int, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    t_val = scores.gather(1, target[:, None])
    ids = torch.cat([target[:, None], order], 1).to(torch.int32)
    values = torch.cat([t_val, scores.gather(1, order)], 1)
    return ids, values, (scores >= t_val).sum(1)


def _rows(kind: str, n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, v, generator=gen)
    if kind == "peaked":  # a teacher-like log-softmax: a few likely ids, a long tail
        return torch.log_softmax(torch.randn(n, v, generator=gen) * 8, -1)
    if kind == "ties":  # five distinct values only
        return torch.randint(-5, 0, (n, v), generator=gen).float()
    if kind == "constant":
        return torch.full((n, v), -3.25)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "constant"])
@pytest.mark.parametrize(("n", "v"), [(3 * 47, 123), (1, 4), (5, 1000), (64, 512)])
def test_matches_the_sort_oracle(kind: str, n: int, v: int) -> None:
    gen = torch.Generator().manual_seed(n * v)
    scores = _rows(kind, n, v, gen)
    target = torch.randint(0, v, (n,), generator=gen)
    target[0] = int(scores[0].argmax())  # one target that is the row's best
    for k in sorted(k for k in {1, 3, 7, v // MAX_K_FRACTION} if 1 <= k <= v // MAX_K_FRACTION):
        got = topk_with_target(scores, k, target)
        assert got is not None
        for a, b in zip(got, _oracle(scores, k, target), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (kind, n, v, k)


def test_signed_zeros_tie() -> None:
    scores = torch.tensor([[-1.0, 0.0, -0.0, -2.0, 0.0, -0.5, -0.0, -3.0]])
    target = torch.tensor([6])
    got = topk_with_target(scores, 2, target)
    assert got is not None
    for a, b in zip(got, _oracle(scores, 2, target), strict=True):
        assert torch.equal(a, b)
    assert got[0].tolist() == [[6, 1, 2]] and got[2].tolist() == [4]


def test_threads_do_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.log_softmax(torch.randn(301, 257, generator=gen) * 3, -1)
    target = torch.randint(0, 257, (301,), generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = topk_with_target(scores, 64, target)
        torch.set_num_threads(2)
        two = topk_with_target(scores, 64, target)
    finally:
        torch.set_num_threads(before)
    assert one is not None and two is not None
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_are_left_to_torch(bad: float) -> None:
    scores = torch.randn(9, 40)
    scores[4, 17] = bad
    assert topk_with_target(scores, 5, torch.zeros(9, dtype=torch.long)) is None


def test_no_rows() -> None:
    got = topk_with_target(torch.zeros(0, 16), 4, torch.zeros(0, dtype=torch.long))
    assert got is not None
    assert [tuple(t.shape) for t in got] == [(0, 5), (0, 5), (0,)]


@pytest.mark.parametrize(
    ("scores", "k"),
    [
        (torch.randn(4, 40, dtype=torch.bfloat16), 5),  # dtype
        (torch.randn(4, 40), 11),  # k > V // 4
        (torch.randn(4, 40), 0),
        (torch.randn(40), 5),  # not [N, V]
    ],
)
def test_refuses_what_it_does_not_serve(scores: torch.Tensor, k: int) -> None:
    assert not cpu_topk.supported(scores, k)
    with pytest.raises(ValueError, match=r"scores: need a float32 CPU \[N, V\] tensor"):
        topk_with_target(scores, k, torch.zeros(4, dtype=torch.long))


def test_refuses_bad_target_ids() -> None:
    scores = torch.randn(4, 40)
    with pytest.raises(ValueError, match="target_ids: expected 4 ids"):
        topk_with_target(scores, 5, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_ids: ids must lie in \[0, 40\)"):
        topk_with_target(scores, 5, torch.tensor([0, 1, 40, 2]))
