"""``topk-ray pool``: a teacher pool on a Ray cluster from the command line.

    topk-ray pool --address auto --replicas 4 --num-gpus 2 --targets-file targets.txt \\
        -- --backend vllm --model Qwen/Qwen3-8B --dtype bfloat16

Everything after ``--`` is ``teacher-server serve``'s flags. The replicas' targets are
printed (and written to ``--targets-file``, one per line, for the students); the pool
keeps running until SIGTERM or SIGINT, then drains every replica and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="topk-ray", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pool = sub.add_parser("pool", help="start N teacher-server replicas on Ray and keep them")
    pool.add_argument("--address", default=None,
                      help="Ray cluster: HOST:PORT, ray://HOST:PORT or auto "
                      "(default: a local cluster)")  # fmt: skip
    pool.add_argument("--local-cpus", type=int, default=None,
                      help="CPUs of the local cluster started without --address")  # fmt: skip
    pool.add_argument("--replicas", type=int, default=1, help="replicas of the teacher")
    pool.add_argument("--num-cpus", type=float, default=1, help="CPUs per replica")
    pool.add_argument("--num-gpus", type=float, default=0,
                      help="GPUs per replica (a vLLM replica's tensor-parallel size)")  # fmt: skip
    pool.add_argument("--strategy", default="SPREAD",
                      choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                      help="placement group strategy")  # fmt: skip
    pool.add_argument("--base-port", type=int, default=None,
                      help="replica i serves gRPC on BASE + 2i, HTTP on BASE + 2i + 1 "
                      "(default: free ports, one-node clusters only)")  # fmt: skip
    pool.add_argument("--targets-file", type=Path, default=None,
                      help="write the replicas' gRPC targets there, one per line")  # fmt: skip
    pool.add_argument("serve_args", nargs=argparse.REMAINDER,
                      help="-- then teacher-server serve's flags")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from topk_ray.pool import PoolConfig, PoolError, TeacherPool, connect

    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    try:
        config = PoolConfig(
            serve_args,
            replicas=args.replicas,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            strategy=args.strategy,
            base_port=args.base_port,
        )
        connect(args.address, num_cpus=args.local_cpus)
        pool = TeacherPool(config).start()
    except PoolError as e:
        print(f"topk-ray pool: {e}", file=sys.stderr)
        return 2
    targets = pool.targets()
    print("\n".join(targets), flush=True)
    if args.targets_file is not None:
        args.targets_file.write_text("".join(f"{t}\n" for t in targets))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    pool.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
