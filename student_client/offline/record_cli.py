"""``teacher-record``: score a corpus of token sequences with a teacher into a payload dataset.

    teacher-record --teacher HOST:PORT --input TOKENS --output DIR --top-k 16 [--dtype float16]
        [--encoding packed [--logprob-bits 8]]

``TOKENS`` is a Parquet file, an Arrow file (IPC file or stream), a JSONL file (one list
of ints per line, or one object per line with the token column), a Hugging Face
``datasets`` dataset saved with ``save_to_disk`` (a directory), or ``datasets:NAME_OR_DIR``
(``load_dataset(..., streaming=True)``); a path or a URI (``s3://...``). It is read a few
rows at a time (:mod:`.inputs`). The token column is ``--column`` (default: the first of
``input_ids``, ``token_ids``, ``tokens``).

Every position of every sequence is scored (with sampled log-probs) and written to the
recording directory ``DIR`` (:mod:`topk_protocol.recording`). Re-running the same command
skips sequences already recorded, so an interrupted run resumes where it stopped (losing
at most the recorder's last flush interval, 2 s).

Many recorders (a Kubernetes Indexed Job): ``--shard-index I --num-shards N`` (defaults:
``$JOB_COMPLETION_INDEX`` and ``$TOPK_RECORD_NUM_SHARDS``) records the I-th contiguous
1/N of the input's units into ``DIR/part-0000I-of-0000N`` (:mod:`topk_protocol.recording.sharded`);
``teacher-record --verify DIR`` checks the parts before training.

Several teachers (a multi-teacher recording, :mod:`topk_protocol.recording.multi_recording`)::

    teacher-record --teacher math=HOST:PORT --teacher code=H1:P,H2:P --input TOKENS ...

each sequence goes to the teacher its ``--teacher-column`` (default ``teacher_id``) names.

``--candidate-column NAME`` also scores, at every position, the candidate ids that column
holds (one list of C ids per token, ``-1`` padding; e.g. a student's top-C): the
recording then holds their log-probs too, and a re-run skips a sequence only when it is
recorded with those candidates.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# First, before anything imports pyarrow: Arrow's jemalloc pool for this process.
import student_client.offline._arrow_pool  # noqa: F401
from student_client.clients.blocking import TeacherClient
from student_client.clients.multi_teacher import MultiTeacherClient
from student_client.offline.inputs import (
    DATASETS_PREFIX,
    TOKEN_COLUMNS,
    InputError,
    InputSource,
    open_input,
    shard_range,
)
from student_client.offline.read_inputs import (
    read_candidate_column,
    read_teacher_column,
    read_token_sequences,
)
from student_client.offline.recorder import (
    ShardStats,
    files_bytes,
    recorded_keys,
    recording_dirs,
    seal_cut_shards,
    stream_shard,
)
from topk_protocol import DTYPE_NAMES, ENCODING_NAMES, RequestOptions
from topk_protocol.checks import MAX_LOGPROB_BITS, MIN_LOGPROB_BITS
from topk_protocol.errors import InvalidRequestError, RecordingError
from topk_protocol.packing import DEFAULT_LOGPROB_BITS
from topk_protocol.recording import COMPRESSIONS
from topk_protocol.recording.format import read_metadata, recording_packing
from topk_protocol.recording.sharded import (
    delete_part_file,
    holds_recording,
    list_parts,
    part_location,
    read_part_file,
    write_part_file,
)
from topk_protocol.storage import Location, StorageError

__all__ = [
    "DEFAULT_MAX_INFLIGHT",
    "NUM_SHARDS_ENV",
    "SHARD_INDEX_ENV",
    "TOKEN_COLUMNS",
    "TOKEN_ENV",
    "build_parser",
    "main",
    "read_candidate_column",
    "read_teacher_column",
    "read_token_sequences",
]

#: The shard index's default: what a Kubernetes Indexed Job sets in each pod.
SHARD_INDEX_ENV = "JOB_COMPLETION_INDEX"
#: The shard count's default (set it next to ``completions`` in the Job).
NUM_SHARDS_ENV = "TOPK_RECORD_NUM_SHARDS"
#: The teacher's bearer token's default (the variable the server reads too).
TOKEN_ENV = "TOPK_TEACHER_TOKEN"
#: Request batches read ahead of the teacher (the recorder's memory bound, with --depth).
DEFAULT_MAX_INFLIGHT = 4


def _progress(total: int | None, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc=desc, disable=quiet, smoothing=0.1)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"teacher-record: ${name} {value!r} is not an integer") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="teacher-record", description=__doc__.split("\n")[0])
    _add_target_flags(ap)
    _add_payload_flags(ap)
    _add_input_flags(ap)
    _add_run_flags(ap)
    return ap


def _add_target_flags(ap: argparse.ArgumentParser) -> None:
    """Who scores what, and where it goes: ``--teacher``, ``--input``, ``--output``."""
    ap.add_argument(
        "--teacher",
        action="append",
        help="HOST:PORT (or a comma-separated list); repeat as NAME=TARGET for several "
        "teachers (a multi-teacher recording)",
    )
    ap.add_argument(
        "--teacher-column",
        default="teacher_id",
        help="with several teachers: the input column naming each sequence's teacher "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--input",
        help="token sequences: a Parquet, Arrow (IPC file or stream) or JSONL file, a "
        f"datasets directory (save_to_disk) or {DATASETS_PREFIX}NAME_OR_DIR (streamed); "
        "a path or a URI (s3://...)",
    )
    ap.add_argument("--output", help="recording directory, a path or a URI")


def _add_payload_flags(ap: argparse.ArgumentParser) -> None:
    """What each request asks for: K, dtype, encoding, sampling."""
    ap.add_argument("--top-k", type=int, default=16, help="K (default: %(default)s)")
    ap.add_argument(
        "--dtype",
        default="float16",
        choices=sorted(DTYPE_NAMES),
        help="log-prob dtype to record (float32 serves every dtype later; default: %(default)s)",
    )
    ap.add_argument(
        "--encoding",
        default="default",
        choices=sorted(ENCODING_NAMES),
        help="payload encoding to record: packed stores bit-packed ids and log-probs on a "
        "per-row grid (docs/protocol.md; default: %(default)s)",
    )
    ap.add_argument(
        "--logprob-bits",
        type=int,
        help=f"with --encoding packed: bits per log-prob code, {MIN_LOGPROB_BITS}.."
        f"{MAX_LOGPROB_BITS} (default: {DEFAULT_LOGPROB_BITS})",
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
        help="with --samples: draw from p^(1/T) with importance weights (default: %(default)s, "
        "from p)",
    )


def _add_input_flags(ap: argparse.ArgumentParser) -> None:
    """Which columns of the input are read."""
    ap.add_argument("--column", help="token column (default: input_ids, token_ids or tokens)")
    ap.add_argument(
        "--candidate-column",
        help="also score these candidate ids: a column with one list of C ids (-1 pads) "
        "per token of each sequence; recorded with the payload",
    )
    ap.add_argument(
        "--split",
        default="train",
        help=f"the split of a {DATASETS_PREFIX} input (default: %(default)s)",
    )


def _add_run_flags(ap: argparse.ArgumentParser) -> None:
    """How the run goes: batching, depth, token, compression, sharding, progress, --verify."""
    ap.add_argument(
        "--batch-size", type=int, default=8, help="sequences per request (default: %(default)s)"
    )
    ap.add_argument(
        "--depth", type=int, default=4, help="requests in flight (default: %(default)s)"
    )
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        help="request batches read ahead of the teacher (memory: about max-inflight + depth "
        "batches; default: %(default)s)",
    )
    ap.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"bearer token of the teacher (default: ${TOKEN_ENV})",
    )
    ap.add_argument(
        "--compression",
        default="zstd",
        choices=[c for c in COMPRESSIONS if c != "auto"],
        help="compression of the recorded Parquet shards (default: %(default)s)",
    )
    ap.add_argument(
        "--shard-index",
        type=int,
        help=f"this recorder's shard, 0 <= I < --num-shards (default: ${SHARD_INDEX_ENV}, else 0)",
    )
    ap.add_argument(
        "--num-shards",
        type=int,
        help=f"recorders sharing the input (default: ${NUM_SHARDS_ENV}, else 1)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bar (the summary stays)")
    ap.add_argument(
        "--verify",
        metavar="DIR",
        help="check a recording (every part: counts, checksums, no gaps, no duplicates, "
        "one shard count): print every problem, naming its file, then their count, and "
        "exit non-zero; or print one OK line",
    )


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


def _shard(args: argparse.Namespace) -> tuple[int, int]:
    """``(index, num_shards)`` from the flags, else the environment, checked."""
    num = args.num_shards if args.num_shards is not None else _env_int(NUM_SHARDS_ENV) or 1
    index = args.shard_index if args.shard_index is not None else _env_int(SHARD_INDEX_ENV) or 0
    if num < 1:
        raise SystemExit(f"teacher-record: --num-shards must be >= 1, got {num}")
    if not 0 <= index < num:
        where = "--shard-index" if args.shard_index is not None else f"${SHARD_INDEX_ENV}"
        raise SystemExit(
            f"teacher-record: {where} {index} is out of range for --num-shards {num} "
            f"(0 <= index < {num})"
        )
    return index, num


def _check_layout(output: str, num_shards: int) -> None:
    """Refuse an output that another shard count wrote (nothing in it is touched)."""
    other = [p for p in list_parts(output) if p.num_shards != num_shards]
    if other:
        raise SystemExit(
            f"teacher-record: {other[0].location} was written with --num-shards "
            f"{other[0].num_shards}; this run has --num-shards {num_shards}: use the same "
            "count, or another --output"
        )
    if num_shards > 1 and holds_recording(output):
        raise SystemExit(
            f"teacher-record: {output} holds a recording written with --num-shards 1; this "
            f"run has --num-shards {num_shards}: use the same count, or another --output"
        )


def _check_format(part: str, opts: RequestOptions) -> None:
    """The part's recordings (when any) must hold the asked K, dtype and encoding."""
    asked = (opts.top_k, opts.dtype, opts.logprob_bits)
    for _, location in recording_dirs(part):
        try:
            meta, _ = read_metadata(Location.of(location))
        except RecordingError:
            continue
        packing = recording_packing(meta)
        held = (meta["top_k"], meta["dtype"], None if packing is None else packing.logprob_bits)
        if held != asked:
            raise SystemExit(
                f"teacher-record: {location} holds K {held[0]} {held[1]} "
                f"{_encoding(held[2])}; asked K {asked[0]} {asked[1]} {_encoding(asked[2])}"
            )


def _encoding(logprob_bits: int | None) -> str:
    return "unpacked" if logprob_bits is None else f"packed at {logprob_bits} bits"


def _request_options(args: argparse.Namespace) -> RequestOptions:
    """The one ``RequestOptions`` of every request: K, dtype, encoding, sampling."""
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
        return RequestOptions(
            args.top_k,
            args.dtype,
            encoding=args.encoding,
            logprob_bits=args.logprob_bits,
            **sampling,
        )
    except InvalidRequestError as e:
        raise SystemExit(f"teacher-record: {e.message}") from None


def _open(args: argparse.Namespace, teachers: str | dict[str, str]) -> InputSource:
    try:
        return open_input(
            args.input,
            args.column,
            teacher_column=args.teacher_column if isinstance(teachers, dict) else None,
            candidate_column=args.candidate_column,
            batch_rows=args.batch_size,
            split=args.split,
        )
    except InputError as e:
        raise SystemExit(f"teacher-record: {e}") from None
    except OSError as e:  # StorageError, or the store's answer: unreachable, refused
        raise SystemExit(f"teacher-record: --input {args.input}: {e}") from None


def _check_output(output: str) -> None:
    """Create ``output`` (a directory, or a prefix of a store): an unreachable store
    fails here, before any teacher is asked."""
    try:
        Location.of(output).make_dir()
    except StorageError as e:
        raise SystemExit(f"teacher-record: --output {output}: {e}") from None


@dataclass(frozen=True)
class _Shard:
    """This recorder's share of the run, opened: its part location, its input units, what
    the part held before (``previous``: its ``part.json``; ``recorded``: the keys of its
    rows; ``bytes_before``: its files' size)."""

    index: int
    num: int
    part: str
    source: InputSource
    units: range
    previous: dict[str, Any] | None
    recorded: set[bytes]
    bytes_before: int

    @property
    def label(self) -> str:
        """``shard I/N`` when there are several, else the command's name."""
        return f"shard {self.index}/{self.num}" if self.num > 1 else "teacher-record"


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.verify is not None:
        from student_client.offline.verify import verify_main

        return verify_main(args.verify)
    _check_args(ap, args)
    teachers = _teachers(args.teacher)
    opts = _request_options(args)
    shard = _open_shard(args, teachers, opts)
    stats, started = _record(args, teachers, opts, shard)
    rows = len(recorded_keys(shard.part, args.candidate_column is not None))
    written = files_bytes(shard.part) - shard.bytes_before
    _write_part(args, shard, stats, rows, started)
    rate = stats.positions / max(stats.seconds, 1e-9)
    print(
        f"teacher-record: {shard.label + ': ' if shard.num > 1 else ''}"
        f"scored {stats.rows} sequences ({stats.positions} positions, {written} bytes, "
        f"{stats.seconds:.1f} s, {rate:.0f} positions/s); {stats.already} were recorded "
        f"already; {stats.repeats} repeated an earlier row; {rows} rows in {shard.part}"
    )
    return 0


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags a recording run needs, and the counts that must be >= 1."""
    missing = [f"--{n}" for n in ("teacher", "input", "output") if not getattr(args, n)]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    for flag in ("batch_size", "depth", "max_inflight"):
        if getattr(args, flag) < 1:
            raise SystemExit(
                f"teacher-record: --{flag.replace('_', '-')} must be >= 1, got "
                f"{getattr(args, flag)}"
            )


def _open_shard(
    args: argparse.Namespace, teachers: str | dict[str, str], opts: RequestOptions
) -> _Shard:
    """Check the output, open the input and this shard's part: a part a crash cut is
    sealed first, the part's recordings must hold the asked format, and its
    ``part.json`` is taken away until the run ends (a part without one is unfinished)."""
    index, num = _shard(args)
    output = str(args.output)
    _check_output(output)
    _check_layout(output, num)
    source = _open(args, teachers)
    units = shard_range(source.num_units, index, num)
    part = part_location(output, index, num)
    for line in seal_cut_shards(part):
        print(f"teacher-record: {line}", file=sys.stderr)
    _check_format(part, opts)
    try:
        previous = read_part_file(part)  # a complete part's record, kept if nothing changes
    except ValueError:
        previous = None
    delete_part_file(part)
    recorded = recorded_keys(part, args.candidate_column is not None)
    return _Shard(index, num, part, source, units, previous, recorded, files_bytes(part))


def _progress_bar(total: int | None, num_units: int, bar: Any) -> Callable[[ShardStats], None]:
    """``on_progress`` of :func:`stream_shard`: rows done on ``bar`` and the rate; with no
    ``total`` known up front, the total estimated from the rows per unit read so far."""

    def progress(stats: ShardStats) -> None:
        if total is None and stats.units_done:
            bar.total = round(stats.rows_read / stats.units_done * num_units)
        bar.n = stats.rows + stats.already + stats.repeats
        bar.set_postfix_str(
            f"{stats.positions / max(stats.seconds, 1e-9):.0f} positions/s", refresh=False
        )
        bar.update(0)  # redraws at most every mininterval

    return progress


def _client(
    args: argparse.Namespace, teachers: str | dict[str, str], shard: _Shard
) -> TeacherClient | MultiTeacherClient:
    """The client recording into the shard's part (several teachers: a multi-teacher one)."""
    options: dict[str, Any] = {
        "token": args.token,
        "record_to": shard.part,
        "record_compression": args.compression,
        "record_metadata": {"input": str(args.input), "shard": [shard.index, shard.num]},
    }
    if isinstance(teachers, dict):
        return MultiTeacherClient(teachers, **options)
    return TeacherClient(teachers, **options)


def _record(
    args: argparse.Namespace,
    teachers: str | dict[str, str],
    opts: RequestOptions,
    shard: _Shard,
) -> tuple[ShardStats, float]:
    """Stream the shard's units through the teacher into its part: the run's stats and
    when it started (Unix seconds). A bad input row ends the run, naming it; the rows
    before it stay recorded."""
    total = shard.source.rows_in(shard.units)
    bar = _progress(total, shard.label, args.quiet)
    client = _client(args, teachers, shard)
    error: InputError | None = None
    started = time.time()
    try:
        with client:
            try:
                stats = stream_shard(
                    lambda reqs: client.stream_answers(reqs, opts, depth=args.depth),
                    shard.source,
                    shard.units,
                    batch_size=args.batch_size,
                    max_inflight=args.max_inflight,
                    recorded=shard.recorded,
                    teachers=frozenset(teachers) if isinstance(teachers, dict) else None,
                    on_progress=_progress_bar(total, len(shard.units), bar),
                )
            except InputError as e:
                error = e
    finally:
        bar.close()
        shard.source.close()
    if error is not None:
        raise SystemExit(
            f"teacher-record: {error}; the rows before it are recorded in {shard.part} "
            "(re-run to resume)"
        )
    return stats, started


def _write_part(
    args: argparse.Namespace, shard: _Shard, stats: ShardStats, rows: int, started: float
) -> None:
    """Seal the part with its ``part.json``: a complete part run again that scored nothing
    keeps the record of the run that scored it (its positions and times)."""
    previous = shard.previous
    if previous is not None and stats.rows == 0 and previous.get("rows") == rows:
        write_part_file(shard.part, {k: v for k, v in previous.items() if k != "format"})
        return
    write_part_file(
        shard.part,
        {
            "shard_index": shard.index,
            "num_shards": shard.num,
            "input": str(args.input),
            "unit": shard.source.unit_name,
            "units": [shard.units.start, shard.units.stop],
            "num_units": shard.source.num_units,
            "input_rows": stats.rows_read,
            "repeats": stats.repeats,
            "rows": rows,
            # this run's: what it scored, and when (its first request to its last answer)
            "scored_positions": stats.positions,
            "started_unix": started,
            "finished_unix": started + stats.seconds,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
