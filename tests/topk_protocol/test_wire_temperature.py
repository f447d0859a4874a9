"""``TeacherInfo.teacher_temperature``: unset means 1, invalid values are refused by name,
and the info check refuses a teacher at another temperature (no server needed)."""

from __future__ import annotations

import math

import pytest

from teacher_server.cli import build_parser
from topk_protocol import SCHEMA_VERSION, TeacherInfo, check_temperature, pb, teacher_temperature
from topk_protocol.errors import TeacherMismatchError, VocabMismatchError


def _info(**fields: object) -> pb.TeacherInfo:
    return pb.TeacherInfo(model_name="m", vocab_size=512, schema_version=SCHEMA_VERSION, **fields)  # type: ignore[arg-type]


def test_unset_temperature_is_one_and_set_ones_round_trip() -> None:
    old = _info()  # a teacher or recording from before the field
    assert not old.HasField("teacher_temperature")
    assert teacher_temperature(old) == 1.0
    assert TeacherInfo.from_message(old).teacher_temperature == 1.0
    for t in (0.5, 0.7, 2.0, 4.0):
        back = pb.TeacherInfo.FromString(_info(teacher_temperature=t).SerializeToString())
        assert teacher_temperature(back) == t  # a double: exact


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "warm", None])
def test_invalid_temperature_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^expect_temperature: must be"):
        check_temperature(bad, "expect_temperature")  # type: ignore[arg-type]


def test_info_check_names_the_field() -> None:
    info = TeacherInfo.from_message(_info(teacher_temperature=2.0))
    info.check_expected("teacher x", temperature=2.0)  # equal: accepted
    info.check_expected("teacher x")  # not asked: any temperature goes
    with pytest.raises(TeacherMismatchError) as err:
        info.check_expected("teacher x", temperature=1.0)
    assert not isinstance(err.value, VocabMismatchError)
    assert str(err.value) == (
        "teacher x: teacher_temperature: the teacher serves T = 2, the student expects T = 1"
    )
    with pytest.raises(VocabMismatchError, match=r"vocab_size: .*; teacher_temperature: "):
        info.check_expected("teacher x", vocab_size=320, temperature=1.0)


def test_client_refuses_an_invalid_expect_temperature() -> None:
    from student_client.clients.blocking import TeacherClient

    with pytest.raises(ValueError, match=r"^expect_temperature: must be a finite number > 0"):
        TeacherClient("127.0.0.1:1", expect_temperature=0.0)


@pytest.mark.parametrize("bad", ["0", "-2", "nan", "inf", "hot"])
def test_cli_refuses_an_invalid_teacher_temperature(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--teacher-temperature", bad])
    assert "--teacher-temperature: teacher_temperature: must be" in capsys.readouterr().err


def test_cli_refuses_a_temperature_for_replay() -> None:
    from teacher_server.cli import main

    with pytest.raises(SystemExit, match="serves the temperature the recording was made at"):
        main(["serve", "--backend", "replay", "--recording", "x", "--teacher-temperature", "2"])
