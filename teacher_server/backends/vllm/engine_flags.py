"""The vLLM backend's command-line flags: its own (:class:`VLLMFlags`) and every vLLM
engine flag (``AsyncEngineArgs``), taken from vLLM's own parser.

The server sets some engine arguments itself (:data:`SERVER_SET`): a value given for one
of them on the command line is ignored with a warning. ``--dtype`` and
``--max-model-len`` are vLLM's flags, passed to the backend by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from teacher_server.backends.base import ModelFlags
from teacher_server.backends.vllm.array_logprobs import LOGPROBS_PATHS
from teacher_server.backends.vllm.shared_rows import DEFAULT_SHARED_ROWS_BYTES
from teacher_server.backends.vllm.worker import ENGINE_TOPK_CHOICES

__all__ = ["SERVER_SET", "VLLMFlags", "engine_kwargs", "engine_parser"]

log = logging.getLogger(__name__)

#: vLLM engine arguments the server sets itself: its value wins (the engine's max log-probs
#: is --max-top-k). ``--enable-prefix-caching`` is the operator's: on by default (prefix
#: reuse, docs/vllm.md), ``--no-enable-prefix-caching`` computes every position.
SERVER_SET = {
    "max_logprobs": "--max-top-k",
    "logprobs_mode": "raw_logprobs, which --teacher-temperature relies on",
}


@dataclass(frozen=True)
class VLLMFlags(ModelFlags):
    """The vLLM backend's own flags (vLLM's engine flags come from vLLM's parser)."""

    logprobs_path: str = field(default="auto", metadata={"choices": LOGPROBS_PATHS})
    """vLLM log-prob path: arrays (no Python object per entry), flat (vLLM's flat_logprobs
    lists), auto (arrays where the installed vLLM checks out, else flat)"""
    engine_topk: str = field(default="auto", metadata={"choices": ENGINE_TOPK_CHOICES})
    """top-K inside a CPU vLLM engine: kernel (this project's, bit-identical log-probs,
    several times faster on small vocabularies), vllm (vLLM's torch.topk), auto (both
    timed at start-up at the served vocabulary and K, the faster kept; vLLM's on GPUs)"""
    shared_rows_mib: int = DEFAULT_SHARED_ROWS_BYTES >> 20
    """MiB of recent answers' rows kept to answer later requests for the same prompt
    (G completions sent as G requests from position 0; docs/vllm.md, prefix reuse); 0:
    off. Needs vLLM's prefix cache"""


def engine_parser() -> tuple[argparse.ArgumentParser, type] | None:
    """vLLM's own engine-argument parser and ``AsyncEngineArgs``; None without vLLM."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    parser = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser, AsyncEngineArgs


def engine_kwargs(args: argparse.Namespace, reserved: frozenset[str]) -> dict[str, Any]:
    """The vLLM engine arguments given on the command line (those that differ from vLLM's
    defaults), less the server's own flags (``reserved``, and :class:`VLLMFlags`; their
    values replace vLLM's flags of the same name) and the ones the server sets itself."""
    vllm = engine_parser()
    if vllm is None:
        raise ValueError("--backend vllm needs vLLM (pip install vllm)")
    parser, engine_args_cls = vllm
    own = reserved | {f.name for f in dataclasses.fields(VLLMFlags)} | {"dtype", "max_model_len"}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args_cls):
        if f.name in own or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value == parser.get_default(f.name):
            continue
        if f.name in SERVER_SET:
            log.warning(
                "--%s is set by the server (%s); ignoring %r",
                f.name.replace("_", "-"),
                SERVER_SET[f.name],
                value,
            )
            continue
        out[f.name] = value
    return out
