"""The dense reference a served payload is checked against: the transformers forward
pass of the session's reference backend (``conftest.reference_backend``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["dense_logprobs", "dense_logprobs_f64"]


def dense_logprobs(reference_backend: Any, seq: Sequence[int] | npt.NDArray[Any]) -> np.ndarray:
    """``[L, V]`` float32 log-softmax of the transformers forward pass (T = 1) over the
    token ids ``seq`` ``[L]``: row ``t`` is ``log p(. | x[0..t])``."""
    with torch.inference_mode():
        x = torch.as_tensor(np.asarray(seq, np.int64))[None]
        logits = reference_backend._model(input_ids=x).logits[0]
        return torch.log_softmax(logits.float(), dim=-1).numpy()


def dense_logprobs_f64(model_dir: Path, seq: Sequence[int] | npt.NDArray[Any]) -> np.ndarray:
    """``[L, V]`` float64 log-softmax of the transformers forward pass of the weights in
    ``model_dir`` over ``seq`` ``[L]`` (for a teacher other than the session's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    with torch.inference_mode():
        logits = model(torch.as_tensor(np.asarray(seq, np.int64))[None]).logits[0]
    return torch.log_softmax(logits, -1).numpy()
