"""Probes answer within 1 s while the event loop has large requests to take apart: a
Score of 10,000 one-token sequences and a stream of 10,000 tiny requests (the full
100,000-request stream and a 62 MiB request are in ``benchmarks/bench_probes.py``)."""

from __future__ import annotations

import grpc
import numpy as np

from devtools.probes import ProbeWatcher
from topk_protocol import build_request, pb_grpc


def test_probes_stay_under_1_s_during_many_sequences_and_a_long_stream(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    server = vllm_teacher
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        with ProbeWatcher(server.http, server.target) as probes:
            seqs = [np.array([i % 512], np.int32) for i in range(10_000)]
            resp = stub.Score(build_request(seqs, 16, dtype="float16"), timeout=600)
            assert len(resp.sequences) == 10_000

            def tiny(n: int):  # type: ignore[no-untyped-def]
                for i in range(n):
                    req = build_request([np.array([i % 512], np.int32)], 1)
                    req.request_id = str(i)
                    yield req

            answered = sum(
                msg.final and not msg.HasField("error")
                for msg in stub.ScoreStream(tiny(10_000), timeout=600)
            )
            assert answered == 10_000
    print(f"probes during 10,000 sequences + 10,000 stream requests: {probes.summary()}")
    assert probes.count() > 30
    assert probes.max_s() < 1.0, probes.summary()
