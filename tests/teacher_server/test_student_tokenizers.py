"""Student tokenizers without an engine: the ``--student-tokenizer`` flag's refusals (a
missing directory, a directory without a tokenizer, a tokenizer whose bytes cannot be
known, a name given twice), pairing (the teacher's own tokenizer maps every id to
itself), a sequence spelled in the teacher's tokens (BOS, refusals naming the field), the
request option on the wire. The live teacher: ``test_student_tokenizers_live.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.tiny_model import byte_tokenizer, train_bpe_tokenizer
from teacher_server.cli import serve
from teacher_server.config import ServerConfig
from teacher_server.student_tokenizers import StudentTokenizers
from topk_protocol import RequestOptions, TeacherInfo, pb
from topk_protocol.errors import InvalidRequestError, TeacherMismatchError

CORPUS = ["héllo wörld, the student reads again 🙂"] * 30


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tokenizer directories: the byte-level one, a BPE one, a WordPiece one, none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = {name: tmp_path_factory.mktemp(name) for name in ("byte", "bpe", "wordpiece", "empty")}
    byte_tokenizer().save_pretrained(out["byte"])
    train_bpe_tokenizer(CORPUS, 280).save_pretrained(out["bpe"])
    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2, "hel": 3}
    wordpiece = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]").save_pretrained(
        out["wordpiece"]
    )
    return out


def _serve_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        serve(["serve", "--backend", "transformers", "--model", "unused", *argv])
    return str(exit_info.value.code)


def test_the_flag_refuses_what_cannot_be_served(dirs: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    message = _serve_error(["--student-tokenizer", f"qwen={missing}"])
    assert message == (
        f"teacher-server: --student-tokenizer 'qwen={missing}': '{missing}' is not a directory"
    )
    assert "expected NAME=DIR" in _serve_error(["--student-tokenizer", "qwen"])
    twice = ["--student-tokenizer", f"a={dirs['bpe']}", "--student-tokenizer", f"a={dirs['byte']}"]
    assert "the name 'a' is given twice" in _serve_error(twice)
    message = _serve_error(["--student-tokenizer", f"bert={dirs['wordpiece']}"])
    assert message.startswith(
        f"teacher-server: --student-tokenizer 'bert={dirs['wordpiece']}': unsupported tokenizer"
    )
    message = _serve_error(["--student-tokenizer", f"none={dirs['empty']}"])
    assert "not a tokenizer directory" in message


def test_the_flag_repeats_into_the_config(dirs: dict[str, Path]) -> None:
    from teacher_server.cli import parse_args
    from teacher_server.flags import from_args

    flags = ["--student-tokenizer", f"a={dirs['bpe']}", "--student-tokenizer", f"b={dirs['byte']}"]
    base = ["serve", "--backend", "transformers", "--model", "unused"]
    config = from_args(ServerConfig, parse_args([*base, *flags]))
    assert config.student_tokenizer == (f"a={dirs['bpe']}", f"b={dirs['byte']}")
    assert from_args(ServerConfig, parse_args(base)).student_tokenizer == ()


def _paired(dirs: dict[str, Path], teacher: Any) -> StudentTokenizers:
    students = StudentTokenizers([f"bpe={dirs['bpe']}", f"self={dirs['byte']}"])
    students.pair(teacher, 300)
    return students


def test_pairing_and_info(dirs: dict[str, Path]) -> None:
    students = _paired(dirs, byte_tokenizer())
    info = {i.name: i for i in students.info()}
    assert list(info) == ["bpe", "self"]
    assert info["bpe"].vocab_size == 280
    # the teacher's own tokenizer: the model's vocabulary, every id mapped to itself
    assert info["self"].vocab_size == 300
    vocab_map = students.get("self").vocab_map
    assert vocab_map is not None
    np.testing.assert_array_equal(vocab_map.teacher_to_student, np.arange(300))
    np.testing.assert_array_equal(students.get("self").to_teacher, np.arange(300))
    # a BPE student's byte ids are the byte-level teacher's; its merges are no one token
    to_teacher = students.get("bpe").to_teacher
    assert to_teacher is not None
    assert to_teacher[:256].tolist() == list(range(256)) and (to_teacher[258:] == -1).all()
    with pytest.raises(InvalidRequestError, match=r"^student_tokenizer: 'x' is not served here"):
        students.get("x")


def test_a_sequence_spelled_in_the_teachers_tokens(dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    students = _paired(dirs, byte_tokenizer())
    student = AutoTokenizer.from_pretrained(dirs["bpe"])
    ids = np.asarray(student("héllo wörld", add_special_tokens=False)["input_ids"], np.int32)
    aligned = students.align("bpe", ids, "sequences[0].token_ids")
    assert aligned.teacher_ids.tolist() == list("héllo wörld".encode())  # one id per byte
    assert (aligned.alignment.kind >= 1).all()  # every student end is a byte end
    with pytest.raises(InvalidRequestError, match=r"^sequences\[2\]\.token_ids: .*not UTF-8"):
        students.align("bpe", np.array([0xC3], np.int32), "sequences[2].token_ids")


def test_a_teacher_that_puts_a_bos_first(dirs: dict[str, Path]) -> None:
    """Its BOS has no bytes: the student's first row still reads the teacher's row after
    the first byte, which follows the BOS."""
    from transformers import AutoTokenizer

    teacher = byte_tokenizer()
    teacher.bos_token = "<|pad|>"  # id 257, put first by a template
    from tokenizers.processors import TemplateProcessing

    teacher.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|pad|> $A", special_tokens=[("<|pad|>", 257)]
    )
    assert teacher("ab")["input_ids"] == [257, 97, 98]
    students = _paired(dirs, teacher)
    student = AutoTokenizer.from_pretrained(dirs["bpe"])
    ids = np.asarray(student("ab", add_special_tokens=False)["input_ids"], np.int32)
    aligned = students.align("bpe", ids, "f")
    assert aligned.teacher_ids.tolist() == [257, 97, 98]
    assert aligned.alignment.teacher_row.tolist()[-1] == 2


def test_the_request_option() -> None:
    options = RequestOptions(8, student_tokenizer="qwen")
    request = options.to_proto(pb.ScoreRequest())
    assert request.student_tokenizer == "qwen"
    assert RequestOptions.from_proto(request) == options
    assert RequestOptions.from_proto(RequestOptions(8).to_proto(pb.ScoreRequest())) == (
        RequestOptions(8)
    )
    with pytest.raises(InvalidRequestError, match=r"^student_tokenizer: expected a name of"):
        RequestOptions(8, student_tokenizer="")
    with pytest.raises(InvalidRequestError, match="served with top-k payloads only"):
        RequestOptions(4, samples=4, seed=1, student_tokenizer="qwen")
    with pytest.raises(InvalidRequestError, match=r"^encoding: 'packed' with student_tokenizer"):
        RequestOptions(8, encoding="packed", student_tokenizer="qwen")


def test_the_client_sees_the_student_tokenizers_vocabulary() -> None:
    msg = pb.TeacherInfo(model_name="m", vocab_size=512, tokenizer_fingerprint="teacher")
    msg.student_tokenizers.add(name="qwen", vocab_size=151_665, tokenizer_fingerprint="qf")
    info = TeacherInfo.from_message(msg)
    student = info.for_student("qwen")
    assert (student.vocab_size, student.tokenizer_fingerprint) == (151_665, "qf")
    assert info.for_student(None) is info
    student.check_expected("t", vocab_size=151_665, tokenizer_fingerprint="qf")
    with pytest.raises(TeacherMismatchError, match=r"^student_tokenizer: 'llama' is not served"):
        info.for_student("llama")
