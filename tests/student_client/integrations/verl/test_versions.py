"""The verl releases the plugin accepts, and the start-up error for the others."""

from __future__ import annotations

import pytest

from devtools.verl_install import VERL_VERSION
from student_client.integrations.verl.versions import SUPPORTED_VERL, check_verl_version

SETTING = "distillation.teacher_models.teacher_model.model_path"


def test_the_installed_release_of_the_tests_is_a_supported_one() -> None:
    assert SUPPORTED_VERL[0] == VERL_VERSION
    check_verl_version(VERL_VERSION, SETTING)  # no error


@pytest.mark.parametrize("version", ["0.9.0", "0.10.0", "0.10.0.dev"])
def test_another_release_is_refused_naming_the_setting_and_the_release(version: str) -> None:
    with pytest.raises(RuntimeError) as err:
        check_verl_version(version, SETTING)
    message = str(err.value)
    assert message.startswith(f"{SETTING}: a running topk-distill teacher needs verl 0.9.1")
    assert f"this is verl {version}" in message
