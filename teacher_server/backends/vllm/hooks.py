"""Every place where this project patches or relies on vLLM's (or torch's) private internals.

vLLM has no public API for what the backend needs (the log-prob arrays as they arrive, a
cap on prefix-cache hits, extra log-prob columns, a faster top-k, the logit scale), so the
backend overrides, wraps or sets a few private methods and attributes. :data:`HOOKS` is the
one list of them: one :class:`Hook` per piece that is installed (or not) as a whole, with
the internals it touches, the vLLM versions it was checked against, what serves instead
when it is not installed, and the tests that check that fallback.

The version rule (:func:`version_problem`, the only one): a hook is written for the
installed vLLM when that version's major.minor is the major.minor of one of its
:attr:`Hook.checked_versions`. The array path and the engine top-k (under ``auto``) and
the capped scheduler are not installed where it fails; the candidate columns need the
array path; the temperature needs a ``LogitsProcessor`` layer, or the server refuses to
start. The ``vllm`` extra in ``pyproject.toml`` is bounded to the same releases
(:func:`supported_range`, checked by ``tests/teacher_server/backends/vllm/test_hooks.py``).

Each guard that installs a hook says so through :func:`report`: one INFO line when it is
installed, one WARNING line naming the hook, why, and what serves instead when it falls
back. docs/vllm.md, "Supported vLLM versions", says what a new vLLM release changed.

Nothing here imports vLLM until a version is asked for.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

__all__ = [
    "ARRAY_LOGPROBS",
    "CANDIDATE_COLUMNS",
    "CAPPED_SCHEDULER",
    "ENGINE_CORE_TRIM",
    "ENGINE_TOPK_KERNEL",
    "HOOKS",
    "MESSAGE_QUEUE_PAGES",
    "NATIVE_BF16_PROBE",
    "SIMULATE_VERSION_ENV",
    "TEACHER_TEMPERATURE",
    "Hook",
    "installed_version",
    "report",
    "supported_range",
    "version_problem",
]

#: Testing aid: pretend the installed vLLM has this version (simulates a mismatch).
SIMULATE_VERSION_ENV = "TOPK_DISTILL_SIMULATE_VLLM_VERSION"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hook:
    """One patch into a library's internals, installed or not as a whole.

    Attributes:
        name: short name, used in the start-up log.
        package: the library patched (``vllm`` or ``torch``).
        targets: dotted paths of what it overrides, wraps or sets (``module.Class.attr``;
            an attribute may be one the class sets on its instances).
        relies_on: dotted paths of other private internals it reads or calls.
        replaces: what the hook changes, in words.
        installed_by: this project's function or class that installs it
            (``module:qualname``).
        checked_versions: releases of ``package`` it was checked against.
        fallback: what serves when it is not installed; None where there is none (then
            the server refuses to start rather than serve something else).
        fallback_tests: tests (``path::name``) that check the fallback: that it serves the
            same answers, or refuses by name where it serves none.
    """

    name: str
    package: str
    targets: tuple[str, ...]
    relies_on: tuple[str, ...]
    replaces: str
    installed_by: str
    checked_versions: tuple[str, ...]
    fallback: str | None
    fallback_tests: tuple[str, ...] = ()


_VLLM_CHECKED = ("0.32.0",)
_SERVER_TESTS = "tests/teacher_server/test_vllm_server.py"

ARRAY_LOGPROBS = Hook(
    name="array_logprobs",
    package="vllm",
    targets=(
        "vllm.v1.engine.logprobs.LogprobsProcessor._update_prompt_logprobs",
        "vllm.v1.engine.logprobs.LogprobsProcessor._update_sample_logprobs",
        "vllm.v1.engine.output_processor.OutputProcessor.add_request",
        "vllm.v1.engine.output_processor.RequestState.logprobs_processor",
        "vllm.v1.engine.logprobs.LogprobsProcessor.cumulative_logprob",
    ),
    relies_on=(
        "vllm.v1.engine.logprobs.LogprobsProcessor.update_from_output",
        "vllm.v1.engine.output_processor.OutputProcessor.request_states",
        "vllm.v1.engine.async_llm.AsyncLLM.output_processor",
    ),
    replaces=(
        "a marked request's LogprobsProcessor (a subclass keeps the engine's log-prob "
        "arrays; vLLM's builds a Python object per entry), swapped in by a wrapper of one "
        "engine's output_processor.add_request"
    ),
    installed_by="teacher_server.backends.vllm.array_logprobs:select_path",
    checked_versions=_VLLM_CHECKED,
    fallback="vLLM's flat_logprobs path (slower: a Python object per log-prob entry)",
    fallback_tests=(
        "tests/teacher_server/backends/vllm/test_vllm_arrays.py"
        "::test_array_path_matches_flat_path_and_reference",
        f"{_SERVER_TESTS}::test_fallback_matches_array_path_and_reference",
        f"{_SERVER_TESTS}::test_fallback_matches_array_path_in_every_dtype",
        f"{_SERVER_TESTS}::test_more_tokens_than_one_engine_step",
    ),
)

CAPPED_SCHEDULER = Hook(
    name="capped_scheduler",
    package="vllm",
    targets=(
        "vllm.v1.core.sched.scheduler.Scheduler._get_local_prefix_cache_hit",
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler._get_local_prefix_cache_hit",
    ),
    relies_on=(
        "vllm.v1.core.sched.scheduler.Scheduler.block_size",
        "vllm.v1.core.sched.scheduler.Scheduler.kv_cache_manager",
        "vllm.v1.core.kv_cache_manager.KVCacheManager.truncate_computed_blocks",
    ),
    replaces=(
        "the scheduler's prefix-cache hit of a request, cut to the request's cap (a "
        "subclass of vLLM's scheduler, passed as the engine argument scheduler_cls)"
    ),
    installed_by="teacher_server.backends.vllm.prefix:CappedScheduler",
    checked_versions=_VLLM_CHECKED,
    fallback=(
        "prefix reuse off: every position is computed (vLLM reads no cached block for a "
        "request with prompt log-probs)"
    ),
    fallback_tests=(
        f"{_SERVER_TESTS}::test_fallback_matches_array_path_and_reference",
        "tests/teacher_server/test_prefix_reuse.py::test_reuse_equals_reuse_off_in_both_orders",
    ),
)

CANDIDATE_COLUMNS = Hook(
    name="candidate_columns",
    package="vllm",
    targets=(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_prompt_logprobs_dict",
        "vllm.v1.sample.sampler.Sampler.forward",
        "vllm.v1.sample.sampler.Sampler.gather_logprobs",
        "vllm.v1.worker.gpu_input_batch.CachedRequestState.in_progress_prompt_logprobs_cpu",
    ),
    relies_on=(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sampler",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.requests",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.num_prompt_logprobs",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.input_batch",
        "vllm.v1.worker.gpu_input_batch.CachedRequestState.prompt_token_ids",
        "vllm.v1.worker.gpu_input_batch.CachedRequestState.num_computed_tokens",
        "vllm.v1.worker.gpu_input_batch.CachedRequestState.sampling_params",
        "vllm.v1.outputs.LogprobsTensors.empty_cpu",
    ),
    replaces=(
        "one worker's model runner's _get_prompt_logprobs_dict and its sampler's forward "
        "(instance attributes): while a request with candidate ids or draws is in the "
        "call, sampler.gather_logprobs appends their columns to the rows"
    ),
    installed_by="teacher_server.backends.vllm.candidates:install",
    checked_versions=_VLLM_CHECKED,
    fallback=(
        "candidate ids are not scored nor payloads sampled (max_candidates and max_samples "
        "0): such requests are refused by name"
    ),
    fallback_tests=(
        f"{_SERVER_TESTS}::test_fallback_refuses_candidate_ids_by_name",
        f"{_SERVER_TESTS}::test_sampled_requests_are_refused_on_the_flat_path",
    ),
)

ENGINE_TOPK_KERNEL = Hook(
    name="engine_topk_kernel",
    package="vllm",
    targets=("vllm.v1.sample.sampler.Sampler.gather_logprobs",),
    relies_on=(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sampler",
        "vllm.v1.worker.cpu_worker.CPUWorker.model_runner",
    ),
    replaces=(
        "one CPU worker's sampler.gather_logprobs (an instance attribute): this project's "
        "top-k kernel where it serves the rows, vLLM's torch.topk otherwise"
    ),
    installed_by="teacher_server.backends.vllm.worker:route_gather_logprobs",
    checked_versions=_VLLM_CHECKED,
    fallback="vLLM's own gather_logprobs (torch.topk)",
    fallback_tests=(
        "tests/teacher_server/backends/vllm/test_vllm_worker.py"
        "::test_kernel_route_equals_vllm_and_switches_back",
        "tests/teacher_server/backends/vllm/test_vllm_worker.py"
        "::test_a_failed_self_check_keeps_vllms_top_k",
        f"{_SERVER_TESTS}::test_fallback_matches_array_path_and_reference",
    ),
)

TEACHER_TEMPERATURE = Hook(
    name="teacher_temperature",
    package="vllm",
    targets=("vllm.model_executor.layers.logits_processor.LogitsProcessor.scale",),
    relies_on=("vllm.v1.worker.cpu_worker.CPUWorker.get_model",),
    replaces=(
        "the scale of every LogitsProcessor of a worker's model, times 1 / T (set only "
        "for a teacher temperature T != 1)"
    ),
    installed_by="teacher_server.backends.vllm.worker:TeacherWorkerExtension",
    checked_versions=_VLLM_CHECKED,
    fallback=None,
)

NATIVE_BF16_PROBE = Hook(
    name="native_bf16_probe",
    package="torch",
    targets=(),
    relies_on=("torch.cpu._is_avx512_bf16_supported", "torch.cpu._is_amx_tile_supported"),
    replaces="nothing: reads PyTorch's private CPU capability queries (vLLM calls them too)",
    installed_by="teacher_server.backends.cpu_dtype:cpu_has_native_bf16",
    checked_versions=("2.13.0",),
    fallback=None,
)

_SHM_RING = "vllm.distributed.device_communicators.shm_broadcast.ShmRingBuffer"

MESSAGE_QUEUE_PAGES = Hook(
    name="message_queue_pages",
    package="vllm",
    targets=(),
    relies_on=(
        f"{_SHM_RING}.get_metadata",
        f"{_SHM_RING}.shared_memory",
        f"{_SHM_RING}.metadata_size",
        f"{_SHM_RING}.max_chunks",
        f"{_SHM_RING}.max_chunk_bytes",
        f"{_SHM_RING}.data_offset",
        "multiprocessing.shared_memory.SharedMemory._mmap",
        "multiprocessing.shared_memory.SharedMemory._fd",
    ),
    replaces=(
        "nothing: reads the layout and flags of vLLM's shared-memory ring buffers and "
        "punches the pages of the chunks every reader has read (at the quiet-spell trim)"
    ),
    installed_by="teacher_server.backends.vllm.message_queue_pages:release_message_queue_pages",
    checked_versions=_VLLM_CHECKED,
    fallback="the queues' pages stay resident (the trim gives back glibc's free memory only)",
    fallback_tests=(
        "tests/teacher_server/backends/vllm/test_message_queue_pages.py"
        "::test_another_vllm_release_releases_nothing",
    ),
)

ENGINE_CORE_TRIM = Hook(
    name="engine_core_trim",
    package="vllm",
    targets=(),
    relies_on=(
        "vllm.v1.engine.async_llm.AsyncLLM.engine_core",
        "vllm.v1.engine.core_client.AsyncMPClient.call_utility_async",
        "vllm.v1.engine.core.EngineCoreProc._handle_client_request",
    ),
    replaces=(
        "nothing of vLLM's: adds one method of its own to EngineCore (a vLLM general "
        "plugin), which the server calls by name as a utility call between engine steps"
    ),
    installed_by="teacher_server.backends.vllm.engine_core_plugin:register",
    checked_versions=_VLLM_CHECKED,
    fallback="the engine core is not trimmed (the server and the worker still are)",
    fallback_tests=(
        "tests/teacher_server/backends/vllm/test_engine_core_plugin.py"
        "::test_another_vllm_release_adds_nothing",
    ),
)

ONEDNN_LAYER_CACHE = Hook(
    name="onednn_layer_cache",
    package="vllm",
    targets=("vllm._custom_ops.create_onednn_mm",),
    relies_on=("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",),
    replaces=(
        "the number of batch sizes each CPU oneDNN linear layer keeps a primitive for "
        "(vLLM asks for 32): at most TOPK_DISTILL_ONEDNN_LAYER_CACHE, in the vLLM "
        "processes the server starts (a vLLM general plugin)"
    ),
    installed_by="teacher_server.backends.vllm.onednn_caches:register",
    checked_versions=_VLLM_CHECKED,
    fallback="vLLM's 32 sizes per layer (the same answers, more of the worker's memory)",
    fallback_tests=(
        "tests/teacher_server/backends/vllm/test_onednn_caches.py"
        "::test_another_vllm_release_keeps_vllm_s_cache",
    ),
)

#: Every hook.
HOOKS: tuple[Hook, ...] = (
    ONEDNN_LAYER_CACHE,
    MESSAGE_QUEUE_PAGES,
    ENGINE_CORE_TRIM,
    CAPPED_SCHEDULER,
    TEACHER_TEMPERATURE,
    ENGINE_TOPK_KERNEL,
    ARRAY_LOGPROBS,
    CANDIDATE_COLUMNS,
    NATIVE_BF16_PROBE,
)


_LABELS = {"vllm": "vLLM", "torch": "PyTorch"}


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_version(package: str = "vllm") -> str:
    """The installed version of ``package`` (``vllm``: :data:`SIMULATE_VERSION_ENV` when
    set); raises ImportError when it is not installed."""
    if package == "vllm" and (simulated := os.environ.get(SIMULATE_VERSION_ENV)):
        return simulated
    module = __import__(package)
    return str(module.__version__)


def version_problem(hook: Hook) -> str | None:
    """Why the installed ``hook.package`` is not a release ``hook`` was written for (its
    major.minor is none of :attr:`Hook.checked_versions`'), or None."""
    version = installed_version(hook.package)
    written_for = sorted({_major_minor(v) for v in hook.checked_versions})
    if _major_minor(version) not in written_for:
        label = _LABELS.get(hook.package, hook.package)
        return f"{label} {version} is not a version it was written for ({', '.join(written_for)})"
    return None


def supported_range(hooks: tuple[Hook, ...] = HOOKS) -> tuple[str, str]:
    """``(lowest, above)``: the vLLM releases every vLLM hook of ``hooks`` was checked
    against are major.minor ``>= lowest`` and ``< above`` (the ``vllm`` extra's bound).
    Raises ValueError when the hooks disagree or leave a gap."""
    per_hook = {
        frozenset(_major_minor(v) for v in h.checked_versions) for h in hooks if h.package == "vllm"
    }
    if len(per_hook) != 1:
        raise ValueError(f"the vLLM hooks were checked against different releases: {per_hook}")
    minors = sorted(tuple(int(p) for p in v.split(".")) for v in per_hook.pop())
    for (a, b), (c, d) in itertools.pairwise(minors):
        if (c, d) != (a, b + 1):
            raise ValueError(f"the checked vLLM releases leave a gap: {minors}")
    (lo_major, lo_minor), (hi_major, hi_minor) = minors[0], minors[-1]
    return f"{lo_major}.{lo_minor}", f"{hi_major}.{hi_minor + 1}"


def report(hook: Hook, problem: str | None) -> None:
    """The start-up line of ``hook``'s guard: installed (``problem`` None, INFO) or fell
    back (WARNING: the hook, why, and what serves instead)."""
    if problem is None:
        log.info("vLLM hook %s installed", hook.name)
    else:
        instead = hook.fallback or "nothing"
        log.warning("vLLM hook %s fell back: %s; in use instead: %s", hook.name, problem, instead)
