"""`causal_lm_hidden_and_head` and `causal_lm_topk_kl_loss` on a tiny transformers Qwen2 built
offline (no logits formed).

The fused loss on the helper's output, and `causal_lm_topk_kl_loss` on the model, must train
every parameter exactly like the logits path (`model(...).logits` then `topk_kl_loss`), with
separate and with tied embeddings. (Under FSDP2: tests/student_client/test_hf_trainer_fsdp.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from devtools.tiny_model import tiny_qwen2_config
from student_client.losses import (
    LossOptions,
    TeacherTargets,
    causal_lm_hidden_and_head,
    causal_lm_topk_kl_loss,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)

VOCAB = 260  # the tiny config's special ids are 256 and 257


def _model(tied: bool):
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(vocab_size=VOCAB, hidden_size=32, num_layers=1, head_dim=16)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).double()


def _teacher(batch: int, length: int, vocab: int, top_k: int):
    generator = torch.Generator().manual_seed(1)
    full = torch.log_softmax(torch.randn(batch, length, vocab, generator=generator) * 2, -1)
    logprobs, ids = full.topk(top_k, dim=-1)
    return ids, logprobs


@pytest.mark.parametrize("whole_model", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_on_hidden_states_trains_like_the_logits_path(tied: bool, whole_model: bool) -> None:
    model = _model(tied)
    reference = copy.deepcopy(model)
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    mask = attention_mask.bool()
    ids, logprobs = _teacher(2, 11, VOCAB, 5)

    forward = {"input_ids": input_ids, "attention_mask": attention_mask}
    if whole_model:
        loss, _ = causal_lm_topk_kl_loss(
            model, forward, TeacherTargets(ids, logprobs, mask=mask), LossOptions(chunk_size=4)
        )
        inputs = causal_lm_hidden_and_head(model, **forward)  # what the loss used
    else:
        inputs = causal_lm_hidden_and_head(model, **forward)
        loss, _ = lm_head_topk_kl_loss(
            inputs.weight,
            inputs.hidden,
            TeacherTargets(ids, logprobs, mask=mask),
            LossOptions(chunk_size=4),
        )
    assert inputs.hidden.shape == (2, 11, 32) and inputs.bias is None
    assert inputs.weight is model.get_output_embeddings().weight
    if tied:
        assert inputs.weight is model.get_input_embeddings().weight
    loss.backward()

    logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits
    want, _ = topk_kl_loss(logits, TeacherTargets(ids, logprobs, mask=mask))
    want.backward()

    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    got_grads = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert parameter.grad is not None, name
        grad = got_grads[name].grad
        assert grad is not None, name
        torch.testing.assert_close(grad, parameter.grad, rtol=1e-8, atol=1e-11, msg=name)


def _refusal(model, whole_model: bool) -> None:  # type: ignore[no-untyped-def]
    input_ids = torch.zeros(1, 3, dtype=torch.long)
    if whole_model:
        ids, logprobs = _teacher(1, 3, VOCAB, 2)
        causal_lm_topk_kl_loss(model, {"input_ids": input_ids}, TeacherTargets(ids, logprobs))
    else:
        causal_lm_hidden_and_head(model, input_ids=input_ids)


@pytest.mark.parametrize("whole_model", [False, True])
def test_models_that_transform_logits_are_refused(whole_model: bool) -> None:
    model = _model(False)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"^model: config.final_logit_softcapping"):
        _refusal(model, whole_model)


@pytest.mark.parametrize("whole_model", [False, True])
def test_model_without_linear_head_is_refused(whole_model: bool) -> None:
    model = _model(False)
    model.set_output_embeddings(torch.nn.Identity())
    with pytest.raises(ValueError, match=r"^model: get_output_embeddings\(\)"):
        _refusal(model, whole_model)
