"""``topk-ray`` from the command line: a pool started, its targets printed and resolved by
name from another process, a recording made against it from a third, then SIGTERM drains
and stops it; bad input (no resources, an unreachable address, a fingerprint file that
does not parse, an unknown pool) is named with exit code 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="the ray extra: pip install '.[ray]'")

from student_client import PayloadDataset, TeacherClient
from topk_protocol.errors import TeacherUnavailableError

ROOT = Path(__file__).resolve().parents[2]
K = 8
READY = re.compile(r"pool 'cli-test': (\d+) replica\(s\) ready on the Ray cluster at (\S+);")


def _topk_ray(*argv: str) -> subprocess.CompletedProcess[str]:
    """``topk-ray ARGV`` as another process joining the cluster by its address: with token
    authentication on (what ``ray.init`` turns on for a local cluster), such a process must
    say so; the token is read from ``~/.ray/auth_token``, where the cluster wrote it."""
    return subprocess.run(
        [sys.executable, "-m", "topk_ray", *argv],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )  # fmt: skip


def _serve_args(model: Path) -> list[str]:
    return ["--backend", "transformers", "--model", str(model), "--dtype", "float32"]


def _rows(path: Path) -> list[tuple[bytes, bytes, bytes]]:
    ds = PayloadDataset(path, top_k=K, dtype="float32")
    items = [ds[i] for i in range(len(ds))]
    return [
        (np.asarray(i.token_ids).tobytes(), i.arrays.ids.tobytes(), i.arrays.logprobs.tobytes())
        for i in items
    ]


def test_a_pool_from_the_command_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from student_client.offline.record_cli import main as record_main

    targets_file = tmp_path / "targets.txt"
    err_path = tmp_path / "pool.err"
    with err_path.open("w") as err:
        pool = subprocess.Popen(
            [sys.executable, "-m", "topk_ray", "pool", "--local-cpus", "3", "--name", "cli-test",
             "--replicas", "2", "--log-dir", str(tmp_path / "logs"),
             "--targets-file", str(targets_file), "--", *_serve_args(tiny_model_dir)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "RAY_agent_register_timeout_ms": "120000"},
        )  # fmt: skip
    try:
        while not (ready := READY.search(err_path.read_text())):
            assert pool.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.2)
        assert ready.group(1) == "2"
        address = ready.group(2)
        assert pool.stdout is not None
        printed = [pool.stdout.readline().strip() for _ in range(2)]
        targets = targets_file.read_text().split()
        assert printed == targets and len(set(targets)) == 2

        # Each replica serves, and both give the same answers.
        rng = np.random.default_rng(0)
        batch = [rng.integers(0, 256, size=n).tolist() for n in (30, 64)]
        answers = []
        for target in targets:
            with TeacherClient(target) as client:
                answers.append(client.score(batch, K))
        assert all(a.ids.equal(answers[0].ids) for a in answers)

        # Another process finds the pool by name.
        found = _topk_ray("targets", "--address", address, "--pool", "cli-test")
        assert found.returncode == 0, found.stderr[-3000:]
        assert found.stdout.split() == targets

        # A third records against it: 2 shard tasks resolving the pool, then --verify;
        # the rows equal teacher-record's from the same replicas.
        seqs = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(5, 80, size=20)]
        corpus = tmp_path / "tokens.parquet"
        pq.write_table(pa.table({"input_ids": seqs}), corpus, row_group_size=5)
        flags = ["--top-k", str(K), "--dtype", "float32"]
        out = tmp_path / "on-ray"
        rec = _topk_ray("record", "--address", address, "--pool", "cli-test",
                        "--input", str(corpus), "--output", str(out), "--num-shards", "2",
                        "--task-cpus", "0", "--", *flags)  # fmt: skip
        assert rec.returncode == 0, rec.stderr[-3000:]
        assert "2 shard(s) recorded, --verify OK" in rec.stdout
        single = tmp_path / "single"
        assert record_main(["--teacher", targets[0], "--input", str(corpus), "--output",
                            str(single), "--quiet", *flags]) == 0  # fmt: skip
        assert _rows(out) == _rows(single) and len(_rows(out)) == len(seqs)

        # Bad input on the same cluster, each named with exit code 2.
        serve = _serve_args(tiny_model_dir)
        no_room = _topk_ray("pool", "--address", address, "--num-gpus", "1",
                            "--placement-timeout-s", "2", "--", *serve)  # fmt: skip
        assert no_room.returncode == 2
        assert "topk-ray pool: replicas: cannot place 1 x {'CPU': 1.0, 'GPU': 1.0}" in (
            no_room.stderr
        )
        unknown = _topk_ray("targets", "--address", address, "--pool", "no-such-pool")
        assert unknown.returncode == 2
        assert "pool 'no-such-pool': no pool of that name runs on this Ray cluster" in (
            unknown.stderr
        )
        taken = _topk_ray("pool", "--address", address, "--name", "cli-test",
                          "--placement-timeout-s", "2", "--", *serve)  # fmt: skip
        assert taken.returncode == 2
        assert "name: a pool named 'cli-test' already runs on this Ray cluster" in taken.stderr

        # SIGTERM: every replica drains, the pool exits 0 and its replicas are gone.
        pool.send_signal(signal.SIGTERM)
        assert pool.wait() == 0, err_path.read_text()[-3000:]
        assert "stopped (server exit codes {1: 0, 0: 0})" in err_path.read_text()
        for target in targets:
            with (
                TeacherClient(target, retries=0, timeout_s=5) as client,
                pytest.raises(TeacherUnavailableError),
            ):
                client.info()
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.wait()


def test_bad_input_is_named_before_any_cluster_starts(tmp_path: Path) -> None:
    unreachable = _topk_ray("targets", "--address", "127.0.0.1:1", "--pool", "x")
    assert unreachable.returncode == 2
    assert "topk-ray targets: ray address '127.0.0.1:1': no Ray cluster answers there" in (
        unreachable.stderr
    )
    rec = _topk_ray("record", "--address", "127.0.0.1:1", "--teacher", "h:1", "--input", "x",
                    "--output", str(tmp_path / "o"), "--num-shards", "2")  # fmt: skip
    assert rec.returncode == 2 and "ray address '127.0.0.1:1': no Ray cluster answers" in (
        rec.stderr
    )
    bad = tmp_path / "reference.json"
    bad.write_text("{not json")
    pool = _topk_ray("pool", "--address", "127.0.0.1:1", "--", "--backend", "transformers",
                     "--model", "m", "--expect-fingerprint", str(bad))  # fmt: skip
    assert pool.returncode == 2
    assert f"topk-ray pool: serve_args: --expect-fingerprint: fingerprint file {bad}: not JSON" in (
        pool.stderr
    )
