"""Exact teacher temperature inside vLLM: scale the logits where the model makes them.

vLLM computes every log-prob it returns, prompt rows and sampled rows alike, as
``log_softmax`` of the logits that the model's ``LogitsProcessor`` layer hands out, and
that layer multiplies its logits by its ``scale`` attribute (1 for most models). Setting
``scale`` to ``base_scale / T`` on every worker makes every served log-prob exactly
``log_softmax(z / T)`` of the model's logits ``z``, on vLLM's normal fast path. The
engine must return raw log-probs (``logprobs_mode="raw_logprobs"``) and the request must
not add a sampling temperature of its own (the backend samples greedily).

:class:`TemperatureWorkerExtension` is mixed into vLLM's worker class through the engine
argument ``worker_extension_cls``, so the engine can call its method by name with
``collective_rpc`` (a method name needs no pickled function shipped to the workers).
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXTENSION_QUALNAME", "SET_TEMPERATURE_METHOD", "TemperatureWorkerExtension"]

# The scale a LogitsProcessor was built with, kept on it so that setting T twice is safe.
_BASE_SCALE_ATTR = "_topk_distill_base_scale"


class TemperatureWorkerExtension:
    """Worker mix-in: set the temperature of the model's ``LogitsProcessor`` layers."""

    def topk_distill_set_temperature(self, temperature: float) -> list[float]:
        """Scale every ``LogitsProcessor`` of this worker's model by ``1 / temperature``
        (relative to the scale the model was built with, so a model with a logit scale of
        its own keeps it) and return the new scales, one per layer found."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        worker: Any = self
        scales = []
        for module in worker.get_model().modules():
            if isinstance(module, LogitsProcessor):
                base = getattr(module, _BASE_SCALE_ATTR, None)
                if base is None:
                    base = float(module.scale)
                    setattr(module, _BASE_SCALE_ATTR, base)
                module.scale = base / temperature
                scales.append(float(module.scale))
        return scales


#: Method name called on every worker with ``collective_rpc``.
SET_TEMPERATURE_METHOD = TemperatureWorkerExtension.topk_distill_set_temperature.__name__
#: Value of vLLM's ``worker_extension_cls`` engine argument.
EXTENSION_QUALNAME = f"{__name__}.{TemperatureWorkerExtension.__qualname__}"
