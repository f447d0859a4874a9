"""Replicas of one teacher that answer alike: a client with several targets keeps only
those whose answer fingerprints agree (:mod:`topk_protocol.fingerprint`).

The first call of a client with several targets asks every target for its ``GetInfo`` and
groups the replicas whose fingerprints agree with each other; the largest group is the
reference (on a tie, the one holding the earliest target), and every other replica is
refused: the client logs why (the replica, its model and dtype, and what differs) and goes
on with the agreeing ones. A replica that did not answer then is checked when it first
answers. A replica announcing no fingerprint (an older teacher, replay) is not judged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from topk_protocol.errors import TeacherMismatchError
from topk_protocol.fingerprint import AnswerFingerprint, differences
from topk_protocol.info import TeacherInfo

__all__ = ["ReplicaAgreement", "ReplicaDisagreesError"]

log = logging.getLogger(__name__)


class ReplicaDisagreesError(TeacherMismatchError):
    """A replica's answers disagree with the other replicas' (it is refused)."""


def _describe(target: str, fp: AnswerFingerprint) -> str:
    return f"replica {target} (model {fp.model_name!r}, dtype {fp.engine_dtype or 'none'})"


class ReplicaAgreement:
    """Which of ``targets`` (replicas of one teacher) a client may use."""

    def __init__(self, targets: Sequence[str]) -> None:
        self.targets = list(targets)
        #: ``target index -> why`` for every refused replica.
        self.refused: dict[int, str] = {}
        self.reference: tuple[str, AnswerFingerprint] | None = None
        #: Whether :meth:`decide` has run (one target: nothing to decide).
        self.decided = len(self.targets) < 2

    def decide(self, infos: Mapping[int, TeacherInfo]) -> None:
        """Group the replicas that answered (``infos``, by target index) and refuse the
        ones outside the reference group."""
        self.decided = True
        prints = {
            i: info.answer_fingerprint
            for i, info in sorted(infos.items())
            if info.answer_fingerprint is not None
        }
        if not prints:
            return
        groups = {
            i: [j for j, other in prints.items() if not differences(other, fp)]
            for i, fp in prints.items()
        }
        best = max(prints, key=lambda i: (len(groups[i]), -min(groups[i])))
        self.reference = (self.targets[best], prints[best])
        for i, fp in prints.items():
            if i not in groups[best]:
                self._refuse(i, fp)

    def check(self, index: int, info: TeacherInfo) -> None:
        """Raise :class:`ReplicaDisagreesError` when the replica at ``index`` is refused,
        or disagrees with the reference (it is then refused from now on)."""
        if index in self.refused:
            raise ReplicaDisagreesError(self.refused[index])
        fp = info.answer_fingerprint
        if fp is None or len(self.targets) < 2:
            return
        if self.reference is None:
            self.reference = (self.targets[index], fp)
            return
        if differences(fp, self.reference[1]):
            raise ReplicaDisagreesError(self._refuse(index, fp))

    def _refuse(self, index: int, fp: AnswerFingerprint) -> str:
        assert self.reference is not None
        ref_target, ref = self.reference
        why = (
            f"{_describe(self.targets[index], fp)} refused: its answers to the canary "
            f"sequences disagree with {_describe(ref_target, ref)}: "
            + "; ".join(differences(fp, ref))
        )
        self.refused[index] = why
        log.warning("%s; going on with the other replicas", why)
        return why

    def usable(self, index: int) -> int:
        """``index``, or the next target after it that is not refused; raises
        :class:`ReplicaDisagreesError` naming every refusal when none is left."""
        n = len(self.targets)
        for step in range(n):
            i = (index + step) % n
            if i not in self.refused:
                return i
        raise ReplicaDisagreesError(
            "every replica is refused: " + " | ".join(self.refused.values())
        )
