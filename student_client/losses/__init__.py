"""Student-side distillation losses against a teacher's top-k log-probs (docs/losses.md).

Entry points: `topk_kl_loss` (function) and `TopKKLLoss` (module), both chunked over rows,
vocab-parallel aware, with an analytic backward; `fused_topk_kl_loss`, the same loss from the
last hidden states and the lm_head weight without forming the logits, and
`causal_lm_hidden_and_head` to get those from a Hugging Face causal LM;
`lm_head_topk_kl_loss`, the fused loss on an FSDP2 / tensor-parallel lm_head module
(`local_vocab_shard` for the logits path); `causal_lm_topk_kl_loss`, the fused loss of a
whole Hugging Face causal LM, plain or FSDP2-sharded. `LossOptions` holds
every option (the divergence among them: `get_divergence`, `DIVERGENCES`; the support:
`SUPPORTS`, the teacher's top-k, the student's candidates or their union).
`topk_kl_reference` is the dense slow path (any divergence, mode and support).
`sampled_kl_loss` / `fused_sampled_kl_loss` (`sampled.py`): the unbiased loss on a
sampled payload, with `sampled_target_weights`. `onpolicy.py`: the per-token on-policy
signal on sampled tokens (k1 / k2 / k3, the stop-gradient advantage).
"""

from student_client.losses.api import fused_topk_kl_loss, topk_kl_loss
from student_client.losses.divergences import DIVERGENCES, Divergence, get_divergence
from student_client.losses.lm_head import (
    LMHeadInputs,
    causal_lm_hidden_and_head,
    causal_lm_topk_kl_loss,
)
from student_client.losses.module import TopKKLLoss
from student_client.losses.onpolicy import (
    KLEstimates,
    kl_estimators,
    policy_gradient_loss,
    reverse_kl_advantage,
    sampled_token_logprobs,
)
from student_client.losses.options import LossOptions
from student_client.losses.reference import topk_kl_reference
from student_client.losses.sampled import (
    fused_sampled_kl_loss,
    sampled_kl_loss,
    sampled_target_weights,
)
from student_client.losses.sharded_head import lm_head_topk_kl_loss, local_vocab_shard
from student_client.losses.sizing import DEFAULT_CHUNK_BYTES, auto_chunk_rows
from student_client.losses.types import (
    LOSS_MODES,
    REDUCTIONS,
    SUPPORTS,
    LossMode,
    Reduction,
    RowTerms,
    Support,
    TopKKLStats,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DIVERGENCES",
    "LOSS_MODES",
    "REDUCTIONS",
    "SUPPORTS",
    "Divergence",
    "KLEstimates",
    "LMHeadInputs",
    "LossMode",
    "LossOptions",
    "Reduction",
    "RowTerms",
    "Support",
    "TopKKLLoss",
    "TopKKLStats",
    "auto_chunk_rows",
    "causal_lm_hidden_and_head",
    "causal_lm_topk_kl_loss",
    "fused_sampled_kl_loss",
    "fused_topk_kl_loss",
    "get_divergence",
    "kl_estimators",
    "lm_head_topk_kl_loss",
    "local_vocab_shard",
    "policy_gradient_loss",
    "reverse_kl_advantage",
    "sampled_kl_loss",
    "sampled_target_weights",
    "sampled_token_logprobs",
    "topk_kl_loss",
    "topk_kl_reference",
]
