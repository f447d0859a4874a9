"""``topk-ray``: a teacher pool on a Ray cluster, and recording against it.

    topk-ray pool --address auto --name math --replicas 4 --num-gpus 2 \\
        --targets-file targets.txt -- --backend vllm --model Qwen/Qwen3-8B --dtype bfloat16
    topk-ray targets --address auto --pool math
    topk-ray record --address auto --pool math --input s3://corpus/tokens.parquet \\
        --output s3://recordings/run-1 --num-shards 16 -- --top-k 16 --dtype float16

``pool``: everything after ``--`` is ``teacher-server serve``'s flags. The replicas'
targets are printed on stdout (and written to ``--targets-file``, one per line, for the
students); the pool, its name and the Ray cluster's address go to stderr. The pool keeps
running until SIGTERM or SIGINT, then drains every replica and exits 0.
``targets``: the targets of the named pool's replicas serving now, one per line.
``record``: the sharded ``teacher-record`` as Ray tasks against the named pool (each task
resolves its replicas as it starts) or fixed ``--teacher`` targets, then ``--verify``;
everything after ``--`` is further ``teacher-record`` flags. Exit codes: 0 done (and
verified), 1 ``--verify`` found problems or a shard failed (re-run to resume), 2 bad input.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

__all__ = ["build_parser", "main"]


def _address(p: argparse.ArgumentParser, local: bool) -> None:
    p.add_argument("--address", default=None if local else "auto",
                   help="Ray cluster: HOST:PORT, ray://HOST:PORT or auto (default: "
                   + ("a new local cluster)" if local else "auto)"))  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="topk-ray", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pool = sub.add_parser("pool", help="start N teacher-server replicas on Ray and keep them")
    _address(pool, local=True)
    pool.add_argument("--local-cpus", type=int, default=None,
                      help="CPUs of the local cluster started without --address")  # fmt: skip
    pool.add_argument("--name", default=None,
                      help="the pool's name on the cluster, for `topk-ray targets/record "
                      "--pool` (default: a new unique one)")  # fmt: skip
    pool.add_argument("--replicas", type=int, default=1, help="replicas of the teacher")
    pool.add_argument("--num-cpus", type=float, default=1, help="CPUs per replica")
    pool.add_argument("--num-gpus", type=float, default=0,
                      help="GPUs per replica (a vLLM replica's tensor-parallel size)")  # fmt: skip
    pool.add_argument("--strategy", default="SPREAD",
                      choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                      help="placement group strategy")  # fmt: skip
    pool.add_argument("--placement-timeout-s", type=float, default=60,
                      help="refuse the pool when its replicas are not placed within this "
                      "(default: %(default)s)")  # fmt: skip
    pool.add_argument("--base-port", type=int, default=None,
                      help="replica i serves gRPC on BASE + 2i, HTTP on BASE + 2i + 1 "
                      "(default: free ports, one-node clusters only)")  # fmt: skip
    pool.add_argument("--log-dir", default=None,
                      help="each replica's server log, on its node "
                      "(default: a new temp dir)")  # fmt: skip
    pool.add_argument("--targets-file", type=Path, default=None,
                      help="write the replicas' gRPC targets there, one per line")  # fmt: skip
    pool.add_argument("serve_args", nargs=argparse.REMAINDER,
                      help="-- then teacher-server serve's flags")  # fmt: skip

    targets = sub.add_parser("targets", help="print a running pool's targets, one per line")
    _address(targets, local=False)
    targets.add_argument("--pool", required=True, help="the pool's --name")

    record = sub.add_parser("record", help="teacher-record as Ray tasks, one per shard")
    _address(record, local=False)
    src = record.add_mutually_exclusive_group(required=True)
    src.add_argument("--pool", help="record from this running pool (resolved per task)")
    src.add_argument("--teacher", help="record from these targets: h1:p1,h2:p2")
    record.add_argument("--input", required=True, help="teacher-record's --input")
    record.add_argument("--output", required=True, help="a path every node sees, or s3://")
    record.add_argument("--num-shards", type=int, required=True, help="Ray tasks (shards)")
    record.add_argument("--max-retries", type=int, default=3,
                        help="Ray's retries of a task whose worker died "
                        "(default: %(default)s)")  # fmt: skip
    record.add_argument("--task-cpus", type=float, default=1,
                        help="CPUs each task reserves (default: %(default)s)")  # fmt: skip
    record.add_argument("record_args", nargs=argparse.REMAINDER,
                        help="-- then further teacher-record flags")  # fmt: skip
    return parser


def _after_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def _pool(args: argparse.Namespace) -> int:
    from topk_ray.pool import PoolConfig, PoolError, TeacherPool, connect

    try:
        config = PoolConfig(
            _after_dashes(list(args.serve_args)),
            replicas=args.replicas,
            name=args.name,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            strategy=args.strategy,
            base_port=args.base_port,
            placement_timeout_s=args.placement_timeout_s,
            **({"log_dir": args.log_dir} if args.log_dir else {}),
        )
        connect(args.address, num_cpus=args.local_cpus)
        pool = TeacherPool(config).start()
    except PoolError as e:
        print(f"topk-ray pool: {e}", file=sys.stderr)
        return 2
    import ray

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    targets = pool.targets()
    print("\n".join(targets), flush=True)
    if args.targets_file is not None:
        args.targets_file.write_text("".join(f"{t}\n" for t in targets))
    print(
        f"topk-ray pool: pool {pool.name!r}: {len(targets)} replica(s) ready on the Ray "
        f"cluster at {ray.get_runtime_context().gcs_address}; SIGTERM drains and stops",
        file=sys.stderr,
        flush=True,
    )
    stop.wait()
    codes = pool.stop()
    print(f"topk-ray pool: pool {pool.name!r} stopped (server exit codes {codes})",
          file=sys.stderr)  # fmt: skip
    return 0


def _targets(args: argparse.Namespace) -> int:
    from topk_ray.pool import PoolError, connect
    from topk_ray.pool_registry import PoolResolver

    try:
        connect(args.address)
        targets = PoolResolver(args.pool)()
    except PoolError as e:
        print(f"topk-ray targets: {e}", file=sys.stderr)
        return 2
    print("\n".join(targets))
    return 0


def _record(args: argparse.Namespace) -> int:
    from topk_ray.pool import PoolError, connect
    from topk_ray.pool_registry import PoolResolver
    from topk_ray.record import RecordError, record_on_ray

    try:
        connect(args.address)
        targets = PoolResolver(args.pool) if args.pool else args.teacher.split(",")
        if args.pool:
            targets()  # the pool exists: named now, not in every task
        problems = record_on_ray(
            targets, args.input, args.output, num_shards=args.num_shards,
            record_args=_after_dashes(list(args.record_args)),
            max_retries=args.max_retries, num_cpus=args.task_cpus,
        )  # fmt: skip
    except PoolError as e:
        print(f"topk-ray record: {e}", file=sys.stderr)
        return 2
    except RecordError as e:
        print(f"topk-ray record: {e}", file=sys.stderr)
        return 2 if str(e).startswith(("num_shards:", "targets:")) else 1
    for line in problems:
        print(f"topk-ray record: --verify: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"topk-ray record: {args.output}: {args.num_shards} shard(s) recorded, --verify OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"pool": _pool, "targets": _targets, "record": _record}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
