"""docs/datasets.md's layout table names every column a recording's shards hold."""

from __future__ import annotations

import re
from pathlib import Path

from topk_protocol.recording.format import recording_schema
from topk_protocol.recording.packed import PACKED_COLUMNS

DOC = Path(__file__).resolve().parents[3] / "docs" / "datasets.md"


def test_the_layout_table_lists_every_column() -> None:
    section = DOC.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert documented == recording_schema(8, "float16").names  # all 12, in order
    for packed in PACKED_COLUMNS.values():  # the packed encoding's columns, in the text
        assert f"`{packed}`" in section
