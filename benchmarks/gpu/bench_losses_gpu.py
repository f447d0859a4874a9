"""The losses on a GPU at a 4B student's dimensions, against a dense baseline and the matmul floor.

Run on a machine with a CUDA GPU, from the repository root (`benchmarks/gpu/run.sh` runs it
after the GPU checks)::

    PYTHONPATH=. python3 -m benchmarks.gpu.bench_losses_gpu --out benchmarks/gpu/out

Dimensions: V = 248,320, H = 2560, K = 128 (the seeds' table: verl's Megatron top-k KL for a
Qwen3.5-4B student), N = 4096, 8192, 16384, everything bf16, forward + backward.

Two sections:

- logits (`[N, V]` bf16 logits that require grad): `naive-*` is the dense autograd loss as
  it is written by hand (`log_softmax(logits.float())`, gather; verl's default path for
  "truncated"), `chunked-*` is `topk_kl_loss`;
- lm_head (`[N, H]` hidden states and the `[V, H]` weight, both require grad): `logits-*`
  forms `hidden @ weight.T` and runs the naive loss or `topk_kl_loss` on it; `fused-*` is
  `lm_head_topk_kl_loss`, which never forms the logits.

Each in three losses: `tail` (forward KL, K+1 categories), `truncated` (forward KL on the
top-k alone) and `reverse-union` (reverse KL on the union of the teacher's top-k and 64
student candidates). All with `validate=False` (the call never waits for the device), plus
`fused-tail-validate` (the default `validate=True`).

Peak memory: `torch.cuda.max_memory_allocated()` minus the memory allocated before the call
(inputs), reset per variant: everything the loss allocates at its peak, the gradients it
returns included. Time: CUDA events around forward + backward, 2 warm-up calls, the median
of `--repeats` (default 7). The matmul floor: the three `[N, H] x [H, V]`-sized bf16
products a loss with the lm_head needs (logits, `grad_hidden = G @ W`, `grad_weight =
G.T @ h`), timed the same way.

`--sweep` adds the fused and chunked tail losses at the largest N with larger fp32
sub-blocks (`sizing.FUSED_WORK_BYTES`) / row chunks, and `--profile` writes the
`torch.profiler` table of one fused and one chunked call at the largest N. Writes
`results.json` and `results.md` to `--out` after every variant (a cut-off run keeps what it
measured).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_losses import SEED_DIMENSIONS, _naive, _teacher
from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    sizing,
    topk_kl_loss,
)

POSITIONS = (4096, 8192, 16384)
CANDIDATES = 64
OVERLAP = 8  # candidates that repeat one of the teacher's top-k ids
TAIL_EPS = 1e-6  # LossOptions' default tail_mass_eps
LOSSES = ("tail", "truncated", "reverse-union")
LOGITS_VARIANTS = tuple(f"{path}-{loss}" for path in ("naive", "chunked") for loss in LOSSES)
LM_HEAD_VARIANTS = (
    "logits-naive-tail",
    "logits-chunked-tail",
    *(f"fused-{loss}" for loss in LOSSES),
    "fused-tail-validate",
)
GIB = 2**30

Inputs = dict[str, torch.Tensor]


# ------------------------------------------------------------------ the dense baselines


def naive_tail(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Forward KL with the tail category, densely (autograd keeps the fp32 `[N, V]`)."""
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, ids)
    p = logprobs.exp()
    head = (p * (logprobs - log_q)).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    q_tail = (1 - log_q.exp().sum(-1)).clamp_min(TAIL_EPS)
    return (head + torch.xlogy(p_tail, p_tail) - p_tail * q_tail.log()).mean()


def union_present(ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """`[N, K + C]` bool: the union's columns that are categories (a candidate that pads,
    repeats a top-k id or an earlier candidate is not)."""
    in_top = (candidate_ids.unsqueeze(-1) == ids.unsqueeze(-2)).any(-1)
    earlier = torch.ones(candidate_ids.shape[-1], candidate_ids.shape[-1], dtype=torch.bool)
    earlier = earlier.tril(-1).to(ids.device)
    repeat = ((candidate_ids.unsqueeze(-1) == candidate_ids.unsqueeze(-2)) & earlier).any(-1)
    keep = (candidate_ids >= 0) & ~in_top & ~repeat
    return torch.cat([torch.ones_like(ids, dtype=torch.bool), keep], dim=-1)


def naive_reverse_union(
    logits: torch.Tensor,
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    candidate_ids: torch.Tensor,
    candidate_logprobs: torch.Tensor,
) -> torch.Tensor:
    """Reverse KL `KL(q̂ || p̂)` on the union support plus the tail, densely."""
    union = torch.cat([ids, candidate_ids.clamp_min(0)], dim=-1)
    present = union_present(ids, candidate_ids)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, union)
    log_p = torch.cat([logprobs, candidate_logprobs.nan_to_num(-1e4)], dim=-1)
    q = torch.where(present, log_q.exp(), 0.0)
    p = torch.where(present, log_p.exp(), 0.0)
    named = torch.where(present, q * (log_q - log_p.clamp_min(math.log(1e-30))), 0.0).sum(-1)
    q_tail = (1 - q.sum(-1)).clamp_min(0)
    p_tail = (1 - p.sum(-1)).clamp_min(TAIL_EPS)
    tail = torch.xlogy(q_tail, q_tail.clamp_min(TAIL_EPS)) - q_tail * p_tail.log()
    return (named + tail).mean()


# ------------------------------------------------------------------ inputs and variants


def make_teacher(n_rows: int, vocab: int, top_k: int, device: torch.device) -> Inputs:
    """Teacher ids / log-probs `[N, K]` (bench_losses' construction) and `[N, C]`
    candidates: `OVERLAP` repeat top-k ids, the rest random (a few pad with -1)."""
    generator = torch.Generator().manual_seed(0)
    ids, teacher = _teacher(n_rows, vocab, top_k, generator)
    logprobs = (teacher - 0.3).float()
    candidates = torch.randint(0, vocab, (n_rows, CANDIDATES), generator=generator)
    candidates[:, :OVERLAP] = ids[:, :OVERLAP]
    candidates[::7, -3:] = -1
    small = torch.log(torch.rand(n_rows, CANDIDATES, generator=generator) * 1e-4 + 1e-12)
    candidate_logprobs = torch.where(candidates >= 0, small, math.nan)
    candidate_logprobs[:, :OVERLAP] = logprobs[:, :OVERLAP]
    tensors = {
        "ids": ids,
        "logprobs": logprobs,
        "candidate_ids": candidates,
        "candidate_logprobs": candidate_logprobs,
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def _targets(teacher: Inputs, union: bool) -> TeacherTargets:
    if not union:
        return TeacherTargets(teacher["ids"], teacher["logprobs"])
    return TeacherTargets(
        teacher["ids"],
        teacher["logprobs"],
        candidate_ids=teacher["candidate_ids"],
        candidate_logprobs=teacher["candidate_logprobs"],
    )


def _options(loss: str, validate: bool = False) -> LossOptions:
    if loss == "reverse-union":
        return LossOptions(divergence="reverse", support="union", validate=validate)
    return LossOptions(mode="truncated" if loss == "truncated" else "tail", validate=validate)


def _naive_loss(loss: str, logits: torch.Tensor, teacher: Inputs) -> torch.Tensor:
    if loss == "tail":
        return naive_tail(logits, teacher["ids"], teacher["logprobs"])
    if loss == "truncated":
        return _naive(logits, teacher["ids"], teacher["logprobs"])
    return naive_reverse_union(
        logits,
        teacher["ids"],
        teacher["logprobs"],
        teacher["candidate_ids"],
        teacher["candidate_logprobs"],
    )


def loss_call(variant: str, teacher: Inputs) -> Callable[..., torch.Tensor]:
    """`variant`'s forward: `(logits) -> loss` (logits section) or `(hidden, weight) ->
    loss` (lm_head section)."""
    parts = variant.split("-")
    validate = parts[-1] == "validate"
    loss = "-".join(parts[1:-1] if validate else parts[1:])
    if parts[0] == "logits":  # lm_head section, logits formed: naive / chunked on them
        inner = loss_call("-".join(parts[1:]), teacher)
        return lambda hidden, weight: inner(hidden @ weight.t())
    if parts[0] == "naive":
        return lambda logits: _naive_loss(loss, logits, teacher)
    targets, options = _targets(teacher, loss == "reverse-union"), _options(loss, validate)
    if parts[0] == "chunked":
        return lambda logits: topk_kl_loss(logits, targets, options)[0]
    return lambda hidden, weight: lm_head_topk_kl_loss(weight, hidden, targets, options)[0]


# ------------------------------------------------------------------ measuring


def _fwd_bwd(call: Callable[..., torch.Tensor], leaves: list[torch.Tensor]) -> None:
    for leaf in leaves:
        leaf.grad = None
    call(*leaves).backward()


def peak_extra_bytes(call: Callable[..., torch.Tensor], leaves: list[torch.Tensor]) -> int:
    """Peak allocated bytes of one forward + backward beyond what was allocated before."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call(*leaves).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def median_ms(run: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median of `repeats` CUDA-event timings of `run()` after `warmup` calls."""
    for _ in range(warmup):
        run()
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def matmul_floor(n_rows: int, vocab: int, hidden_size: int, repeats: int) -> dict[str, float]:
    """Median ms of the three bf16 products of a loss with the lm_head."""
    device = torch.device("cuda")
    hidden = torch.randn(n_rows, hidden_size, device=device, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16)
    grad = torch.randn(n_rows, vocab, device=device, dtype=torch.bfloat16)
    times = {
        "logits_ms": median_ms(lambda: hidden @ weight.t(), repeats),
        "grad_hidden_ms": median_ms(lambda: grad @ weight, repeats),
        "grad_weight_ms": median_ms(lambda: grad.t() @ hidden, repeats),
    }
    times["floor_ms"] = sum(times.values())
    flops = 3 * 2.0 * n_rows * vocab * hidden_size
    times["floor_tflops"] = flops / (times["floor_ms"] * 1e-3) / 1e12
    return times


def measure(
    variant: str, call: Callable[..., torch.Tensor], leaves: list[torch.Tensor], repeats: int
) -> dict[str, Any]:
    try:
        median_ms(lambda: _fwd_bwd(call, leaves), 0, warmup=1)  # also: does it fit?
        peak = peak_extra_bytes(call, leaves)
        ms = median_ms(lambda: _fwd_bwd(call, leaves), repeats)
    except Exception as error:  # out of memory or a failure: recorded, the run goes on
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.empty_cache()
        return {"variant": variant, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {"variant": variant, "peak_gib": peak / GIB, "ms": ms}


# ------------------------------------------------------------------ the run


def logits_section(n_rows: int, teacher: Inputs, repeats: int, report: Callable) -> None:
    vocab = SEED_DIMENSIONS["vocab"]
    logits = (torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    for variant in LOGITS_VARIANTS:
        report(n_rows, "logits", measure(variant, loss_call(variant, teacher), [logits], repeats))
    del logits


def lm_head_inputs(n_rows: int) -> list[torch.Tensor]:
    vocab, hidden_size = SEED_DIMENSIONS["vocab"], SEED_DIMENSIONS["hidden_size"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, device="cuda", generator=generator)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=generator)
    weight *= 2.0 / hidden_size**0.5
    return [t.bfloat16().requires_grad_() for t in (hidden, weight)]


def lm_head_section(n_rows: int, teacher: Inputs, repeats: int, report: Callable) -> None:
    leaves = lm_head_inputs(n_rows)
    for variant in LM_HEAD_VARIANTS:
        report(n_rows, "lm_head", measure(variant, loss_call(variant, teacher), leaves, repeats))


def sweep(n_rows: int, teacher: Inputs, repeats: int, report: Callable) -> None:
    """The tail losses with larger fp32 sub-blocks (fused) / row chunks (chunked)."""
    leaves = lm_head_inputs(n_rows)
    call = loss_call("fused-tail", teacher)
    default = sizing.FUSED_WORK_BYTES["other"]
    for work_mib in (64, 256, 1024):
        sizing.FUSED_WORK_BYTES["other"] = work_mib * 2**20
        result = measure(f"fused-tail work {work_mib} MiB", call, leaves, repeats)
        report(n_rows, "sweep", result)
    sizing.FUSED_WORK_BYTES["other"] = default
    del leaves
    vocab = SEED_DIMENSIONS["vocab"]
    logits = (torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    targets = _targets(teacher, False)
    for rows in (None, 256, 1024):
        options = LossOptions(validate=False, chunk_size=rows)
        result = measure(
            f"chunked-tail chunk {rows or 'default'} rows",
            lambda z, o=options: topk_kl_loss(z, targets, o)[0],
            [logits],
            repeats,
        )
        report(n_rows, "sweep", result)


def profile(n_rows: int, teacher: Inputs, out: Path) -> None:
    """`torch.profiler` tables of one fused and one chunked tail call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    vocab = SEED_DIMENSIONS["vocab"]
    cases: list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]] = [
        ("fused", loss_call("fused-tail", teacher), lm_head_inputs(n_rows)),
        (
            "chunked",
            loss_call("chunked-tail", teacher),
            [torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()],
        ),
    ]
    for name, call, leaves in cases:
        _fwd_bwd(call, leaves)
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with torch_profile(activities=activities) as prof:
            _fwd_bwd(call, leaves)
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(
            e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunch"))
        )
        table = events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        text = f"{name}-tail at N = {n_rows}: {launches} kernel launches\n{table}\n"
        (out / f"profile_{name}.txt").write_text(text)
        print(text[:6000])


def markdown(results: dict[str, Any]) -> str:
    lines = [f"GPU: {results['gpu']}, torch {results['torch']}, CUDA {results['cuda']}", ""]
    for n_rows, entry in sorted(results["by_positions"].items(), key=lambda kv: int(kv[0])):
        floor = entry.get("floor", {})
        lines += [
            f"### N = {n_rows}: logits {entry['logits_gib']:.2f} GiB, grad_weight "
            f"{results['grad_weight_gib']:.2f} GiB, matmul floor "
            f"{floor.get('floor_ms', math.nan):.1f} ms "
            f"({floor.get('floor_tflops', math.nan):.0f} TFLOP/s)",
            "",
            "| section | variant | peak extra (GiB) | peak / logits | fwd+bwd (ms) | / floor |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in entry["rows"]:
            if "error" in row:
                lines.append(f"| {row['section']} | {row['variant']} | {row['error']} | | | |")
                continue
            lines.append(
                f"| {row['section']} | {row['variant']} | {row['peak_gib']:.2f} | "
                f"{row['peak_gib'] / entry['logits_gib']:.2f} | {row['ms']:.1f} | "
                f"{row['ms'] / floor.get('floor_ms', math.nan):.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=list(POSITIONS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu/out"))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_losses_gpu: no CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    vocab, hidden_size, top_k = (SEED_DIMENSIONS[k] for k in ("vocab", "hidden_size", "top_k"))
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dimensions": {**SEED_DIMENSIONS, "candidates": CANDIDATES},
        "repeats": args.repeats,
        "grad_weight_gib": vocab * hidden_size * 2 / GIB,
        "by_positions": {},
    }

    def report(n_rows: int, section: str, row: dict[str, Any]) -> None:
        entry = results["by_positions"][str(n_rows)]
        entry["rows"].append({"section": section, **row})
        print(json.dumps({"N": n_rows, "section": section, **row}), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(markdown(results))

    for n_rows in args.positions:
        results["by_positions"][str(n_rows)] = {
            "logits_gib": n_rows * vocab * 2 / GIB,
            "floor": matmul_floor(n_rows, vocab, hidden_size, args.repeats),
            "rows": [],
        }
        print(json.dumps({"N": n_rows, **results["by_positions"][str(n_rows)]["floor"]}))
        teacher = make_teacher(n_rows, vocab, top_k, torch.device("cuda"))
        lm_head_section(n_rows, teacher, args.repeats, report)
        logits_section(n_rows, teacher, args.repeats, report)
        torch.cuda.empty_cache()
    largest = max(args.positions)
    teacher = make_teacher(largest, vocab, top_k, torch.device("cuda"))
    steps: dict[str, Callable[[], None]] = {
        "sweep": lambda: sweep(largest, teacher, args.repeats, report),
        "profile": lambda: profile(largest, teacher, args.out),
    }
    for name, step in steps.items():
        if getattr(args, f"no_{name}"):
            continue
        try:  # everything measured so far is written already
            step()
        except Exception as error:
            print(f"{name} failed: {type(error).__name__}: {error}")
    print(markdown(results))


if __name__ == "__main__":
    main()
