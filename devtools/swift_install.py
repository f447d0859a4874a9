"""ms-swift 4.6.0 in a folder of its own, for the tests of the ms-swift plugin.

ms-swift's wheel asks for ``trl < 1`` and ``datasets < 4.8.5`` (the project's environment
has newer ones) and for much a trainer's teacher path never imports. Its teacher path
(``swift.rlhf_trainers``: request building, ``parse_prompt_logprobs``, the teacher-output
assembly, the trainer mixin that builds teacher clients) and its templates
(``swift.template``) import ms-swift, :data:`SWIFT_REQUIREMENTS` and what the project's
environment has (torch, transformers 5.19, accelerate, datasets); :func:`swift_site`
installs those, pinned, with ``pip install --no-deps --target`` into
``.cache/topk-distill/ms-swift-<version>/`` (once: :mod:`devtools.side_site`). No GPU
package, no vLLM: the plugin's client does not need swift's ``vllm`` check.

    python -m devtools.swift_install    # prints the folder
"""

from __future__ import annotations

from pathlib import Path

from devtools.side_site import side_env, side_site

__all__ = ["SWIFT_REQUIREMENTS", "SWIFT_VERSION", "swift_env", "swift_site"]

#: The ms-swift release the plugin is tested against (``plugin.SUPPORTED_SWIFT``).
SWIFT_VERSION = "4.6.0"

#: ms-swift and what its teacher path imports that the project's environment lacks or has
#: in a version ms-swift refuses, pinned.
SWIFT_REQUIREMENTS = (
    f"ms-swift=={SWIFT_VERSION}",
    "trl==0.29.1",
    "peft==0.19.1",
    "modelscope==1.40.2",
    "modelscope-hub==0.5.1",
    "dacite==1.9.2",
    "json-repair==0.64.9",
)


def swift_site(cache: Path | None = None) -> Path:
    """The folder holding :data:`SWIFT_REQUIREMENTS`, installed there first if missing."""
    return side_site(f"ms-swift-{SWIFT_VERSION}", SWIFT_REQUIREMENTS, cache)


def swift_env() -> dict[str, str]:
    """This process's environment with the project, then :func:`swift_site`, on
    ``PYTHONPATH`` (and trl's warning about its experimental modules, which swift
    imports, silenced): for a subprocess that imports ms-swift."""
    return {**side_env(swift_site()), "TRL_EXPERIMENTAL_SILENCE": "1"}


if __name__ == "__main__":
    print(swift_site())
