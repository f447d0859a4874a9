"""The engine top-k route on a real vLLM ``Sampler`` (the object a CPU worker's model
runner holds), without starting an engine: the kernel gives what vLLM's own
``gather_logprobs`` gives, hands vLLM what it does not serve, switches back, and is not
installed when its self-check fails. Through a real engine: ``test_vllm_server.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("numba")

import torch
from vllm.v1.sample.sampler import Sampler

from teacher_server.backends import cpu_topk
from teacher_server.backends.vllm.worker import KERNEL, VLLM_TOPK, route_gather_logprobs


@pytest.fixture(scope="module")
def stock() -> object:
    """vLLM's own gather_logprobs (compiled once for the module)."""
    return Sampler().gather_logprobs


def _fields(t: object) -> list[torch.Tensor]:
    return [getattr(t, f) for f in ("logprob_token_ids", "logprobs", "selected_token_ranks")]


def _batch(n: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(n, v, generator=gen) * 3, -1)
    return logprobs, torch.randint(0, v, (n,), generator=gen)


def test_kernel_route_equals_vllm_and_switches_back(stock) -> None:  # type: ignore[no-untyped-def]
    sampler = Sampler()
    assert route_gather_logprobs(sampler, True) == KERNEL
    assert route_gather_logprobs(sampler, True) == KERNEL  # idempotent
    routed = sampler.gather_logprobs
    assert routed is not stock
    for n, v, k in [(3 * 47, 123, 7), (2, 512, 64), (1, 1000, 1)]:
        logprobs, target = _batch(n, v, n + v)
        for a, b in zip(
            _fields(routed(logprobs, k, target)), _fields(stock(logprobs, k, target)), strict=True
        ):
            assert a.dtype == b.dtype and torch.equal(a, b), (n, v, k)
    assert route_gather_logprobs(sampler, False) == VLLM_TOPK
    assert sampler.gather_logprobs == stock


@pytest.mark.parametrize("case", ["bfloat16", "k above V/4", "nan"])
def test_what_the_kernel_does_not_serve_goes_to_vllm(stock, case: str) -> None:  # type: ignore[no-untyped-def]
    sampler = Sampler()
    assert route_gather_logprobs(sampler, True) == KERNEL
    logprobs, target = _batch(6, 40, 3)
    k = 5
    if case == "bfloat16":
        logprobs = logprobs.bfloat16()
    elif case == "k above V/4":
        k = 30
    else:
        logprobs[2, 7] = float("nan")
    got = _fields(sampler.gather_logprobs(logprobs, k, target))
    want = _fields(stock(logprobs, k, target))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
        assert torch.equal(a.isnan(), b.isnan())


def test_a_failed_self_check_keeps_vllms_top_k(monkeypatch: pytest.MonkeyPatch, stock) -> None:  # type: ignore[no-untyped-def]
    real = cpu_topk.topk_with_target

    def off_by_one_rank(*args, **kwargs):  # type: ignore[no-untyped-def]
        got = real(*args, **kwargs)
        assert got is not None
        return got[0], got[1], got[2] + 1

    monkeypatch.setattr(cpu_topk, "topk_with_target", off_by_one_rank)
    sampler = Sampler()
    answer = route_gather_logprobs(sampler, True)
    assert answer.startswith("unavailable: the kernel's selected_token_ranks differ"), answer
    assert sampler.gather_logprobs == stock


def test_a_sampler_without_the_hook_point() -> None:
    assert route_gather_logprobs(object(), True).startswith("unavailable: ")


def test_backend_refuses_bad_engine_topk_settings() -> None:
    from teacher_server.backends.vllm.backend import VLLMBackend

    with pytest.raises(ValueError, match="engine_topk: 'fast' is not one of auto, kernel, vllm"):
        VLLMBackend("unused", engine_topk="fast")
    with pytest.raises(ValueError, match="worker_extension_cls: the teacher temperature and"):
        VLLMBackend(
            "unused", engine_topk="kernel", engine_kwargs={"worker_extension_cls": "my.Ext"}
        )
    # With the caller's extension, T = 1 and auto are fine (vLLM's top-k is used).
    VLLMBackend("unused", engine_kwargs={"worker_extension_cls": "my.Ext"})
