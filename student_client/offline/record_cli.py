"""``teacher-record``: score a corpus of token sequences with a teacher into a payload dataset.

    teacher-record --teacher HOST:PORT --input TOKENS --output DIR --top-k 16 [--dtype float16]
        [--encoding packed [--logprob-bits 8]]

``TOKENS`` is a Parquet file, an Arrow file (IPC file or stream), a JSONL file (one list
of ints per line, or one object per line with the token column), or a Hugging Face
``datasets`` dataset saved with ``save_to_disk`` (a directory). The token column is
``--column`` (default: the first of ``input_ids``, ``token_ids``, ``tokens``).

Every position of every sequence is scored (with sampled log-probs) and written to the
recording directory ``DIR`` (:mod:`topk_protocol.recording`). Re-running the same command
skips sequences already recorded, so an interrupted run resumes where it stopped (losing
at most the recorder's last flush interval, 2 s).

Several teachers (a multi-teacher recording, :mod:`topk_protocol.multi_recording`)::

    teacher-record --teacher math=HOST:PORT --teacher code=H1:P,H2:P --input TOKENS ...

each sequence goes to the teacher its ``--teacher-column`` (default ``teacher_id``) names.

``--candidate-column NAME`` also scores, at every position, the candidate ids that column
holds (one list of C ids per token, ``-1`` padding; e.g. a student's top-C): the
recording then holds their log-probs too, and a re-run skips a sequence only when it is
recorded with those candidates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from student_client.clients.blocking import TeacherClient
from student_client.clients.multi import MultiTeacherClient
from student_client.data.batch import ScoreBatch
from topk_protocol import DTYPE_NAMES, ENCODING_NAMES, RequestOptions
from topk_protocol.checks import MAX_LOGPROB_BITS, MIN_LOGPROB_BITS
from topk_protocol.errors import InvalidRequestError
from topk_protocol.multi_recording import teacher_recording_path
from topk_protocol.packing import DEFAULT_LOGPROB_BITS
from topk_protocol.recording import (
    COMPRESSIONS,
    METADATA_FILE,
    RecordingReader,
)
from topk_protocol.replay import serves_candidates
from topk_protocol.storage import Location, StorageError, location

__all__ = [
    "build_parser",
    "main",
    "read_candidate_column",
    "read_teacher_column",
    "read_token_sequences",
]

TOKEN_COLUMNS = ("input_ids", "token_ids", "tokens")


def _pick_column(names: Iterable[str], column: str | None, source: Path) -> str:
    names = list(names)
    if column is not None:
        if column not in names:
            raise SystemExit(f"teacher-record: --column {column!r} is not in {source} ({names})")
        return column
    for name in TOKEN_COLUMNS:
        if name in names:
            return name
    raise SystemExit(
        f"teacher-record: {source} has no token column ({', '.join(TOKEN_COLUMNS)}); "
        f"its columns are {names}: pass --column"
    )


def _read_arrow(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        try:
            return pa.ipc.open_file(src).read_all()
        except pa.ArrowInvalid:
            src.seek(0)
            return pa.ipc.open_stream(src).read_all()


def read_token_sequences(path: str | Path, column: str | None = None) -> list[np.ndarray]:
    """Token-id sequences of a Parquet / Arrow / JSONL file or a saved ``datasets`` dataset."""
    return _read(Path(path), column)


def read_teacher_column(path: str | Path, column: str) -> list[str]:
    """The teacher name of each sequence: column ``column`` of the same input."""
    return _read(Path(path), column, teacher_column=True)


def read_candidate_column(path: str | Path, column: str) -> list[np.ndarray]:
    """Each sequence's candidate ids ``[L, C]`` (one list of C ids per token, ``-1``
    padding): column ``column`` of the same input."""
    return _read(Path(path), column, nested=True)


def _read(
    path: Path, column: str | None, teacher_column: bool = False, nested: bool = False
) -> Any:
    """The token column (or, ``teacher_column``, the named column of strings; ``nested``:
    the named column of lists of id lists) of ``path``."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise SystemExit(
                f"teacher-record: {path} is a directory: reading a saved dataset needs "
                "the `datasets` package"
            ) from None
        ds = datasets.load_from_disk(str(path))
        table = ds.data.table if hasattr(ds, "data") else None
        if table is None:
            raise SystemExit(f"teacher-record: {path}: expected a Dataset, not a DatasetDict")
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    elif path.suffix in (".arrow", ".feather", ".ipc"):
        table = _read_arrow(path)
    elif path.suffix in (".jsonl", ".json"):
        out = []
        with open(path) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if teacher_column:
                    if not isinstance(item, dict) or not isinstance(item.get(column), str):
                        raise SystemExit(
                            f"teacher-record: {path}:{n}: expected an object with a string "
                            f"{column!r} (--teacher-column)"
                        )
                    out.append(item[column])
                    continue
                if isinstance(item, dict):
                    item = item[_pick_column(item.keys(), column, path)]
                rows = item if nested and isinstance(item, list) else [item]
                if not all(
                    isinstance(r, list) and all(isinstance(v, int) for v in r) for r in rows
                ):
                    want = "a list of lists of ints" if nested else "a list of ints"
                    raise SystemExit(f"teacher-record: {path}:{n}: expected {want}")
                out.append(np.asarray(item, dtype=np.int64))
        return out
    else:
        raise SystemExit(
            f"teacher-record: --input {path}: use .parquet, .arrow, .jsonl or a dataset directory"
        )
    col = table.column(_pick_column(table.column_names, column, path))
    if teacher_column:
        return [str(v) for v in col.to_pylist()]
    return [np.asarray(v, dtype=np.int64) for v in col.to_pylist()]


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="seq", desc="teacher-record")
    except ImportError:
        return _PlainProgress(total)


class _PlainProgress:
    """A progress line every few seconds when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.n, self._last = total, 0, 0.0

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last > 5 or self.n == self.total:
            self._last = now
            print(f"teacher-record: {self.n}/{self.total} sequences", file=sys.stderr)

    def close(self) -> None:
        pass


def _batches(seqs: list[np.ndarray], size: int) -> Iterator[list[np.ndarray]]:
    for i in range(0, len(seqs), size):
        yield seqs[i : i + size]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="teacher-record", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--teacher",
        required=True,
        action="append",
        help="HOST:PORT (or a comma-separated list); repeat as NAME=TARGET for several "
        "teachers (a multi-teacher recording)",
    )
    ap.add_argument(
        "--teacher-column",
        default="teacher_id",
        help="with several teachers: the input column naming each sequence's teacher",
    )
    ap.add_argument("--input", required=True, type=Path, help="token sequences (see above)")
    ap.add_argument(
        "--output", required=True, type=location, help="recording directory or URI (s3://...)"
    )
    ap.add_argument("--top-k", type=int, default=16, help="K (default 16)")
    ap.add_argument(
        "--dtype",
        default="float16",
        choices=sorted(DTYPE_NAMES),
        help="log-prob dtype to record (float32 serves every dtype later; default float16)",
    )
    ap.add_argument(
        "--encoding",
        default="default",
        choices=sorted(ENCODING_NAMES),
        help="payload encoding to record: packed stores bit-packed ids and log-probs on a "
        "per-row grid (docs/protocol.md; default: default)",
    )
    ap.add_argument(
        "--logprob-bits",
        type=int,
        help=f"with --encoding packed: bits per log-prob code, {MIN_LOGPROB_BITS}.."
        f"{MAX_LOGPROB_BITS} (default {DEFAULT_LOGPROB_BITS})",
    )
    ap.add_argument(
        "--samples",
        type=int,
        default=0,
        help="record a sampled payload: N draws per position (K = N; needs --seed)",
    )
    ap.add_argument("--seed", type=int, help="seed of the draws (with --samples)")
    ap.add_argument(
        "--proposal-temperature",
        type=float,
        default=1.0,
        help="with --samples: draw from p^(1/T) with importance weights (default 1: from p)",
    )
    ap.add_argument("--column", help="token column (default: input_ids, token_ids or tokens)")
    ap.add_argument(
        "--candidate-column",
        help="also score these candidate ids: a column with one list of C ids (-1 pads) "
        "per token of each sequence; recorded with the payload",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per request")
    ap.add_argument("--depth", type=int, default=4, help="requests in flight")
    ap.add_argument("--token", help="bearer token of the teacher")
    ap.add_argument(
        "--compression", default="zstd", choices=[c for c in COMPRESSIONS if c != "auto"]
    )
    return ap


def _teachers(values: list[str]) -> str | dict[str, str]:
    """``--teacher`` values -> one target, or ``{name: target}`` for several teachers."""
    named = [v for v in values if "=" in v.split(":", 1)[0]]
    if not named:
        if len(values) > 1:
            raise SystemExit("teacher-record: several --teacher need names: NAME=TARGET")
        return values[0]
    if len(named) != len(values):
        raise SystemExit("teacher-record: --teacher: name every teacher (NAME=TARGET) or none")
    out: dict[str, str] = {}
    for v in values:
        name, target = v.split("=", 1)
        if name in out:
            raise SystemExit(f"teacher-record: --teacher {name}: given twice")
        out[name] = target
    return out


def _todo(
    output: str | Path,
    seqs: list[np.ndarray],
    opts: RequestOptions,
    cands: list[np.ndarray] | None = None,
) -> tuple[list[int], int]:
    """Indices of ``seqs`` not yet recorded in ``output`` (a recording, maybe absent;
    with ``cands``, with these candidate ids)."""
    try:  # an unreachable store fails here, before any teacher is asked
        out = Location.of(output)
        out.make_dir()
        recorded = out.child(METADATA_FILE).is_file()
    except StorageError as e:
        raise SystemExit(f"teacher-record: --output {output}: {e}") from None
    if not recorded:
        return list(range(len(seqs))), 0
    with RecordingReader(output) as r:
        held = (r.top_k, r.dtype, r.packing.logprob_bits if r.packing else None)
        if held != (opts.top_k, opts.dtype, opts.logprob_bits):
            raise SystemExit(
                f"teacher-record: {output} holds K {r.top_k} {r.dtype} "
                f"{_encoding(held[2])}; asked K {opts.top_k} {opts.dtype} "
                f"{_encoding(opts.logprob_bits)}"
            )
        todo = [
            i
            for i, s in enumerate(seqs)
            if isinstance(
                r.find(
                    s.astype("<i4").tobytes(),
                    0,
                    len(s),
                    True,
                    None if cands is None else serves_candidates(0, len(s), cands[i]),
                ),
                str,
            )
        ]
    return todo, len(seqs) - len(todo)


def _encoding(logprob_bits: int | None) -> str:
    return "unpacked" if logprob_bits is None else f"packed at {logprob_bits} bits"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise SystemExit(f"teacher-record: --batch-size must be >= 1, got {args.batch_size}")
    teachers = _teachers(args.teacher)
    sampling: dict[str, Any] = {}
    if args.samples or args.seed is not None or args.proposal_temperature != 1.0:
        if args.samples:
            args.top_k = args.samples  # a sampled payload has one column per draw
        sampling = {
            "samples": args.samples,
            "seed": args.seed,
            "proposal_temperature": args.proposal_temperature,
        }
    try:
        opts = RequestOptions(
            args.top_k,
            args.dtype,
            encoding=args.encoding,
            logprob_bits=args.logprob_bits,
            **sampling,
        )
    except InvalidRequestError as e:
        raise SystemExit(f"teacher-record: {e.message}") from None
    seqs = read_token_sequences(args.input, args.column)
    cands = None
    if args.candidate_column:
        cands = read_candidate_column(args.input, args.candidate_column)
        bad = [i for i, (s, c) in enumerate(zip(seqs, cands, strict=True)) if len(c) != len(s)]
        if bad:
            raise SystemExit(
                f"teacher-record: {args.input}: --candidate-column {args.candidate_column!r}: "
                f"row {bad[0]} has {len(cands[bad[0]])} id lists for {len(seqs[bad[0]])} tokens"
            )
    names: list[str] | None = None
    if isinstance(teachers, dict):
        names = read_teacher_column(args.input, args.teacher_column)
        unknown = sorted(set(names) - set(teachers))
        if unknown:
            raise SystemExit(
                f"teacher-record: {args.input}: --teacher-column {args.teacher_column!r} "
                f"names {unknown}, not among --teacher {sorted(teachers)}"
            )
        keep, done = [], 0
        for name in teachers:
            rows = [i for i, n in enumerate(names) if n == name]
            todo, already = _todo(
                teacher_recording_path(args.output, name), [seqs[i] for i in rows],
                opts, None if cands is None else [cands[i] for i in rows],
            )  # fmt: skip
            keep += [rows[i] for i in todo]
            done += already
        keep.sort()
    else:
        keep, done = _todo(args.output, seqs, opts, cands)
    seqs = [seqs[i] for i in keep]
    cands = None if cands is None else [cands[i] for i in keep]
    route = None if names is None else [names[i] for i in keep]
    bar = _progress(len(seqs))
    positions = 0
    t0 = time.monotonic()
    options: dict[str, Any] = {
        "token": args.token,
        "record_to": args.output,
        "record_compression": args.compression,
        "record_metadata": {"input": str(args.input)},
    }
    client: TeacherClient | MultiTeacherClient
    if isinstance(teachers, dict):
        client = MultiTeacherClient(teachers, **options)
    else:
        client = TeacherClient(teachers, **options)
    with client:
        batches: list[Any] = list(_batches(seqs, args.batch_size))
        if route is not None or cands is not None:
            size = args.batch_size
            batches = [
                ScoreBatch(
                    b,
                    teacher=None if route is None else route[i * size : i * size + len(b)],
                    candidate_ids=None if cands is None else cands[i * size : i * size + len(b)],
                )
                for i, b in enumerate(batches)
            ]
        for _batch, payload in zip(
            batches,
            client.stream(batches, opts, depth=args.depth),
            strict=True,
        ):
            positions += payload.num_positions
            bar.update(payload.batch_size)
    bar.close()
    dt = time.monotonic() - t0
    print(
        f"teacher-record: scored {len(seqs)} sequences ({positions} positions, "
        f"{positions / max(dt, 1e-9):.0f} positions/s); {done} were recorded already; "
        f"-> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
