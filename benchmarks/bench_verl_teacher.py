"""verl's teacher call: the topk-distill plugin's client against verl's built-in teacher
path, on the same vLLM engine settings and model, measured in one run.

Both arms answer verl 0.9.1's own ``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``
(its sampling parameters: ``max_tokens=1``, ``temperature=1.0``, ``prompt_logprobs=K``,
``detokenize=False``; its ``torch.tensor`` of the two fields; its shape assertion) for a
batch of sequences sent at once (``asyncio.gather``, as verl's agent loop does):

* **verl's built-in path**: vLLM's ``AsyncLLM`` in this process (plain vLLM, none of this
  project's hooks; verl's teacher engine arguments: ``max_logprobs=K``), called as verl's
  ``vLLMHttpServer.generate`` calls it (``SamplingParams(max_tokens=1, **params)`` with
  ``logprobs=None``, ``repetition_penalty=1.0``, ``ignore_eos=False``), its output turned
  into the two fields by verl's own ``extract_prompt_logprobs``. In verl the replica runs
  in a Ray actor and its nested lists cross Ray's object transfer to the caller; here
  they do not (in process), so this arm is measured faster than verl runs it.
* **the plugin**: a ``teacher-server serve`` of the same model and engine settings
  (``--dtype float32 --max-model-len 4096 --max-num-batched-tokens 16384``), asked through
  :class:`student_client.integrations.verl.teacher_client.VerlTeacherClient` over gRPC.

Each round draws fresh random sequences (no prefix cache or shared rows to reuse) and
runs the two arms one after the other, never at once; the first round of each is a
warm-up. Printed: seconds per batch and positions/s (median over rounds), their ratio,
and the largest difference between the arms' log-probs (the same model at float32).

verl runs from its own folder (``devtools.verl_install``); ``import verl`` loads this
project's plugin.

    python -m benchmarks.bench_verl_teacher [--batch 8] [--seq-len 2048] [--k 64]
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from devtools.launch import start_teacher
from devtools.tiny_model import write_tiny_model
from devtools.verl_install import verl_site

#: The engine settings of both arms (those of benchmarks/bench_teacher.py).
MAX_MODEL_LEN, MAX_BATCHED_TOKENS = 4096, 16384
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]  # fmt: skip


class VerlBuiltinTeacher:
    """verl 0.9.1's vLLM teacher replica's ``generate``, on an in-process ``AsyncLLM``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput
        from verl.workers.rollout.vllm_rollout.utils import extract_prompt_logprobs
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens")
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", 1.0)
        params.setdefault("ignore_eos", False)
        sampling = SamplingParams(max_tokens=max_tokens, **params)
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id=request_id
        ):
            final = output
        assert final is not None  # vLLM yields at least the final output
        fields: dict[str, Any] = {}
        extract_prompt_logprobs(final, sampling.prompt_logprobs, fields)
        return TokenOutput(token_ids=list(final.outputs[0].token_ids), extra_fields=fields)


def builtin_engine(model: str, k: int) -> Any:
    """Plain vLLM as verl's teacher replica starts it, on this run's engine settings."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model, dtype="float32", max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_BATCHED_TOKENS, max_logprobs=k, skip_tokenizer_init=True,
    )  # fmt: skip
    return AsyncLLM.from_engine_args(args)


async def one_batch(manager: Any, seqs: list[list[int]]) -> tuple[float, list[Any]]:
    """Seconds for verl's teacher call on every sequence at once, and the answers."""
    t0 = time.perf_counter()
    out = await asyncio.gather(*(manager.compute_teacher_logprobs_single(s) for s in seqs))
    return time.perf_counter() - t0, out


def managers(model: str, target: str, engine: Any, k: int) -> dict[str, Any]:
    """verl's teacher manager over each arm's client (one teacher, loss forward_kl_topk)."""
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager

    from devtools.verl_config import distillation_config
    from student_client.integrations.verl.teacher_client import VerlTeacherClient

    cfg = distillation_config(model, {"teacher_model": (None, "unused")}, "forward_kl_topk", k)
    return {
        "verl built-in (AsyncLLM in process)": AsyncTeacherLLMServerManager(
            cfg, {"default": VerlBuiltinTeacher(engine)}
        ),
        "topk-distill plugin (gRPC)": AsyncTeacherLLMServerManager(
            cfg, {"default": VerlTeacherClient(target)}
        ),
    }


async def run(arms: dict[str, Any], a: argparse.Namespace) -> dict[str, list[float]]:
    """``--rounds`` + 1 rounds (the first a warm-up) of each arm, alternating; seconds by arm."""
    rng = np.random.default_rng(0)
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(a.rounds + 1):
        seqs = [rng.integers(0, 256, a.seq_len).tolist() for _ in range(a.batch)]
        answers = {}
        for name, manager in arms.items():
            took, answers[name] = await one_batch(manager, seqs)
            if r:
                seconds[name].append(took)
        if r == 0:
            base, ours = answers.values()
            diff = max(float((x[1] - y[1]).abs().max()) for x, y in zip(base, ours, strict=True))
            print(f"largest |log-prob difference| between the arms: {diff:.2e}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(1, str(verl_site()))  # after the project, before site-packages
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "model", seed=0))
        server = start_teacher(
            ["--backend", "vllm", "--model", model, *ENGINE_FLAGS, "--max-top-k", str(a.k)],
            Path(tmp) / "server.log",
            env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        )
        engine = builtin_engine(model, a.k)
        try:
            seconds = asyncio.run(run(managers(model, server.target, engine, a.k), a))
        finally:
            engine.shutdown()
            del engine  # not again at interpreter exit
            gc.collect()
            server.stop()
    positions = a.batch * a.seq_len
    print(f"\n{a.batch} x {a.seq_len} tokens, K = {a.k}, {a.rounds} rounds (median)\n")
    print("| teacher path | s per batch | positions/s | vs verl built-in |")
    print("|---|---:|---:|---:|")
    base = statistics.median(next(iter(seconds.values())))
    for name, times in seconds.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.3f} | {positions / med:,.0f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
