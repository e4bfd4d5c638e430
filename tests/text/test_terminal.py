"""Markdown for a terminal: the callbacks' tables aligned in columns, no markup left."""

from __future__ import annotations

from trainvitals.report.html import markdown_to_html
from trainvitals.text.markdown import markdown_table
from trainvitals.text.terminal import format_table, markdown_to_text


def test_tables_are_aligned_with_their_markdown_alignment() -> None:
    markdown = (
        "## Title\n\n| module | bytes |\n|---|---:|\n| `features.3` | 131,072 |\n| **head** | 4 |\n\n- **bold** words"
    )
    assert markdown_to_text(markdown).splitlines() == [
        "Title",
        "=====",
        "",
        "module        bytes",
        "----------  -------",
        "features.3  131,072",
        "head              4",
        "",
        "- bold words",
    ]


def test_an_empty_header_is_left_out_and_escaped_bars_stay() -> None:
    assert markdown_to_text("| | |\n|---|---|\n| a \\| b | 1 |\n| long key | 22 |") == "a | b     1\nlong key  22"


def test_a_long_last_column_wraps_under_itself() -> None:
    lines = format_table([["key", "word " * 30]], indent="  ", width=40)
    assert all(len(line) <= 40 for line in lines) and len(lines) > 1
    assert lines[0].startswith("  key  word") and all(line.startswith(" " * 7 + "word") for line in lines[1:])
    assert " ".join(line.strip().removeprefix("key").strip() for line in lines) == ("word " * 30).strip()


def test_a_written_table_escapes_bars_and_line_breaks_and_reads_back() -> None:
    table = markdown_table(("key", "n", ""), [("a|b", 12, "two\nlines"), ("c", 3, "")], align="lr")
    assert table == ["| key | n | |", "|---|---:|---|", "| a\\|b | 12 | two<br>lines |", "| c | 3 | |"]
    assert markdown_to_text("\n".join(table)).splitlines() == [
        "key   n",
        "---  --  ---------",
        "a|b  12  two lines",
        "c     3",
    ]
    assert "<td>a|b</td>" in markdown_to_html("\n".join(table)) and "two<br>lines" in markdown_to_html("\n".join(table))
