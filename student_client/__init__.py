"""topk-distill student side: teacher clients, recording/replay and the top-k KL losses.

The package is laid out by job (``docs/design.md``):

- :mod:`student_client.data`: what a request and an answer are (``ScoreBatch``,
  ``TeacherPayload``, alignment to padded batches, decoding an answer);
- :mod:`student_client.clients`: the teacher clients (blocking, asyncio, several
  teachers) and the one interface they share (:mod:`student_client.clients.sources`);
- :mod:`student_client.offline`: recordings on disk (replay clients, ``PayloadDataset``,
  ``teacher-record``);
- :mod:`student_client.integrations`: Hugging Face ``Trainer``, TRL, data-parallel helpers;
- :mod:`student_client.losses`: the top-k KL losses (pure torch).

The names below are imported on first use (PEP 562), so ``import student_client.losses``
loads no grpc, pyarrow or transformers. The wire format and its rules live in
:mod:`topk_protocol`.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from student_client.clients.aio import AsyncTeacherClient
    from student_client.clients.blocking import TeacherClient
    from student_client.clients.multi_teacher import AsyncMultiTeacherClient, MultiTeacherClient
    from student_client.clients.sources import AsyncTeacherSource, TeacherSource
    from student_client.data.batch import ScoreBatch
    from student_client.data.payload import TeacherPayload
    from student_client.losses import (
        LossOptions,
        TeacherTargets,
        TopKKLLoss,
        causal_lm_hidden_and_head,
        causal_lm_topk_kl_loss,
        lm_head_topk_kl_loss,
        topk_kl_loss,
    )
    from student_client.offline.dataset import PayloadDataset
    from student_client.offline.multi_replay import MultiReplayClient
    from student_client.offline.replay_client import ReplayClient
    from topk_protocol import TeacherInfo
    from topk_protocol.errors import TeacherError
    from topk_protocol.requests import RequestOptions

__version__ = "0.1.0"

#: public name -> the module that defines it.
_EXPORTS = {
    "AsyncMultiTeacherClient": "student_client.clients.multi_teacher",
    "AsyncTeacherClient": "student_client.clients.aio",
    "AsyncTeacherSource": "student_client.clients.sources",
    "LossOptions": "student_client.losses",
    "MultiReplayClient": "student_client.offline.multi_replay",
    "MultiTeacherClient": "student_client.clients.multi_teacher",
    "PayloadDataset": "student_client.offline.dataset",
    "ReplayClient": "student_client.offline.replay_client",
    "RequestOptions": "topk_protocol.requests",
    "ScoreBatch": "student_client.data.batch",
    "TeacherClient": "student_client.clients.blocking",
    "TeacherError": "topk_protocol.errors",
    "TeacherInfo": "topk_protocol",
    "TeacherPayload": "student_client.data.payload",
    "TeacherSource": "student_client.clients.sources",
    "TeacherTargets": "student_client.losses",
    "TopKKLLoss": "student_client.losses",
    "causal_lm_hidden_and_head": "student_client.losses",
    "causal_lm_topk_kl_loss": "student_client.losses",
    "lm_head_topk_kl_loss": "student_client.losses",
    "topk_kl_loss": "student_client.losses",
}

__all__ = [
    "AsyncMultiTeacherClient",
    "AsyncTeacherClient",
    "AsyncTeacherSource",
    "LossOptions",
    "MultiReplayClient",
    "MultiTeacherClient",
    "PayloadDataset",
    "ReplayClient",
    "RequestOptions",
    "ScoreBatch",
    "TeacherClient",
    "TeacherError",
    "TeacherInfo",
    "TeacherPayload",
    "TeacherSource",
    "TeacherTargets",
    "TopKKLLoss",
    "__version__",
    "causal_lm_hidden_and_head",
    "causal_lm_topk_kl_loss",
    "lm_head_topk_kl_loss",
    "topk_kl_loss",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'student_client' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, "__doc__", "__file__", "__name__", "__path__"})
