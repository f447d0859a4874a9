"""The fused loss on a Hugging Face causal LM: last hidden states and lm_head, no logits.

`causal_lm_hidden_and_head(model, input_ids=...)` runs the model's decoder stack only
(`model.base_model`, e.g. `Qwen2ForCausalLM.model`), never its lm_head, and returns the
hidden states with the lm_head's weight and bias, ready for `lm_head_topk_kl_loss`.
`causal_lm_topk_kl_loss(model, inputs, ...)` runs the decoder stack and the fused loss on
the lm_head module (`lm_head_topk_kl_loss`), whatever shards the model: under FSDP2
(`fully_shard` by hand, by accelerate's FSDP plugin, or by transformers'
`from_pretrained(distributed_config=...)`) both run as one forward method of the model's
root FSDP unit, so its parameters (embeddings, final norm, the lm_head when no unit of its
own holds it) are unsharded for them and their gradients reduce-scattered after backward.
Duck-typed: nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from torch import Tensor, nn

from student_client.losses.lm_head_topk_kl import HeadCall, head_topk_kl_loss, in_fsdp_forward
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.teacher import TeacherTargets
from student_client.losses.types import TopKKLStats

__all__ = [
    "LMHeadInputs",
    "causal_lm_hidden_and_head",
    "causal_lm_loss_and_head",
    "causal_lm_topk_kl_loss",
]

_LOSS_METHOD = "_topk_distill_causal_lm_loss"
"""Name of the loss method attached to an FSDP root model (registered as a forward method)."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
"""Config fields of models whose logits are not `hidden @ weight.T + bias` alone."""


class LMHeadInputs(NamedTuple):
    """What `lm_head_topk_kl_loss` needs instead of logits (`(weight, bias)` is its head).

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
            `base_model` returning `last_hidden_state`), not sharded (under FSDP2 use
            :func:`causal_lm_topk_kl_loss`).
        **forward_kwargs: passed to the base model (`input_ids`, `attention_mask`, ...).

    Raises:
        ValueError: the model has no linear output embedding, or its config transforms the
            logits after the lm_head (softcapping, logit scale): the fused loss would then
            train another function than the model computes.
    """
    head = _output_head(model)
    return _head_inputs(_last_hidden_state(model, forward_kwargs), head)


def causal_lm_topk_kl_loss(
    model: Any,
    inputs: Mapping[str, Any],
    teacher: TeacherTargets,
    options: LossOptions | None = None,
) -> tuple[Tensor, TopKKLStats]:
    """The lm_head path on a whole causal LM: its decoder stack on `inputs`, then
    `lm_head_topk_kl_loss` on its lm_head; the `[B, T, V]` logits never exist.

    Args:
        model: as :func:`causal_lm_hidden_and_head`'s, plain or FSDP2-sharded (the root
            `fully_shard`-ed: the call runs as a forward method of it, see the module
            docstring; an lm_head that is an FSDP unit itself runs the loss in its own).
        inputs: the base model's inputs (`input_ids` `[B, T]`, `attention_mask`, ...).
        teacher, options: as in `lm_head_topk_kl_loss` (`[B, T, K]` / `[B, T, C]` rows
            aligned to `input_ids`).

    Returns:
        `(loss, stats)` as `lm_head_topk_kl_loss`.

    Raises:
        ValueError: as :func:`causal_lm_hidden_and_head`.

    Example:
        >>> import torch, transformers
        >>> from student_client.losses import TeacherTargets, causal_lm_topk_kl_loss, topk_kl_loss
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2))
        >>> inputs = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
        >>> teacher = TeacherTargets(  # the teacher's top-2 at each of 2 x 3 positions
        ...     ids=torch.tensor([0, 1]).repeat(2, 3, 1),
        ...     logprobs=torch.tensor([0.5, 0.25]).log().repeat(2, 3, 1),
        ... )
        >>> loss, stats = causal_lm_topk_kl_loss(model, inputs, teacher)
        >>> dense, _ = topk_kl_loss(model(**inputs).logits, teacher)  # with the logits
        >>> torch.allclose(loss, dense, rtol=1e-4)
        True
    """
    loss, stats, _ = causal_lm_loss_and_head(model, inputs, teacher, options)
    return loss, stats


def causal_lm_loss_and_head(
    model: Any,
    inputs: Mapping[str, Any],
    teacher: TeacherTargets,
    options: LossOptions | None = None,
) -> tuple[Tensor, TopKKLStats, LMHeadInputs]:
    """`causal_lm_topk_kl_loss`, and the :class:`LMHeadInputs` the loss used (`hidden`
    `[B, T, H]`; the head's `weight` / `bias` as read after the call: a sharded `DTensor`
    under FSDP2 when its unit reshards after forward), e.g. for statistics per row group."""
    head = _output_head(model)
    call = HeadCall(teacher, loss_options(options))
    loss, stats, hidden = in_fsdp_forward(model, _LOSS_METHOD, _loss_on_causal_lm)(call, **inputs)
    return loss, stats, _head_inputs(hidden, head)


def _loss_on_causal_lm(
    model: Any, call: HeadCall, **forward_kwargs: Any
) -> tuple[Tensor, TopKKLStats, Tensor]:
    hidden = _last_hidden_state(model, forward_kwargs)
    loss, stats = head_topk_kl_loss(model.get_output_embeddings(), hidden, call)
    return loss, stats, hidden


def _output_head(model: Any) -> nn.Module:
    """The model's lm_head, checked: a `[V, H]` weight and logits `hidden @ weight.T (+ b)`."""
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
    return cast(nn.Module, head)


def _head_inputs(hidden: Tensor, head: nn.Module) -> LMHeadInputs:
    return LMHeadInputs(hidden, cast(Tensor, head.weight), getattr(head, "bias", None))


def _last_hidden_state(model: Any, forward_kwargs: Mapping[str, Any]) -> Tensor:
    """`[B, T, H]`: the base model's output (after the final norm)."""
    outputs = model.base_model(**forward_kwargs)
    hidden = getattr(outputs, "last_hidden_state", None)
    return outputs[0] if hidden is None else hidden
