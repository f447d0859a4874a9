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
- `fused`: `fused_topk_kl_loss(hidden, weight, ...)` (tail), gradients computed in forward.
- `fused-recompute`: the same with `grad_in_forward=False` (chunk logits recomputed in
  backward: four matmuls instead of three).
- `fused-reverse`, `fused-jsd` (only with `--variants`): `fused` with the reverse KL / the
  JSD; compare with `fused` in the same run.

When a divergence variant runs next to the forward tail loss of its path, a last table gives
their peak-memory and median-time ratios.

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
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("chunked-tail", "chunked-truncated", "naive", "rowchunk-autograd")
EXTRA_VARIANTS = ("chunked-tail-overlap", "chunked-reverse", "chunked-jsd")  # via --variants
LM_HEAD_VARIANTS = ("logits-chunked", "fused", "fused-recompute")
LM_HEAD_EXTRA_VARIANTS = ("fused-reverse", "fused-jsd")  # only when named in --variants
#: divergence variant -> (its divergence, the forward tail variant of the same path)
DIVERGENCE_VARIANTS = {
    "chunked-reverse": ("reverse", "chunked-tail"),
    "chunked-jsd": ("jsd", "chunked-tail"),
    "fused-reverse": ("reverse", "fused"),
    "fused-jsd": ("jsd", "fused"),
}
ROWCHUNK_ROWS = 4096  # verl's documented chunked_topk_chunk_size


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


def _inputs(n_rows: int, vocab: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 logits `[N, V]` (requires grad), teacher ids and log-probs `[N, K]`.

    Ids of a row are `(a + b * j) mod V`, `j < K`, with random `a` and a random odd `b`:
    distinct for a power-of-two `V`, scattered over the vocabulary, and cheap to build.
    """
    generator = torch.Generator().manual_seed(0)
    logits = torch.empty(n_rows, vocab, dtype=torch.bfloat16)
    for start in range(0, n_rows, 64):  # fill in place: no [N, V] transient
        block = torch.randn(min(64, n_rows - start), vocab, generator=generator) * 2
        logits[start : start + block.shape[0]] = block
    offset = torch.randint(0, vocab, (n_rows, 1), generator=generator)
    stride = 2 * torch.randint(0, vocab // 2, (n_rows, 1), generator=generator) + 1
    ids = (offset + stride * torch.arange(top_k)) % vocab
    teacher = torch.log_softmax(torch.randn(n_rows, top_k, generator=generator) * 2, -1)
    return logits.requires_grad_(True), ids, teacher - 0.3


def _lm_head_inputs(
    n_rows: int, vocab: int, top_k: int, hidden_size: int
) -> tuple[torch.Tensor, ...]:
    """bf16 hidden `[N, H]` and weight `[V, H]` (both require grad), teacher ids, log-probs."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, generator=generator).to(torch.bfloat16)
    weight = torch.empty(vocab, hidden_size, dtype=torch.bfloat16)
    for start in range(0, vocab, 1024):  # fill in place: no fp32 [V, H] transient
        block = torch.randn(min(1024, vocab - start), hidden_size, generator=generator)
        weight[start : start + block.shape[0]] = block * (2.0 / hidden_size**0.5)
    offset = torch.randint(0, vocab, (n_rows, 1), generator=generator)
    stride = 2 * torch.randint(0, vocab // 2, (n_rows, 1), generator=generator) + 1
    ids = (offset + stride * torch.arange(top_k)) % vocab
    teacher = torch.log_softmax(torch.randn(n_rows, top_k, generator=generator) * 2, -1)
    return hidden.requires_grad_(True), weight.requires_grad_(True), ids, teacher - 0.3


def _lm_head_loss_fn(variant: str, chunk_size: int | None) -> Callable[..., torch.Tensor]:
    from student_client.losses import fused_topk_kl_loss, topk_kl_loss

    def logits_path(
        hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
    ) -> torch.Tensor:
        loss, _ = topk_kl_loss(hidden @ weight.t(), ids, logprobs, chunk_size=chunk_size)
        return loss

    divergence = DIVERGENCE_VARIANTS.get(variant, ("forward", ""))[0]

    def fused(
        hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
    ) -> torch.Tensor:
        loss, _ = fused_topk_kl_loss(
            hidden,
            weight,
            ids,
            logprobs,
            chunk_size=chunk_size,
            grad_in_forward=variant != "fused-recompute",
            divergence=divergence,
        )
        return loss

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
    from student_client.losses import LossMode, topk_kl_loss

    mode: LossMode = "truncated" if variant == "chunked-truncated" else "tail"
    overlap = variant == "chunked-tail-overlap"
    divergence = DIVERGENCE_VARIANTS.get(variant, ("forward", ""))[0]

    def chunked(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        loss, _ = topk_kl_loss(
            logits,
            ids,
            logprobs,
            mode=mode,
            chunk_size=chunk_size,
            overlap=overlap,
            divergence=divergence,
        )
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
    variant: str, n_rows: int, vocab: int, top_k: int, hidden_size: int
) -> tuple[torch.Tensor, ...]:
    if variant in LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS:
        return _lm_head_inputs(n_rows, vocab, top_k, hidden_size)
    return _inputs(n_rows, vocab, top_k)


def measure_memory(
    variant: str, n_rows: int, vocab: int, top_k: int, chunk_size: int | None, hidden_size: int
) -> dict[str, float]:
    """Peak extra RSS of one forward + backward of `variant`, in this (fresh) process."""
    loss_fn = _loss_fn(variant, chunk_size)
    inputs = _make_inputs(variant, n_rows, vocab, top_k, hidden_size)
    if not _reset_peak():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): memory not measured")
    rss_before = _status_kib("VmRSS")
    seconds = _fwd_bwd_seconds(loss_fn, inputs)
    peak = _status_kib("VmHWM")
    return {
        "extra_bytes": (peak - rss_before) * 1024.0,
        "logits_bytes": float(n_rows * vocab * 2),  # the [N, V] bf16 logits
        "first_s": seconds,
    }


def measure_time(
    variants: list[str],
    n_rows: int,
    vocab: int,
    top_k: int,
    repeats: int,
    chunk_size: int | None,
    hidden_size: int,
) -> dict[str, dict[str, float]]:
    """Forward + backward seconds per variant, interleaved round by round in one process.

    Interleaving spreads any outside load on the machine evenly over the variants. One
    warm-up round first; then `repeats` rounds; median and minimum per variant.
    """
    inputs = _make_inputs(variants[0], n_rows, vocab, top_k, hidden_size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
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
    parser.add_argument("--hidden-size", type=int, default=1024, help="--lm-head only")
    parser.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-timing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variants is None:
        args.variants = list(LM_HEAD_VARIANTS if args.lm_head else VARIANTS)
    lm_head_names = LM_HEAD_VARIANTS + LM_HEAD_EXTRA_VARIANTS
    if len({v in lm_head_names for v in args.variants}) > 1:
        parser.error("--variants: do not mix lm_head variants with logits variants")
    n_rows = args.positions[0]
    if args.child_memory is not None:
        result: object = measure_memory(
            args.child_memory, n_rows, args.vocab, args.top_k, args.chunk_size, args.hidden_size
        )
        print(json.dumps(result))
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
        )
        print(json.dumps(result))
        return

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    lm_head = args.variants[0] in lm_head_names
    baseline = "logits-chunked" if lm_head else "naive"
    inputs = f"bf16 hidden [N, {args.hidden_size}] and weight" if lm_head else "bf16 logits"
    print(
        f"V={args.vocab}, K={args.top_k}, {inputs}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} timed rounds"
    )
    print()
    print(
        "| N | variant | logits | peak extra | extra / logits | time median (min), s "
        f"| median time / {baseline} |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    pairs: list[str] = []
    for n_positions in args.positions:
        common = ["--positions", str(n_positions), "--vocab", str(args.vocab)]
        common += ["--top-k", str(args.top_k), "--repeats", str(args.repeats)]
        common += ["--hidden-size", str(args.hidden_size)]
        if args.chunk_size is not None:
            common += ["--chunk-size", str(args.chunk_size)]
        memory = {
            variant: _child(env, "--child-memory", variant, *common) for variant in args.variants
        }
        timing = _child(env, "--child-timing", "--variants", *args.variants, *common)
        assert isinstance(timing, dict)
        naive_time = timing.get(baseline, {}).get("median_s")
        for variant in args.variants:
            mem, times = memory[variant], timing[variant]
            assert isinstance(mem, dict)
            ratio = f"{times['median_s'] / naive_time:.2f}x" if naive_time else "n/a"
            print(
                f"| {n_positions} | {variant} | {mem['logits_bytes'] / 2**20:.0f} MiB "
                f"| {mem['extra_bytes'] / 2**20:.0f} MiB "
                f"| {mem['extra_bytes'] / mem['logits_bytes']:.2f}x "
                f"| {times['median_s']:.2f} ({times['min_s']:.2f}) | {ratio} |",
                flush=True,
            )
        pairs += _divergence_rows(n_positions, args.variants, memory, timing)
    if pairs:
        print()
        print("| N | divergence variant | vs | peak extra ratio | median time ratio |")
        print("| ---: | --- | --- | ---: | ---: |")
        print("\n".join(pairs))


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
