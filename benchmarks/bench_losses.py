"""Peak extra memory and time of the top-k KL loss against two autograd baselines.

Run from the repository root::

    python benchmarks/bench_losses.py                       # N = 8192 and 16384, V = 32768, K = 64
    python benchmarks/bench_losses.py --positions 2048 --repeats 1   # quick look
    python benchmarks/bench_losses.py --lm-head --positions 8192 --repeats 1   # fused vs logits

Default variants, all on bfloat16 logits `[N, V]` that require grad, forward + backward:


- `chunked-tail`, `chunked-truncated`: `topk_kl_loss` (this package), default chunk size.
- `chunked-tail-overlap` (only with `--variants`): `chunked-tail` with `overlap=True`, to
  measure what the overlap statistic costs.
- `chunked-reverse`, `chunked-jsd` (only with `--variants`): `chunked-tail` with the reverse
  KL / the generalized JSD (beta 0.5) instead of the forward KL; compare with
  `chunked-tail` in the same run.
- `naive`: `log_softmax(logits.float())` + gather, autograd backward (verl's default path).
- `rowchunk-autograd`: verl's row-chunked variant: per chunk of rows, an fp32 copy and its
  `logsumexp`, gathered, concatenated (4096 rows per chunk, the `chunked_topk_chunk_size`
  in verl's docs); autograd keeps every chunk's fp32 copy for backward.

With `--lm-head` the inputs are instead bfloat16 last hidden states `[N, H]` and an lm_head
weight `[V, H]`, both requiring grad, and every variant returns both gradients:

- `logits-chunked`: the logits path, `logits = hidden @ weight.T` then `topk_kl_loss` (tail);
  backward through the loss (the logits' own gradient) and the matmul.
- `fused`: `lm_head_topk_kl_loss(weight, hidden, ...)` (tail), gradients computed in forward.
- `fused-recompute`: the same with `grad_in_forward=False` (chunk logits recomputed in
  backward: four matmuls instead of three).
- `fused-reverse`, `fused-jsd` (only with `--variants`): `fused` with the reverse KL / the
  JSD; compare with `fused` in the same run.

When a divergence variant runs next to the forward tail loss of its path, a last table gives
their peak-memory and median-time ratios.

bf16 needs a CPU that computes it natively (AVX-512 BF16 or AMX; `benchmarks.capability`).
On one without, the benchmark says what it skips and why, then runs the float32 version of
the case (`--dtype float32`, labelled); with `--seed-dims` it runs nothing (the seeds'
table is the bf16 one; `--seed-dims --dtype float32` runs it in float32).

Memory method: each (variant, N) runs once in a fresh Python process. It builds the inputs
(logits filled in place in small blocks, so building them leaves only a small transient
peak), resets its RSS high-water mark (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0),
reads its resident set size `VmRSS` from /proc/self/status, runs forward + backward once,
and reads the high-water mark `VmHWM`. Peak extra memory = `VmHWM - VmRSS(before)`:
everything the loss allocated at its peak, including the gradient it returns (which alone
is 1x the logits).

Time method: per N, one more process builds the inputs once and runs all variants round
by round (one warm-up round, then `--repeats` timed rounds), so that outside load on the
machine hits every variant alike; it reports the median and the minimum per variant.
Linux only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.capability import bf16_skip_reason
from student_client.losses.types import GradAccumulation

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("chunked-tail", "chunked-truncated", "naive", "rowchunk-autograd")
EXTRA_VARIANTS = ("chunked-tail-overlap", "chunked-reverse", "chunked-jsd")  # via --variants
LM_HEAD_VARIANTS = ("logits-chunked", "fused", "fused-recompute")
LM_HEAD_EXTRA_VARIANTS = (  # only when named in --variants
    "logits-naive",
    "fused-compensated",
    "fused-float32",
    "fused-reverse",
    "fused-jsd",
)
#: divergence variant -> (its divergence, the forward tail variant of the same path)
DIVERGENCE_VARIANTS = {
    "chunked-reverse": ("reverse", "chunked-tail"),
    "chunked-jsd": ("jsd", "chunked-tail"),
    "fused-reverse": ("reverse", "fused"),
    "fused-jsd": ("jsd", "fused"),
}
ROWCHUNK_ROWS = 4096  # verl's documented chunked_topk_chunk_size
SEED_DIMENSIONS = {"vocab": 248_320, "hidden_size": 2560, "top_k": 128}
"""The seeds' own table (verl's Megatron top-k KL for a Qwen3.5-4B student)."""
SEED_POSITIONS = [2048, 4096, 8192]
SEED_VARIANTS = ["logits-naive", "logits-chunked", "fused"]
ACCURACY_VOCAB_ROWS = 4096  # grad_weight rows [0, 4096) against the float64 reference
ACCURACY_POSITIONS = 32  # grad_hidden rows [0, 32)
MEMORY_MARGIN_BYTES = 2 * 2**30  # left free for the rest of the machine
DTYPES = ("bfloat16", "float32")  # of the logits, or of the hidden states and weight


def _reset_peak() -> bool:
    """Reset this process's `VmHWM` to its current RSS (Linux >= 4.0); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(
    n_rows: int, vocab: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits `[N, V]` in `dtype` (requires grad), teacher ids and log-probs `[N, K]`.

    Teacher ids as `_teacher` builds them.
    """
    generator = torch.Generator().manual_seed(0)
    logits = torch.empty(n_rows, vocab, dtype=dtype)
    for start in range(0, n_rows, 64):  # fill in place: no [N, V] transient
        block = torch.randn(min(64, n_rows - start), vocab, generator=generator) * 2
        logits[start : start + block.shape[0]] = block
    ids, teacher = _teacher(n_rows, vocab, top_k, generator)
    return logits.requires_grad_(True), ids, teacher - 0.3


def _teacher(
    n_rows: int, vocab: int, top_k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher ids `[N, K]` and log-probs `[N, K]` (before the -0.3 shift).

    Ids of a row are `(a + b * j) mod V`, `j < K`, with random `a` and a random odd `b`
    (replaced by 1 where it shares a factor with `V`): distinct, scattered, cheap to build.
    """
    offset = torch.randint(0, vocab, (n_rows, 1), generator=generator)
    stride = 2 * torch.randint(0, vocab // 2, (n_rows, 1), generator=generator) + 1
    stride = torch.where(torch.gcd(stride, torch.tensor(vocab)) == 1, stride, 1)
    ids = (offset + stride * torch.arange(top_k)) % vocab
    teacher = torch.log_softmax(torch.randn(n_rows, top_k, generator=generator) * 2, -1)
    return ids, teacher


def _lm_head_inputs(
    n_rows: int, vocab: int, top_k: int, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Hidden `[N, H]` and weight `[V, H]` in `dtype` (both require grad), teacher ids,
    log-probs."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, generator=generator).to(dtype)
    weight = torch.empty(vocab, hidden_size, dtype=dtype)
    for start in range(0, vocab, 1024):  # fill in place: no fp32 [V, H] transient
        block = torch.randn(min(1024, vocab - start), hidden_size, generator=generator)
        weight[start : start + block.shape[0]] = block * (2.0 / hidden_size**0.5)
    ids, teacher = _teacher(n_rows, vocab, top_k, generator)
    return hidden.requires_grad_(True), weight.requires_grad_(True), ids, teacher - 0.3


_ACCUMULATION: dict[str, GradAccumulation] = {
    "fused-compensated": "compensated",
    "fused-float32": "float32",
}


def _lm_head_loss_fn(variant: str, chunk_size: int | None) -> Callable[..., torch.Tensor]:
    from student_client.losses import (
        LossOptions,
        TeacherTargets,
        lm_head_topk_kl_loss,
        topk_kl_loss,
    )

    def logits_path(
        hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
    ) -> torch.Tensor:
        teacher = TeacherTargets(ids, logprobs)
        loss, _ = topk_kl_loss(hidden @ weight.t(), teacher, LossOptions(chunk_size=chunk_size))
        return loss

    divergence = DIVERGENCE_VARIANTS.get(variant, ("forward", ""))[0]

    def fused(
        hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
    ) -> torch.Tensor:
        options = LossOptions(
            chunk_size=chunk_size,
            grad_in_forward=variant != "fused-recompute",
            grad_weight_accumulation=_ACCUMULATION.get(variant, "weight"),
            divergence=divergence,
        )
        loss, _ = lm_head_topk_kl_loss(weight, hidden, TeacherTargets(ids, logprobs), options)
        return loss

    def logits_naive(
        hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
    ) -> torch.Tensor:
        return _naive(hidden @ weight.t(), ids, logprobs)

    if variant == "logits-naive":
        return logits_naive
    return logits_path if variant == "logits-chunked" else fused


def _naive(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, ids)
    return (logprobs.exp() * (logprobs - log_q)).sum(-1).mean()


def _rowchunk(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    parts = []
    for chunk, chunk_ids in zip(logits.split(ROWCHUNK_ROWS), ids.split(ROWCHUNK_ROWS), strict=True):
        chunk_f = chunk.float()
        lse = torch.logsumexp(chunk_f, dim=-1, keepdim=True)
        parts.append(chunk_f.gather(1, chunk_ids) - lse)
    log_q = torch.cat(parts)
    return (logprobs.exp() * (logprobs - log_q)).sum(-1).mean()


def _loss_fn(variant: str, chunk_size: int | None) -> Callable[..., torch.Tensor]:
    if variant in LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS:
        return _lm_head_loss_fn(variant, chunk_size)
    if variant == "naive":
        return _naive
    if variant == "rowchunk-autograd":
        return _rowchunk
    from student_client.losses import LossOptions, TeacherTargets, topk_kl_loss
    from student_client.losses.types import LossMode

    mode: LossMode = "truncated" if variant == "chunked-truncated" else "tail"
    overlap = variant == "chunked-tail-overlap"
    divergence = DIVERGENCE_VARIANTS.get(variant, ("forward", ""))[0]

    def chunked(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        options = LossOptions(
            mode=mode,
            chunk_size=chunk_size,
            overlap=overlap,
            divergence=divergence,
        )
        loss, _ = topk_kl_loss(logits, TeacherTargets(ids, logprobs), options)
        return loss

    return chunked


def _fwd_bwd_seconds(
    loss_fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
) -> float:
    for tensor in inputs:
        tensor.grad = None
    start = time.perf_counter()
    loss_fn(*inputs).backward()
    return time.perf_counter() - start


def _make_inputs(
    variant: str, n_rows: int, vocab: int, top_k: int, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    if variant in LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS:
        return _lm_head_inputs(n_rows, vocab, top_k, hidden_size, dtype)
    return _inputs(n_rows, vocab, top_k, dtype)


def float64_reference(
    inputs: tuple[torch.Tensor, ...], vocab_rows: int, positions: int
) -> dict[str, torch.Tensor]:
    """Float64 gradients of the tail-mode loss ("mean", T = 1) on two slices.

    `grad_weight[:vocab_rows]` (every position contributes) and `grad_hidden[:positions]`,
    from the closed form of docs/losses.md ("Gradient"): `dL/dz_j = (a q_j + [j in I]
    (b q_j - p_j)) / N`, computed here independently of the package. Everything is float64
    except each row's normalizer `sum_j exp(z_j - m)`, whose logits come from an fp32
    matmul of the same bf16 inputs (relative error ~1e-6, three orders below the errors
    measured; a float64 pass over `[N, V]` would take minutes here).
    """
    hidden, weight, ids, logprobs = (tensor.detach() for tensor in inputs)
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    hidden32, hidden64 = hidden.float(), hidden.double()
    row_max = torch.full((n_rows,), -math.inf, dtype=torch.float64)
    total = torch.zeros(n_rows, dtype=torch.float64)
    for start in range(0, vocab, 8192):  # running max and sum-exp over the vocabulary
        z = (hidden32 @ weight[start : start + 8192].float().t()).double()
        new_max = torch.maximum(row_max, z.amax(dim=1))
        total = total * torch.exp(row_max - new_max) + torch.exp(z - new_max[:, None]).sum(1)
        row_max = new_max
    teacher_z = torch.empty(ids.shape, dtype=torch.float64)
    for start in range(0, n_rows, 64):  # the teacher's logits exactly, in float64
        rows = slice(start, start + 64)
        teacher_z[rows] = torch.einsum("rkh,rh->rk", weight[ids[rows]].double(), hidden64[rows])
    exp_inside = torch.exp(teacher_z - row_max[:, None])
    student_q = exp_inside / total[:, None]
    q_mass = student_q.sum(1)
    q_tail = (total - exp_inside.sum(1)) / total
    p = logprobs.double().exp()
    p_mass = p.sum(1)
    p_tail = (-torch.expm1(torch.logsumexp(logprobs.double(), 1))).clamp_min(0)
    active = q_tail > 1e-6  # the default tail_mass_eps
    b = torch.where(active, p_tail / q_tail.clamp_min(1e-6), torch.zeros_like(p_tail))
    a = p_mass - b * q_mass
    inside = (b[:, None] * student_q - p) / n_rows  # [N, K], added to a q_j / N at I

    def gradient_columns(columns: slice, rows: slice) -> torch.Tensor:
        """`dL/dz` `[rows, columns]` in float64."""
        z = hidden64[rows] @ weight[columns].double().t()
        grad = (a[rows, None] / n_rows) * torch.exp(z - row_max[rows, None]) / total[rows, None]
        local = ids[rows] - columns.start
        held = (local >= 0) & (local < grad.shape[1])
        row_index = torch.arange(grad.shape[0])[:, None].expand_as(local)
        grad.index_put_((row_index[held], local[held]), inside[rows][held], accumulate=True)
        return grad

    vocab_slice = slice(0, min(vocab_rows, vocab))
    grad_weight = gradient_columns(vocab_slice, slice(0, n_rows)).t() @ hidden64
    position_slice = slice(0, min(positions, n_rows))
    grad_hidden = torch.zeros(position_slice.stop, hidden.shape[1], dtype=torch.float64)
    for start in range(0, vocab, 8192):
        columns = slice(start, min(start + 8192, vocab))
        grad_hidden += gradient_columns(columns, position_slice) @ weight[columns].double()
    return {"grad_weight": grad_weight, "grad_hidden": grad_hidden}


def _relative_errors(
    inputs: tuple[torch.Tensor, ...], reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """rms relative error (`||x - ref|| / ||ref||`) of each gradient's slice."""
    hidden, weight = inputs[0], inputs[1]
    assert hidden.grad is not None and weight.grad is not None
    errors = {}
    for name, grad in (("grad_weight", weight.grad), ("grad_hidden", hidden.grad)):
        ref = reference[name]
        errors[name] = float((grad[: ref.shape[0]].double() - ref).norm() / ref.norm())
    return errors


def measure_memory(
    variant: str,
    n_rows: int,
    vocab: int,
    top_k: int,
    chunk_size: int | None,
    hidden_size: int,
    dtype: torch.dtype,
    reference_path: str | None = None,
) -> dict[str, float]:
    """Peak extra RSS of one forward + backward of `variant`, in this (fresh) process; with
    `reference_path` (saved `float64_reference`), also the gradients' errors against it."""
    loss_fn = _loss_fn(variant, chunk_size)
    inputs = _make_inputs(variant, n_rows, vocab, top_k, hidden_size, dtype)
    if not _reset_peak():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): memory not measured")
    rss_before = _status_kib("VmRSS")
    seconds = _fwd_bwd_seconds(loss_fn, inputs)
    peak = _status_kib("VmHWM")
    result = {
        "extra_bytes": (peak - rss_before) * 1024.0,
        "logits_bytes": float(n_rows * vocab * dtype.itemsize),  # the [N, V] logits
        "first_s": seconds,
    }
    if reference_path is not None:
        result.update(_relative_errors(inputs, torch.load(reference_path)))
    return result


def estimated_peak_bytes(
    variant: str, n_rows: int, vocab: int, hidden_size: int, itemsize: int = 2
) -> float:
    """A generous estimate of one variant's peak RSS (inputs included), to skip what cannot
    fit: the extra memory of each path (docs/lm_head_loss.md, "Which path"; bf16: `itemsize`
    2) plus a margin."""
    logits = float(itemsize) * n_rows * vocab
    weight = float(itemsize) * vocab * hidden_size
    extra = {
        "logits-naive": 7.2 * logits + 2 * weight,
        "logits-chunked": 3.4 * logits + weight,
        "fused": 0.3 * logits + weight,
        "fused-recompute": 0.3 * logits + weight,
        "fused-compensated": 0.3 * logits + 2 * weight,
        "fused-float32": 0.3 * logits + 3 * weight,
    }.get(variant, 7.2 * logits)
    return extra + weight + float(itemsize) * n_rows * hidden_size + 2**30  # inputs, interpreter


def _available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024.0
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def measure_time(
    variants: list[str],
    n_rows: int,
    vocab: int,
    top_k: int,
    repeats: int,
    chunk_size: int | None,
    hidden_size: int,
    dtype: torch.dtype,
) -> dict[str, dict[str, float]]:
    """Forward + backward seconds per variant, interleaved round by round in one process.

    Interleaving spreads any outside load on the machine evenly over the variants. One
    warm-up round first; then `repeats` rounds; median and minimum per variant.
    """
    inputs = _make_inputs(variants[0], n_rows, vocab, top_k, hidden_size, dtype)
    loss_fns = {variant: _loss_fn(variant, chunk_size) for variant in variants}
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for round_index in range(repeats + 1):
        for variant, loss_fn in loss_fns.items():
            seconds = _fwd_bwd_seconds(loss_fn, inputs)
            if round_index > 0:
                times[variant].append(seconds)
    return {
        variant: {"median_s": statistics.median(values), "min_s": min(values)}
        for variant, values in times.items()
    }


def _child(env: dict[str, str], *arguments: str) -> object:
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    output = subprocess.run(
        command, check=True, capture_output=True, text=True, env=env, cwd=ROOT
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds after a warm-up (default 3; --seed-dims: 0, the time of each "
        "variant's one run in its fresh memory process)",
    )
    parser.add_argument("--chunk-size", type=int, default=None, help="chunked variants only")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=VARIANTS + EXTRA_VARIANTS + LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS,
    )
    parser.add_argument(
        "--lm-head",
        action="store_true",
        help="fused lm_head variants (hidden [N, H] and weight [V, H] in, both gradients)",
    )
    parser.add_argument("--hidden-size", type=int, default=None, help="--lm-head only")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="of the logits (--lm-head: hidden states and weight); bfloat16 needs a CPU with "
        "native bf16, else the float32 version runs (--seed-dims: nothing)",
    )
    parser.add_argument(
        "--seed-dims",
        action="store_true",
        help=f"--lm-head at the seeds' dimensions {SEED_DIMENSIONS}, N = {SEED_POSITIONS} "
        f"(what fits), variants {SEED_VARIANTS}, with --accuracy",
    )
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="--lm-head: errors of grad_weight / grad_hidden slices against float64",
    )
    parser.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-timing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seed = args.seed_dims
    defaults = {
        "positions": SEED_POSITIONS if seed else [8192, 16384],
        "vocab": SEED_DIMENSIONS["vocab"] if seed else 32768,
        "top_k": SEED_DIMENSIONS["top_k"] if seed else 64,
        "hidden_size": SEED_DIMENSIONS["hidden_size"] if seed else 1024,
        "repeats": 0 if seed else 3,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lm_head = args.lm_head or seed
    args.accuracy = args.accuracy or seed
    lm_head_names = LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS
    if args.variants is None:
        args.variants = (
            SEED_VARIANTS if seed else list(LM_HEAD_VARIANTS if args.lm_head else VARIANTS)
        )
    if len({v in lm_head_names for v in args.variants}) > 1:
        parser.error("--variants: do not mix lm_head variants with logits variants")
    n_rows = args.positions[0]
    dtype = getattr(torch, args.dtype)
    if args.child_memory is not None:
        result: object = measure_memory(
            args.child_memory,
            n_rows,
            args.vocab,
            args.top_k,
            args.chunk_size,
            args.hidden_size,
            dtype,
            args.reference,
        )
        print(json.dumps(result))
        return
    if args.child_reference is not None:
        inputs = _lm_head_inputs(n_rows, args.vocab, args.top_k, args.hidden_size, dtype)
        reference = float64_reference(inputs, ACCURACY_VOCAB_ROWS, ACCURACY_POSITIONS)
        torch.save(reference, args.child_reference)
        print(json.dumps({"saved": args.child_reference}))
        return
    if args.child_timing:
        result = measure_time(
            args.variants,
            n_rows,
            args.vocab,
            args.top_k,
            args.repeats,
            args.chunk_size,
            args.hidden_size,
            dtype,
        )
        print(json.dumps(result))
        return

    runnable = _dtype_this_cpu_runs(args)
    if runnable is None:
        return
    args.dtype = runnable
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    lm_head = args.variants[0] in lm_head_names
    accuracy = lm_head and args.accuracy
    baseline = "logits-chunked" if lm_head else "naive"
    label = _inputs_label(args)
    rounds = (
        f"{args.repeats} timed rounds after a warm-up"
        if args.repeats
        else "time of the one run in each variant's fresh process"
    )
    print(
        f"V={args.vocab}, K={args.top_k}, {label}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {rounds}; load average {_load_average()}"
    )
    print()
    header = "| N | variant | logits | peak extra | extra / logits | time median (min), s "
    header += f"| median time / {baseline} |"
    rule = "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    if accuracy:
        header += " grad_weight error | grad_hidden error |"
        rule += " ---: | ---: |"
    print(header)
    print(rule)
    pairs: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for n_positions in args.positions:
            pairs += _run_positions(args, env, n_positions, baseline, accuracy, Path(scratch))
    if pairs:
        print()
        print("| N | divergence variant | vs | peak extra ratio | median time ratio |")
        print("| ---: | --- | --- | ---: | ---: |")
        print("\n".join(pairs))
    print(f"\nload average at the end: {_load_average()}")


def _inputs_label(args: argparse.Namespace) -> str:
    """What the inputs are, e.g. ``bfloat16 hidden [N, 2560] and weight``."""
    if args.variants[0] in LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS:
        return f"{args.dtype} hidden [N, {args.hidden_size}] and weight"
    return f"{args.dtype} logits"


def _dtype_this_cpu_runs(args: argparse.Namespace) -> str | None:
    """The inputs' dtype to run here: the one asked for where this CPU can (bfloat16 needs
    native bf16); else, after saying what is skipped and why, its float32 version, or None
    (nothing runs) for `--seed-dims`, whose table is the bf16 one."""
    skip = bf16_skip_reason() if args.dtype == "bfloat16" else None
    if skip is None:
        return str(args.dtype)
    errors = ", gradient errors against float64" if args.lm_head and args.accuracy else ""
    sizes = f"V = {args.vocab}, K = {args.top_k}, N = {', '.join(map(str, args.positions))}"
    print(f"{skip}: PyTorch would emulate bf16, so the bf16 case is not run.")
    print(
        f"It would have measured: peak extra memory, forward + backward time{errors} of "
        f"{', '.join(args.variants)} on {_inputs_label(args)} ({sizes})."
    )
    if args.seed_dims:
        print(
            "Its float32 version is not run: the seeds' table is the bf16 one "
            "(`--seed-dims --dtype float32` runs it in float32)."
        )
        return None
    print("Running its float32 version instead (--dtype float32).\n")
    return "float32"


def _run_positions(
    args: argparse.Namespace,
    env: dict[str, str],
    n_positions: int,
    baseline: str,
    accuracy: bool,
    scratch: Path,
) -> list[str]:
    """The table rows of one N: memory (and errors) per variant in fresh processes, then
    the interleaved timing process (unless `--repeats 0`); returns the divergence rows."""
    common = ["--positions", str(n_positions), "--vocab", str(args.vocab)]
    common += ["--top-k", str(args.top_k), "--repeats", str(args.repeats)]
    common += ["--hidden-size", str(args.hidden_size), "--dtype", args.dtype]
    if args.chunk_size is not None:
        common += ["--chunk-size", str(args.chunk_size)]
    fits = {}
    for variant in args.variants:
        itemsize = getattr(torch, args.dtype).itemsize
        need = estimated_peak_bytes(variant, n_positions, args.vocab, args.hidden_size, itemsize)
        available = _available_bytes() - MEMORY_MARGIN_BYTES
        fits[variant] = need <= available
        if not fits[variant]:
            print(
                f"| {n_positions} | {variant} | skipped: needs about {need / 2**30:.1f} GiB, "
                f"{available / 2**30:.1f} GiB available (less a "
                f"{MEMORY_MARGIN_BYTES / 2**30:.0f} GiB margin) | | | | |",
                flush=True,
            )
    running = [variant for variant in args.variants if fits[variant]]
    reference: list[str] = []
    if accuracy and running:
        path = scratch / f"reference-{n_positions}.pt"
        _child(env, "--child-reference", str(path), *common)
        reference = ["--reference", str(path)]
    memory = {
        variant: _child(env, "--child-memory", variant, *common, *reference) for variant in running
    }
    if args.repeats > 0 and running:
        timing = _child(env, "--child-timing", "--variants", *running, *common)
    else:
        timing = {
            variant: {"median_s": mem["first_s"], "min_s": mem["first_s"]}
            for variant, mem in memory.items()
            if isinstance(mem, dict)
        }
    assert isinstance(timing, dict)
    baseline_time = timing.get(baseline, {}).get("median_s")
    for variant in running:
        mem, times = memory[variant], timing[variant]
        assert isinstance(mem, dict)
        ratio = f"{times['median_s'] / baseline_time:.2f}x" if baseline_time else "n/a"
        row = (
            f"| {n_positions} | {variant} | {mem['logits_bytes'] / 2**20:.0f} MiB "
            f"| {mem['extra_bytes'] / 2**20:.0f} MiB "
            f"| {mem['extra_bytes'] / mem['logits_bytes']:.2f}x "
            f"| {times['median_s']:.2f} ({times['min_s']:.2f}) | {ratio} |"
        )
        if accuracy:
            # The naive baseline computes the truncated loss: another gradient.
            errors = ("n/a", "n/a")
            if variant != "logits-naive":
                errors = (f"{mem['grad_weight']:.2e}", f"{mem['grad_hidden']:.2e}")
            row += f" {errors[0]} | {errors[1]} |"
        print(row, flush=True)
    return _divergence_rows(n_positions, running, memory, timing)


def _divergence_rows(
    n_positions: int, variants: list[str], memory: dict[str, object], timing: dict[str, object]
) -> list[str]:
    """Each divergence variant against its path's forward tail loss, measured in this run."""
    rows = []
    for variant in variants:
        if variant not in DIVERGENCE_VARIANTS:
            continue
        reference = DIVERGENCE_VARIANTS[variant][1]
        if reference not in variants:
            continue
        mem, ref_mem = memory[variant], memory[reference]
        times, ref_times = timing[variant], timing[reference]
        assert isinstance(mem, dict) and isinstance(ref_mem, dict)
        assert isinstance(times, dict) and isinstance(ref_times, dict)
        rows.append(
            f"| {n_positions} | {variant} | {reference} "
            f"| {mem['extra_bytes'] / ref_mem['extra_bytes']:.3f}x "
            f"| {times['median_s'] / ref_times['median_s']:.3f}x |"
        )
    return rows


if __name__ == "__main__":
    main()
