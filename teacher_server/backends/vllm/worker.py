"""What the teacher changes inside vLLM's workers: the temperature and the CPU top-k.

:class:`TeacherWorkerExtension` is mixed into vLLM's worker class through the engine
argument ``worker_extension_cls``, so the backend can call its methods by name with
``collective_rpc`` (a method name needs no pickled function shipped to the workers).

**Temperature.** vLLM computes every log-prob it returns, prompt rows and sampled rows
alike, as ``log_softmax`` of the logits that the model's ``LogitsProcessor`` layer hands
out, and that layer multiplies its logits by its ``scale`` attribute (1 for most models).
Setting ``scale`` to ``base_scale / T`` on every worker makes every served log-prob
exactly ``log_softmax(z / T)`` of the model's logits ``z``, on vLLM's normal fast path.
The engine must return raw log-probs (``logprobs_mode="raw_logprobs"``) and the request
must not add a sampling temperature of its own (the backend samples greedily).

**Engine top-k** (written for vLLM 0.32's V1 model runner, which its CPU build uses). The
worker's ``Sampler.gather_logprobs(logprobs [N, V], K, token_ids [N])`` picks each row's
top-K and the actual token's log-prob and rank, for prompt rows and sampled rows; it is a
``torch.topk`` that costs over half of this CPU's forward pass of the tiny test model
(``benchmarks/profile_engine.py``).
:func:`route_gather_logprobs` replaces it, on one ``Sampler`` instance, by
:func:`teacher_server.backends.cpu_topk.topk_with_target` wherever that serves the input
(CPU float32 rows, K <= V / 4, finite values) and by vLLM's own otherwise. The values are
copied from vLLM's log-probs, so they are bit-identical; only the order of exactly equal
log-probs can differ (lower id first). It is installed only after a self-check against
vLLM's own function on the installed vLLM. Which one is faster depends on the vocabulary,
K and the CPU (the kernel's counting passes win on small vocabularies, ``torch.topk``'s
partial sort can win at V = 151,936): :func:`time_gather` times both on the worker, at the
served vocabulary and K, for ``--engine-topk auto`` to pick by
(:mod:`teacher_server.backends.vllm.topk_choice`).

**Candidates.** :meth:`TeacherWorkerExtension.topk_distill_candidates` makes the worker
append each request's candidate log-probs to its log-prob rows, gathered from the same
``[N, V]`` log-probs as the top-k (:mod:`teacher_server.backends.vllm.candidates`).

**Memory.** :meth:`TeacherWorkerExtension.topk_distill_malloc_trim` hands the freed heap
memory of the worker's process back to the OS (:mod:`teacher_server.malloc_trim`) and the
pages of vLLM's shared-memory message queues that hold no unread message
(:mod:`teacher_server.backends.vllm.message_queue_pages`); the server calls it once it
has been quiet for ``--memory-trim-idle-s``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CANDIDATES_METHOD",
    "ENGINE_TOPK_CHOICES",
    "ENGINE_TOPK_METHOD",
    "EXTENSION_QUALNAME",
    "KERNEL",
    "MALLOC_TRIM_METHOD",
    "SET_TEMPERATURE_METHOD",
    "TIME_TOPK_METHOD",
    "VLLM_TOPK",
    "TeacherWorkerExtension",
    "route_gather_logprobs",
    "time_gather",
    "timing_rows",
]

#: The engine top-k in use: this project's CPU kernel, or vLLM's own ``torch.topk``.
KERNEL, VLLM_TOPK = "kernel", "vllm"
#: ``--engine-topk`` choices: ``auto`` (the faster of the two where the kernel checks out,
#: else vLLM's: :mod:`teacher_server.backends.vllm.topk_choice`),
#: ``kernel`` (required: fail at start-up without it), ``vllm`` (vLLM's own).
ENGINE_TOPK_CHOICES = ("auto", KERNEL, VLLM_TOPK)

# The scale a LogitsProcessor was built with, kept on it so that setting T twice is safe.
_BASE_SCALE_ATTR = "_topk_distill_base_scale"
# Marks the replacement gather_logprobs (and keeps vLLM's own on it).
_STOCK_ATTR = "topk_distill_stock"


def route_gather_logprobs(sampler: Any, use_kernel: bool) -> str:
    """Make ``sampler.gather_logprobs`` (one vLLM ``Sampler``) the CPU kernel
    (``use_kernel``) or vLLM's own again. Returns :data:`KERNEL` or :data:`VLLM_TOPK`, the
    one in use, or ``"unavailable: <why>"`` (vLLM's stays in use)."""
    current = getattr(sampler, "gather_logprobs", None)
    if not callable(current):
        return "unavailable: the model runner's sampler has no gather_logprobs"
    stock = getattr(current, _STOCK_ATTR, current)
    if not use_kernel:
        if stock is not current:
            sampler.gather_logprobs = stock
        return VLLM_TOPK
    if stock is not current:
        return KERNEL
    try:
        replacement = _kernel_gather(stock)
        problem = _self_check(stock, replacement)
    except Exception as exc:  # any drift in vLLM's classes or a numba failure shows here
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        return f"unavailable: {problem}"
    sampler.gather_logprobs = replacement
    return KERNEL


def _kernel_gather(stock: Any) -> Any:
    """``gather_logprobs`` with vLLM's signature: the kernel where it serves, else ``stock``."""
    from vllm.v1.outputs import LogprobsTensors

    from teacher_server.backends import cpu_topk

    def gather_logprobs(logprobs: Any, num_logprobs: int, token_ids: Any) -> Any:
        if cpu_topk.supported(logprobs, num_logprobs):
            got = cpu_topk.topk_with_target(logprobs, num_logprobs, token_ids)
            if got is not None:
                ids, values, ranks = got
                return LogprobsTensors(ids, values, ranks)
        return stock(logprobs, num_logprobs, token_ids)

    setattr(gather_logprobs, _STOCK_ATTR, stock)
    return gather_logprobs


def _self_check(stock: Any, replacement: Any) -> str | None:
    """Both functions on one odd-shaped batch of distinct log-probs (this also compiles the
    kernel): every field must be equal. Returns what differs, or None."""
    import torch

    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(37, 123, generator=gen) * 3, -1)
    token_ids = torch.randint(0, 123, (37,), generator=gen)
    want = stock(logprobs, 7, token_ids)
    got = replacement(logprobs, 7, token_ids)
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        a, b = getattr(got, field), getattr(want, field)
        if a.dtype != b.dtype or not torch.equal(a, b):
            return f"the kernel's {field} differ from vLLM's gather_logprobs"
    return None


#: Elements (rows x V) of the timed batch: about 128 MiB of float32 log-probs, so a big
#: vocabulary is timed on rows that, like an engine step's, do not fit in the CPU's caches.
TIMING_ELEMENTS = 1 << 25
#: Rows of the timed batch: between these bounds (an engine step has up to thousands).
TIMING_ROWS = (64, 2048)
#: Timed calls of each function (after one warm-up call each), alternated; best kept.
TIMING_REPS = 5


def timing_rows(vocab: int) -> int:
    """Rows of the batch :func:`time_gather` times at vocabulary ``vocab``."""
    lo, hi = TIMING_ROWS
    return max(lo, min(hi, TIMING_ELEMENTS // max(1, vocab)))


def time_gather(
    stock: Any, kernel: Any, vocab: int, k: int, reps: int = TIMING_REPS
) -> tuple[float, float]:
    """Seconds per row of ``stock`` (vLLM's ``gather_logprobs``) and ``kernel`` (its
    replacement) on one batch of teacher-like rows ``[timing_rows(vocab), vocab]``
    (``log_softmax`` of scaled normal logits) at ``K = k``: best of ``reps`` calls each,
    alternated, in the calling thread's torch settings (a worker's: its own cores)."""
    import time

    import torch

    rows = timing_rows(vocab)
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    token_ids = torch.randint(0, vocab, (rows,), generator=gen)
    best = [float("inf"), float("inf")]
    for rep in range(reps + 1):  # the first round warms up
        for i, fn in enumerate((stock, kernel)):
            t0 = time.perf_counter()
            fn(logprobs, k, token_ids)
            if rep:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] / rows, best[1] / rows


class TeacherWorkerExtension:
    """Worker mix-in: the teacher temperature and the engine top-k of this worker."""

    def topk_distill_set_temperature(self, temperature: float) -> list[float]:
        """Scale every ``LogitsProcessor`` of this worker's model by ``1 / temperature``
        (relative to the scale the model was built with, so a model with a logit scale of
        its own keeps it) and return the new scales, one per layer found."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        worker: Any = self
        scales = []
        for module in worker.get_model().modules():
            if isinstance(module, LogitsProcessor):
                base = getattr(module, _BASE_SCALE_ATTR, None)
                if base is None:
                    base = float(module.scale)
                    setattr(module, _BASE_SCALE_ATTR, base)
                module.scale = base / temperature
                scales.append(float(module.scale))
        return scales

    def topk_distill_engine_topk(self, use_kernel: bool) -> str:
        """Route this worker's log-prob top-k (:func:`route_gather_logprobs`); the kernel
        only on a CPU worker."""
        worker: Any = self
        device = getattr(worker, "device", None)
        if use_kernel and getattr(device, "type", None) != "cpu":
            return f"unavailable: the worker runs on {device}, not a CPU"
        runner = getattr(worker, "model_runner", None)
        return route_gather_logprobs(getattr(runner, "sampler", None), use_kernel)

    def topk_distill_time_engine_topk(self, k: int) -> list[float]:
        """``[vLLM's, kernel's]`` seconds per row of this worker's log-prob top-k at the
        model's vocabulary and ``K = k`` (:func:`time_gather`); ``[]`` where the kernel is
        not installed (route it first)."""
        worker: Any = self
        runner = getattr(worker, "model_runner", None)
        current = getattr(getattr(runner, "sampler", None), "gather_logprobs", None)
        stock = getattr(current, _STOCK_ATTR, None)
        if stock is None or runner is None:
            return []
        vocab = int(runner.model_config.get_vocab_size())
        return list(time_gather(stock, current, vocab, k))

    def topk_distill_candidates(self) -> str:
        """Let this worker gather candidate log-probs with the top-k
        (:func:`teacher_server.backends.vllm.candidates.install`); ``"ok"`` or
        ``"unavailable: <why>"``."""
        from teacher_server.backends.vllm.candidates import install

        worker: Any = self
        return install(getattr(worker, "model_runner", None))

    def topk_distill_malloc_trim(self) -> int:
        """Give memory back: the pages of vLLM's shared-memory message queues that hold
        no unread message (:mod:`teacher_server.backends.vllm.message_queue_pages`),
        then ``malloc_trim(0)`` in this worker's process; returns the bytes given back."""
        from teacher_server.backends.vllm.message_queue_pages import (
            release_message_queue_pages,
        )
        from teacher_server.malloc_trim import malloc_trim

        return release_message_queue_pages() + malloc_trim()


#: Method names called on every worker with ``collective_rpc``.
SET_TEMPERATURE_METHOD = TeacherWorkerExtension.topk_distill_set_temperature.__name__
ENGINE_TOPK_METHOD = TeacherWorkerExtension.topk_distill_engine_topk.__name__
TIME_TOPK_METHOD = TeacherWorkerExtension.topk_distill_time_engine_topk.__name__
MALLOC_TRIM_METHOD = TeacherWorkerExtension.topk_distill_malloc_trim.__name__
CANDIDATES_METHOD = TeacherWorkerExtension.topk_distill_candidates.__name__
#: Value of vLLM's ``worker_extension_cls`` engine argument.
EXTENSION_QUALNAME = f"{__name__}.{TeacherWorkerExtension.__qualname__}"
