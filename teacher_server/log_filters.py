"""Log records the server rewrites or drops: routine events that libraries report as
warnings or errors with tracebacks, which an operator would otherwise chase.

- grpc's ``ExecuteBatchError raised in core by servicer method [...]`` (ERROR, with a
  traceback): a client went away (cancelled, closed its channel, died) while its call was
  still answering. Routine for a server with many clients: one INFO line instead.
- vLLM's ``Triton is installed, but doesn't include CPU backend. Disabling Triton.``
  (WARNING, once per process that imports vLLM, ``--help`` included): the CPU build of
  vLLM next to a GPU-only Triton wheel; vLLM then runs without Triton, as it would
  without it installed. Dropped.

The filters sit on the loggers that emit the records (``grpc._cython.cygrpc``,
``vllm.triton_utils.importing``), installed before those modules are imported; every
other record of those loggers passes unchanged.
"""

from __future__ import annotations

import logging
import re

__all__ = ["CLIENT_GONE", "install"]

_GRPC_LOGGER = "grpc._cython.cygrpc"
_TRITON_LOGGER = "vllm.triton_utils.importing"
_TRITON_NO_CPU = "Triton is installed, but doesn't include CPU backend"
_METHOD = re.compile(r"\[(/[^\]]*)\]")

#: The INFO line that replaces grpc's traceback for a client that went away.
CLIENT_GONE = "client went away before its call %s finished; its answer was not delivered"


class _ClientGone(logging.Filter):
    """grpc's ExecuteBatchError traceback -> one INFO line naming the method."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if type(exc).__name__ != "ExecuteBatchError" and not message.startswith(
            "ExecuteBatchError"
        ):
            return True
        found = _METHOD.search(message)
        record.msg, record.args = CLIENT_GONE, (found.group(1) if found else "?",)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = record.stack_info = None
        return True


class _DropTritonNoCpu(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _TRITON_NO_CPU not in record.getMessage()


_FILTERS: dict[str, logging.Filter] = {
    _GRPC_LOGGER: _ClientGone(),
    _TRITON_LOGGER: _DropTritonNoCpu(),
}


def install() -> None:
    """Add the filters (once; idempotent)."""
    for name, f in _FILTERS.items():
        logger = logging.getLogger(name)
        if f not in logger.filters:
            logger.addFilter(f)
