"""The fused loss's inputs from a Hugging Face causal LM: last hidden states and lm_head.

`causal_lm_hidden_and_head(model, input_ids=...)` runs the model's decoder stack only
(`model.base_model`, e.g. `Qwen2ForCausalLM.model`), never its lm_head, and returns the
hidden states with the lm_head's weight and bias, ready for `fused_topk_kl_loss`. Duck-typed:
nothing here imports transformers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["LMHeadInputs", "causal_lm_hidden_and_head"]

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
"""Config fields of models whose logits are not `hidden @ weight.T + bias` alone."""


class LMHeadInputs(NamedTuple):
    """What `fused_topk_kl_loss` needs instead of logits.

    - `hidden`: last hidden states `[B, T, H]` (after the final norm).
    - `weight`: the lm_head weight `[V, H]`: the model's own parameter, so gradients land in
      it; with tied embeddings it *is* the input embedding's weight.
    - `bias`: the lm_head bias `[V]`, or None.
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None


def causal_lm_hidden_and_head(model: Any, **forward_kwargs: Any) -> LMHeadInputs:
    """Last hidden states and lm_head parameters of a causal LM, without computing logits.

    Args:
        model: a transformers `*ForCausalLM` (anything with `get_output_embeddings()` and
            `base_model` returning `last_hidden_state`).
        **forward_kwargs: passed to the base model (`input_ids`, `attention_mask`, ...).

    Raises:
        ValueError: the model has no linear output embedding, or its config transforms the
            logits after the lm_head (softcapping, logit scale): the fused loss would then
            train another function than the model computes.
    """
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"model: get_output_embeddings() must be a linear layer with a [V, H] weight, "
            f"got {type(head).__name__}"
        )
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"model: config.{name} = {value!r} changes the logits after the lm_head; "
                f"compute logits and use topk_kl_loss for this model"
            )
    outputs = model.base_model(**forward_kwargs)
    hidden = getattr(outputs, "last_hidden_state", None)
    if hidden is None:
        hidden = outputs[0]
    bias = getattr(head, "bias", None)
    return LMHeadInputs(hidden=hidden, weight=weight, bias=bias)
