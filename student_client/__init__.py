"""topk-distill student side: teacher clients, recording/replay and the top-k KL losses.

Needs only torch, numpy, pyarrow, grpcio and protobuf (no vLLM, no grpcio-tools). The wire format
and its rules live in :mod:`topk_protocol`.
"""

from student_client.aio_client import AsyncTeacherClient
from student_client.client import ScoreBatch, TeacherClient
from student_client.losses import (
    TopKKLLoss,
    causal_lm_hidden_and_head,
    fused_topk_kl_loss,
    topk_kl_loss,
)
from student_client.multi_client import AsyncMultiTeacherClient, MultiTeacherClient
from student_client.payload import TeacherPayload
from student_client.replay import ReplayClient
from topk_protocol import TeacherInfo

__version__ = "0.1.0"

__all__ = [
    "AsyncMultiTeacherClient",
    "AsyncTeacherClient",
    "MultiTeacherClient",
    "ReplayClient",
    "ScoreBatch",
    "TeacherClient",
    "TeacherInfo",
    "TeacherPayload",
    "TopKKLLoss",
    "__version__",
    "causal_lm_hidden_and_head",
    "fused_topk_kl_loss",
    "topk_kl_loss",
]
