"""The teacher temperature on the wire: ``TeacherInfo.teacher_temperature``.

A teacher serves ``log_softmax(z / T)`` of its logits ``z``; ``T`` is announced in
``GetInfo`` (and so stored in recordings). A message without the field comes from a
teacher or recording older than the field: it served ``T = 1``.
"""

from __future__ import annotations

import math

from topk_protocol._generated import teacher_pb2 as pb

__all__ = [
    "DEFAULT_TEACHER_TEMPERATURE",
    "check_temperature",
    "teacher_temperature",
    "temperature_mismatch",
]

#: The temperature of a teacher whose ``TeacherInfo`` does not carry one.
DEFAULT_TEACHER_TEMPERATURE = 1.0


def check_temperature(value: float | str, field: str) -> float:
    """``value`` as a float when it is a finite number ``> 0``; else ValueError naming ``field``."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: must be a number > 0, got {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"{field}: must be a finite number > 0, got {value!r}")
    return t


def teacher_temperature(info: pb.TeacherInfo) -> float:
    """The temperature a ``TeacherInfo`` announces (1 when the field is unset)."""
    if info.HasField("teacher_temperature"):
        return float(info.teacher_temperature)
    return DEFAULT_TEACHER_TEMPERATURE


def temperature_mismatch(requested: float, served: float) -> str | None:
    """``None`` when a request's ``temperature`` is the served one (to 1e-9 relative), else
    the refusal naming both: a top-k answer cannot be re-tempered exactly."""
    if math.isclose(float(requested), float(served), rel_tol=1e-9):
        return None
    return (
        f"temperature: the request asks for {float(requested):g}, the teacher serves "
        f"teacher_temperature {float(served):g} (--teacher-temperature); a top-k answer "
        f"cannot be re-tempered: ask for {float(served):g}, or serve a teacher at "
        f"{float(requested):g}"
    )
