"""A teacher pool on a local Ray cluster (CPU only): 2 replicas of the transformers
backend on the tiny model, streamed through by a student, one replica SIGKILLed
mid-stream and restarted by Ray; bad input named."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra: pip install '.[ray]'")

from devtools.launch import TeacherProcess, start_teacher  # noqa: E402
from student_client import TeacherClient  # noqa: E402
from topk_ray import PoolConfig, PoolError, PoolResolver, TeacherPool, connect  # noqa: E402

K = 8
#: K of the kill test's recording: rows large enough to be flushed by size (below).
KILL_K = 64


@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint: str) -> Iterator[None]:
    """A local Ray cluster of 3 logical CPUs (one per replica, one for Ray Data's own
    scheduling), no dashboard. Started after the session's S3 server, so that its workers
    inherit the endpoint and credentials in the environment, as a node's would."""
    connect(num_cpus=3, object_store_memory=80 * 1024 * 1024)
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
    """The same teacher started outside Ray: what a direct client gets. With one torch
    thread, as Ray gives a replica of one CPU (OMP_NUM_THREADS=1): another thread count
    sums float32 in another order."""
    server = start_teacher(
        _serve_args(tiny_model_dir),
        tmp_path_factory.mktemp("direct") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
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
    # Not at Ray's worker nice value (15): a replica competes for the CPU as a plain server.
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in before.values()] == [0, 0]
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
    assert os.getpriority(os.PRIO_PROCESS, after[victim]) == 0
    with TeacherClient(victim) as client:
        again = list(client.stream(batches[:4], K, depth=4))
    _assert_same(again, want[:4])


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


def test_bad_pool_config_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="serve_args: --port is set by the pool"):
        PoolConfig([*_serve_args(tiny_model_dir), "--port", "1"])
    with pytest.raises(PoolError, match="replicas: must be >= 1, got 0"):
        PoolConfig(_serve_args(tiny_model_dir), replicas=0)
    # A reference fingerprint that does not parse is named before anything is placed.
    bad = tmp_path / "reference.json"
    bad.write_text("{not json")
    for flags in (["--expect-fingerprint", str(bad)], [f"--expect-fingerprint={bad}"]):
        with pytest.raises(
            PoolError,
            match=rf"serve_args: --expect-fingerprint: fingerprint file {bad}: not JSON",
        ):
            PoolConfig([*_serve_args(tiny_model_dir), *flags])
    bad.write_text('{"model": "tiny"}')
    with pytest.raises(PoolError, match=rf"fingerprint file {bad}: holds no answer fingerprint"):
        PoolConfig([*_serve_args(tiny_model_dir), "--expect-fingerprint", str(bad)])


def test_a_second_pool_of_the_same_name_is_refused(pool: TeacherPool, tiny_model_dir: Path) -> None:
    config = PoolConfig(_serve_args(tiny_model_dir), name=pool.name, placement_timeout_s=2)
    with pytest.raises(PoolError, match=f"name: a pool named '{pool.name}' already runs"):
        TeacherPool(config).start()
    with pytest.raises(PoolError, match="pool 'no-such-pool': no pool of that name runs"):
        PoolResolver("no-such-pool")()


def _rows(path: str | Path, top_k: int = K) -> list[tuple[bytes, np.ndarray, np.ndarray]]:
    from student_client import PayloadDataset

    ds = PayloadDataset(path, top_k=top_k, dtype="float32")
    out = []
    for i in range(len(ds)):
        item = ds[i]
        out.append(
            (
                np.asarray(item.token_ids).tobytes(),
                item.arrays.ids.copy(),
                item.arrays.logprobs.copy(),
            )
        )
    return out


def test_recording_on_ray_with_a_worker_killed_mid_write(
    pool: TeacherPool, direct: TeacherProcess, tmp_path: Path
) -> None:
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    from student_client.offline.record_cli import main as record_main
    from topk_protocol.recording.format import SHARD_SUFFIX
    from topk_protocol.recording.sharded import PART_FILE, part_location
    from topk_ray.record import record_on_ray

    # A shard file must exist while shard 0 still has rows to record, on any CPU: each
    # worker's writer flushes once 4 MiB of rows are buffered (DEFAULT_FLUSH_BYTES), and
    # at K = 64 in float32 a shard's 120 rows of 200-400 positions are about 18 MiB, so
    # its first file is written about a quarter of the way in whatever the teacher's speed
    # (its 2 s timer alone would not be written before the end on a fast CPU).
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(200, 400, size=240)]
    corpus = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": seqs}), corpus, row_group_size=10)
    flags = ["--top-k", str(KILL_K), "--dtype", "float32", "--batch-size", "1", "--depth", "2"]
    single = tmp_path / "single"
    assert record_main(["--teacher", direct.target, "--input", str(corpus), "--output",
                        str(single), "--quiet", *flags]) == 0  # fmt: skip

    out = tmp_path / "on-ray"
    pids = tmp_path / "pids"
    pids.mkdir()

    def on_start(shard: int, pid: int, targets: list[str]) -> None:
        (pids / f"{shard}-{pid}").touch()

    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["problems"] = record_on_ray(
                pool.targets(), str(corpus), str(out), num_shards=2, record_args=flags,
                num_cpus=0, on_start=on_start,
            )  # fmt: skip
        except Exception as e:  # reported below
            result["error"] = e

    driver = threading.Thread(target=run)
    driver.start()
    part0 = Path(part_location(out, 0, 2))
    while not (part0.is_dir() and any(p.suffix == SHARD_SUFFIX for p in part0.iterdir())):
        assert driver.is_alive(), result
        time.sleep(0.05)
    assert not (part0 / PART_FILE).exists(), "shard 0 finished before it could be killed"
    (first,) = [p.name for p in pids.iterdir() if p.name.startswith("0-")]
    os.kill(int(first.split("-")[1]), signal.SIGKILL)  # the worker writing shard 0
    driver.join()
    assert "error" not in result, result
    assert result["problems"] == []  # --verify accepts it
    retried = [p.name for p in pids.iterdir() if p.name.startswith("0-")]
    assert len(retried) == 2  # Ray ran shard 0 again, which resumed its part
    got, want = _rows(out, KILL_K), _rows(single, KILL_K)
    assert len(got) == len(want) == len(seqs)
    for (gt, gi, gl), (wt, wi, wl) in zip(got, want, strict=True):
        assert gt == wt and np.array_equal(gi, wi) and np.array_equal(gl, wl)


def test_ray_data_stage_reads_back_like_teacher_record(
    pool: TeacherPool, direct: TeacherProcess, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from student_client.offline.record_cli import main as record_main
    from topk_ray.data import TeacherPayloads, write_recording

    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(5, 90, size=40)]
    corpus = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": seqs}), corpus, row_group_size=10)
    single = tmp_path / "single"
    # teacher-record against the same replicas: the stage's rows must equal its rows.
    argv = ["--teacher", ",".join(pool.targets()), "--input", str(corpus), "--output", str(single),
            "--quiet", "--top-k", str(K), "--dtype", "float32", "--batch-size", "1",
            "--depth", "1"]  # fmt: skip
    assert record_main(argv) == 0

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.from_arrow(pq.read_table(corpus)).map_batches(
        TeacherPayloads,
        fn_constructor_args=(pool.targets(), K),
        batch_size=1,
        concurrency=1,
        num_cpus=0,
    )
    out = tmp_path / "ray-data"
    assert write_recording(ds, str(out), pool.targets()) == len(seqs)
    got, want = _rows(out), _rows(single)
    assert len(got) == len(want) == len(seqs)
    for (gt, gi, gl), (wt, wi, wl) in zip(got, want, strict=True):
        assert gt == wt and np.array_equal(gi, wi) and np.array_equal(gl, wl)


def _corpus(tmp_path: Path, seed: int, rows: int) -> tuple[Path, list[list[int]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(5, 90, size=rows)]
    corpus = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": seqs}), corpus, row_group_size=8)
    return corpus, seqs


def test_recording_on_ray_into_s3_with_the_pools_resolver(
    pool: TeacherPool, direct: TeacherProcess, s3_bucket: str, tmp_path: Path
) -> None:
    """``s3://`` output: each shard task resolves the pool's replicas as it starts and
    writes its part to the object store (the local S3 server the suite runs)."""
    from student_client.offline.record_cli import main as record_main
    from topk_protocol.recording.sharded import list_parts
    from topk_ray.record import record_on_ray

    corpus, seqs = _corpus(tmp_path, 6, 48)
    flags = ["--top-k", str(K), "--dtype", "float32", "--batch-size", "2", "--depth", "2"]
    single = tmp_path / "single"
    assert record_main(["--teacher", direct.target, "--input", str(corpus), "--output",
                        str(single), "--quiet", *flags]) == 0  # fmt: skip
    uri = f"{s3_bucket}/runs/on-ray"
    problems = record_on_ray(
        pool.resolver(), str(corpus), uri, num_shards=2, record_args=flags, num_cpus=0
    )
    assert problems == []  # --verify over the parts on S3
    assert [p.index for p in list_parts(uri)] == [0, 1]
    got, want = _rows(uri), _rows(single)
    assert len(got) == len(want) == len(seqs)
    for (gt, gi, gl), (wt, wi, wl) in zip(got, want, strict=True):
        assert gt == wt and np.array_equal(gi, wi) and np.array_equal(gl, wl)


def _in_flight(http_port: int) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("topk_teacher_requests_in_flight "):
                return float(line.split()[1])
    raise AssertionError("no topk_teacher_requests_in_flight in /metrics")


def test_scale_down_drains_in_flight_requests_and_the_resolver_follows(
    pool: TeacherPool, direct: TeacherProcess, tmp_path: Path
) -> None:
    """Scale-down uses the server's own drain: a request in flight on the replica that
    leaves is answered in full (equal to a direct client's), the server exits 0 by itself;
    the resolver drops the replica before it drains and takes it back on scale-up, in the
    driver and in a Ray task alike."""
    import threading

    from topk_ray.record import record_on_ray

    resolver = pool.resolver()
    (_, _, http0, _), (_, _, http1, _) = pool.addresses()
    t0, t1 = pool.targets()
    in_task = ray.remote(lambda r: r()).options(num_cpus=0)
    assert resolver() == [t0, t1] == ray.get(in_task.remote(resolver))

    # One large request (seconds of work on one CPU) to the replica that will leave.
    rng = np.random.default_rng(7)
    big = [rng.integers(0, 256, size=2048).tolist() for _ in range(24)]
    with TeacherClient(direct.target) as client:
        want = client.score(big, K)
    answer: dict[str, object] = {}

    def ask() -> None:
        with TeacherClient(t1, retries=0) as client:
            try:
                answer["payload"] = client.score(big, K)
            except Exception as e:  # reported below
                answer["error"] = e

    asker = threading.Thread(target=ask)
    asker.start()
    while _in_flight(http1) < 1:
        assert asker.is_alive(), answer
        time.sleep(0.02)
    codes = pool.scale(1)  # returns once the replica drained and left
    asker.join()
    assert codes == {1: 0}  # it drained and exited by itself, not killed
    assert "error" not in answer, answer
    got = answer["payload"]
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)  # type: ignore[attr-defined]
    log = (Path(pool.config.log_dir) / "replica-1.log").read_text()
    drained = [ln for ln in log.splitlines() if "draining:" in ln]
    assert drained and "draining: 0 requests" not in drained[-1], drained

    # The resolver follows: replica 1 is gone for the driver and for Ray tasks, and a
    # recording started now records from replica 0 alone.
    assert resolver() == [t0] == ray.get(in_task.remote(resolver))
    with TeacherClient(resolver()) as client:
        again = client.score(big[:2], K)
    assert torch.equal(again.ids, want.ids[:2])
    corpus, _ = _corpus(tmp_path, 8, 16)
    used = tmp_path / "used"
    used.mkdir()

    def on_start(shard: int, pid: int, targets: list[str]) -> None:
        (used / f"{shard}").write_text(",".join(targets))

    problems = record_on_ray(
        resolver, str(corpus), str(tmp_path / "rec"), num_shards=2, num_cpus=0,
        record_args=["--top-k", str(K), "--dtype", "float32"], on_start=on_start,
    )  # fmt: skip
    assert problems == []
    assert sorted(p.read_text() for p in used.iterdir()) == [t0, t0]
    assert _in_flight(http0) == 0

    pool.scale(2)  # back: replica 1 starts again (new free ports on a one-node cluster)
    targets = pool.targets()
    assert targets[0] == t0 and resolver() == targets == ray.get(in_task.remote(resolver))
