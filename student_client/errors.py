"""Typed exceptions of the student client (defined with the protocol, re-exported here).

See :mod:`topk_protocol.errors`: every exception is a :class:`TeacherError`, the ones
caused by the caller's input are also ``ValueError``.
"""

from topk_protocol import errors as _errors
from topk_protocol.errors import *  # noqa: F403

__all__ = _errors.__all__
