"""Student-side distillation losses against a teacher's top-k or sampled log-probs
(docs/losses.md). Pure torch: nothing here imports the rest of the project.

Every loss takes the student side, one teacher value (`TeacherTargets`, from a payload
with `TeacherTargets.from_payload`) and one `LossOptions`, and returns `(loss, stats)`:

- `topk_kl_loss(logits, teacher, options)`: the logits path (chunked over rows,
  vocab-parallel aware, analytic backward);
- `lm_head_topk_kl_loss(head, hidden, teacher, options)`: the lm_head path, the same loss
  from the last hidden states and the lm_head (a module: plain, FSDP2, tensor parallel;
  or its weight) without forming the logits;
- `causal_lm_topk_kl_loss(model, inputs, teacher, options)`: the lm_head path on a whole
  Hugging Face causal LM, plain or FSDP2-sharded;
- `TopKKLLoss(options)`: the logits path as an `nn.Module`;
- `topk_kl_reference(logits, teacher, options)`: the dense slow path, per-position terms.

A teacher value with `sample_counts` makes any of them the sampled (unbiased) loss.
More in the submodules: `onpolicy` (the per-token on-policy signal on sampled tokens),
`types` (`LOSS_MODES`, `SUPPORTS`, ...), `sizing` (`auto_chunk_rows`), `sampled`
(`sampled_target_weights`).
"""

from student_client.losses.causal_lm_topk_kl import (
    LMHeadInputs,
    causal_lm_hidden_and_head,
    causal_lm_topk_kl_loss,
)
from student_client.losses.divergences import DIVERGENCES, Divergence, get_divergence
from student_client.losses.lm_head_topk_kl import lm_head_topk_kl_loss, local_vocab_shard
from student_client.losses.options import LossOptions
from student_client.losses.reference import topk_kl_reference
from student_client.losses.teacher import TeacherTargets
from student_client.losses.topk_kl import topk_kl_loss
from student_client.losses.topk_kl_module import TopKKLLoss
from student_client.losses.types import RowTerms, TopKKLStats

__all__ = [
    "DIVERGENCES",
    "Divergence",
    "LMHeadInputs",
    "LossOptions",
    "RowTerms",
    "TeacherTargets",
    "TopKKLLoss",
    "TopKKLStats",
    "causal_lm_hidden_and_head",
    "causal_lm_topk_kl_loss",
    "get_divergence",
    "lm_head_topk_kl_loss",
    "local_vocab_shard",
    "topk_kl_loss",
    "topk_kl_reference",
]
