"""The order of :class:`FairQueue`: in turn per client, then per stream, FIFO within a
stream; arrival order when not fair. Odd cases: empty queues, a stream emptied and
refilled, removal of what is absent, a client with many streams against one with one."""

from __future__ import annotations

import pytest

from teacher_server.fair_share import FairQueue, client_identity


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_streams_take_turns_and_keep_their_own_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(100_000):
        q.push("c", "flood", f"f{i}")
    q.push("c", "canary", "c0")
    q.push("c", "canary", "c1")
    assert len(q) == 100_002
    assert [q.pop() for _ in range(5)] == ["f0", "c0", "f1", "c1", "f2"]
    assert len(q) == 99_997 and q.waiting_streams() == 1
    rest = drain(q)
    assert rest == [f"f{i}" for i in range(3, 100_000)]


def test_clients_take_turns_before_their_streams_do() -> None:
    q: FairQueue[str] = FairQueue()
    for s in range(4):  # client a opens 4 streams of 2
        for i in range(2):
            q.push("a", s, f"a{s}.{i}")
    q.push("b", 0, "b0")
    q.push("b", 0, "b1")
    assert drain(q) == ["a0.0", "b0", "a1.0", "b1", "a2.0", "a3.0", "a0.1", "a1.1", "a2.1", "a3.1"]


def test_a_newcomer_waits_at_most_one_turn_per_waiting_stream() -> None:
    q: FairQueue[str] = FairQueue()
    for s in ("x", "y", "z"):
        for i in range(10):
            q.push("c", s, f"{s}{i}")
    assert q.pop() == "x0"
    q.push("c", "new", "n0")  # joins the end of the rotation: after y and z, before x again
    assert [q.pop() for _ in range(4)] == ["y0", "z0", "x1", "n0"]


def test_a_stream_emptied_and_refilled_joins_the_end() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("c", "s", "s0")
    q.push("c", "t", "t0")
    q.push("c", "t", "t1")
    assert q.pop() == "s0"
    q.push("c", "s", "s1")  # s had nothing waiting: behind t now
    assert drain(q) == ["t0", "s1", "t1"]


def test_remove_and_empty_queue() -> None:
    q: FairQueue[str] = FairQueue()
    with pytest.raises(IndexError):
        q.pop()
    assert not q.remove("c", "s", "x")  # nothing waits at all
    q.push("c", "s", "a")
    q.push("c", "s", "b")
    q.push("d", "t", "c")
    assert not q.remove("c", "s", "zz")  # not there
    assert not q.remove("c", "other", "a")  # in another stream
    assert q.remove("c", "s", "a") and len(q) == 2
    assert q.remove("c", "s", "b") and q.waiting_streams() == 1
    assert drain(q) == ["c"]
    with pytest.raises(IndexError):
        q.pop()


def test_none_is_a_client_and_a_stream_like_any_other() -> None:
    q: FairQueue[str] = FairQueue()
    q.push(None, None, "a")
    q.push(None, None, "b")
    q.push(None, 0, "c")
    assert drain(q) == ["a", "c", "b"]


def test_arrival_order_ignores_clients_and_streams() -> None:
    q: FairQueue[str] = FairQueue(fair=False)
    for item, stream in (("a", 1), ("b", 1), ("c", 2), ("d", 1)):
        q.push("c", stream, item)
    assert q.remove("c", 1, "b") and not q.remove("c", 1, "b")
    assert q.waiting_streams() == 1
    assert drain(q) == ["a", "c", "d"]


def test_client_identity_names_token_and_host_never_the_token() -> None:
    a = client_identity("Bearer secret-1", "ipv4:10.0.0.7:51234")
    assert a == client_identity("Bearer secret-1", "ipv4:10.0.0.7:60000")  # same host
    assert a != client_identity("Bearer secret-2", "ipv4:10.0.0.7:51234")
    assert a != client_identity("Bearer secret-1", "ipv4:10.0.0.8:51234")
    assert "secret" not in a and a.endswith("@ipv4:10.0.0.7")
    assert client_identity(None, "ipv6:[::1]:5000") == "@ipv6:[::1]"
    assert client_identity(None, "unix:/tmp/s") == "@unix:/tmp/s"
    assert client_identity(None, None) == "@"
