"""A teacher pool on a local Ray cluster (CPU only): 2 replicas of the transformers
backend on the tiny model, streamed through by a student, one replica SIGKILLed
mid-stream and restarted by Ray; bad input named."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra: pip install '.[ray]'")

from devtools.launch import TeacherProcess, start_teacher  # noqa: E402
from student_client import TeacherClient  # noqa: E402
from topk_ray import PoolConfig, PoolError, TeacherPool, connect  # noqa: E402

K = 8


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs (one per replica), no dashboard."""
    connect(num_cpus=2, object_store_memory=80 * 1024 * 1024)
    yield
    ray.shutdown()


def _serve_args(model: Path) -> list[str]:
    return ["--backend", "transformers", "--model", str(model), "--dtype", "float32",
            "--served-model-name", "tiny"]  # fmt: skip


@pytest.fixture(scope="module")
def pool(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    config = PoolConfig(
        _serve_args(tiny_model_dir),
        replicas=2,
        num_cpus=1,
        log_dir=str(tmp_path_factory.mktemp("pool-logs")),
    )
    with TeacherPool(config) as p:
        yield p


@pytest.fixture(scope="module")
def direct(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TeacherProcess]:
    """The same teacher started outside Ray: what a direct client gets."""
    server = start_teacher(
        _serve_args(tiny_model_dir), tmp_path_factory.mktemp("direct") / "server.log"
    )
    yield server
    server.stop()


def _batches(seed: int, n: int = 16) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, size=m).tolist() for m in (48, 23, 70)] for _ in range(n)]


def _assert_same(got: list, want: list) -> None:  # type: ignore[type-arg]
    assert len(got) == len(want)
    assert len({p.request_id for p in got}) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.ids, w.ids) and torch.equal(g.logprobs, w.logprobs)
        gs, ws = g.sampled_logprobs, w.sampled_logprobs
        assert gs is not None and ws is not None
        assert torch.equal(gs.isnan(), ws.isnan()) and torch.equal(gs.nan_to_num(), ws.nan_to_num())
        assert torch.equal(g.mask, w.mask)


def test_streaming_through_the_pool_equals_a_direct_client(
    pool: TeacherPool, direct: TeacherProcess
) -> None:
    targets = pool.targets()
    assert len(targets) == 2 and len(set(targets)) == 2
    batches = _batches(0)
    with TeacherClient(direct.target) as client:
        want = list(client.stream(batches, K, depth=4))
    with pool.client() as client:
        got = list(client.stream(batches, K, depth=4))
        assert client.info().answer_fingerprint is not None
    _assert_same(got, want)


def test_sigkill_one_replica_mid_stream_then_ray_restarts_it(
    pool: TeacherPool, direct: TeacherProcess
) -> None:
    batches = _batches(1, 24)
    with TeacherClient(direct.target) as client:
        want = list(client.stream(batches, K, depth=4))
    before = {t: pid for (h, p, _, pid), t in zip(pool.addresses(), pool.targets(), strict=True)}
    got = []
    victim = None
    with pool.client(backoff_s=0.05, retries=8) as client:
        for i, payload in enumerate(client.stream(batches, K, depth=4)):
            got.append(payload)
            if i == 5:
                victim = client.current_target
                os.kill(before[victim], signal.SIGKILL)  # the replica's server process
    _assert_same(got, want)  # nothing lost, repeated or corrupted
    # Ray restarts the actor; its server comes back on the same target.
    pool.wait_ready(timeout_s=300)
    after = {t: pid for (h, p, _, pid), t in zip(pool.addresses(), pool.targets(), strict=True)}
    assert set(after) == set(before)
    assert after[victim] != before[victim]
    with TeacherClient(victim) as client:
        again = list(client.stream(batches[:4], K, depth=4))
    _assert_same(again, want[:4])


def test_scale_down_drains_the_replica(pool: TeacherPool) -> None:
    with pytest.raises(PoolError, match="replicas: 3 exceeds the pool's placement group of 2"):
        pool.scale(3)


def test_no_resources_for_a_replica_is_named(ray_cluster: None, tiny_model_dir: Path) -> None:
    config = PoolConfig(_serve_args(tiny_model_dir), replicas=1, num_gpus=1,
                        placement_timeout_s=2)  # fmt: skip
    with pytest.raises(PoolError, match=r"replicas: cannot place 1 x \{'CPU': 1.0, 'GPU': 1.0\}"):
        TeacherPool(config).start()


def test_an_unreachable_ray_address_is_named() -> None:
    with pytest.raises(PoolError, match=r"ray address '127\.0\.0\.1:1': no Ray cluster answers"):
        connect("127.0.0.1:1")
    with pytest.raises(PoolError, match="ray address 'nowhere': expected HOST:PORT"):
        connect("nowhere")


def test_bad_pool_config_is_named(tiny_model_dir: Path) -> None:
    with pytest.raises(PoolError, match="serve_args: --port is set by the pool"):
        PoolConfig([*_serve_args(tiny_model_dir), "--port", "1"])
    with pytest.raises(PoolError, match="replicas: must be >= 1, got 0"):
        PoolConfig(_serve_args(tiny_model_dir), replicas=0)
