"""The verl releases the plugin was checked against, and the start-up check.

The plugin reaches into verl's internals (the teacher manager's name and arguments, the
``generate`` call and the ``TokenOutput`` fields its teacher path reads), which verl
changes between releases; a config that names a running teacher under another release
stops at start-up, before any step, rather than misbehave later.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_VERL", "check_verl_version"]

#: verl releases the plugin was checked against (its tests install the first:
#: ``devtools.verl_install``).
SUPPORTED_VERL = ("0.9.1",)


def check_verl_version(version: str, setting: str) -> None:
    """Raise ``RuntimeError`` naming ``setting`` (the config key that asked for a running
    teacher) when ``version`` is not in :data:`SUPPORTED_VERL`."""
    if version not in SUPPORTED_VERL:
        raise RuntimeError(
            f"{setting}: a running topk-distill teacher needs verl "
            f"{' or '.join(SUPPORTED_VERL)} (the releases topk-distill's verl plugin was "
            f"checked against); this is verl {version}. Install verl=={SUPPORTED_VERL[0]}, "
            "or give the teacher's model path for verl to launch it"
        )
