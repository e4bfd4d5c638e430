"""Markdown pipe tables: the one way trainvitals writes them (the callbacks' diagnoses, core's advice tables,
``trainvitals report``). Pure Python; :mod:`trainvitals.text.terminal` reads them back, :func:`markdown_to_html`
renders them as HTML (the report's page, W&B's text panels).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence

from trainvitals.text.terminal import table_cells


def markdown_cell(value: object) -> str:
    """``value`` as the text of one cell: a bar escaped (``\\|``), a line break as ``<br>`` (a space as
    plain text, a break in TensorBoard and HTML)."""
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A pipe table as lines: the header, the separator, one line per row, every cell through
    :func:`markdown_cell` (an empty one as ``| |``).

    ``align`` has a letter per column: ``"r"`` right-aligned (``---:``, for numbers), anything else left;
    columns past its end are left-aligned.
    """
    separator = "|" + "|".join("---:" if a == "r" else "---" for a in align.ljust(len(headers), "l")) + "|"
    return [_line(headers), separator, *map(_line, rows)]


def _line(cells: Sequence[object]) -> str:
    return "|" + "|".join(f" {text} " if text else " " for text in map(markdown_cell, cells)) + "|"


_SEPARATOR = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def markdown_to_html(markdown: str) -> str:
    """The callbacks' markdown (pipe tables, headings, bullets, ``**bold**``, ```code```) as escaped HTML."""
    out: list[str] = []
    lines = markdown.splitlines()
    i, in_list = 0, False
    while i < len(lines):
        line = lines[i].strip()
        if in_list and not line.startswith("- "):
            out.append("</ul>")
            in_list = False
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].strip().startswith("|"):
                j += 1
            out.append(_table_html([lines[k].strip() for k in range(i, j)]))
            i = j
            continue
        heading = re.match(r"^(#{1,6})\s+(.*)$", line)
        if heading:
            level = min(6, len(heading.group(1)) + 2)
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif line.startswith("- "):
            if not in_list:
                out.append("<ul>")
                in_list = True
            out.append(f"<li>{_inline(line[2:])}</li>")
        elif line:
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    if in_list:
        out.append("</ul>")
    return "\n".join(out)


def _inline(text: str) -> str:
    text = html.escape(text.replace("\\|", "|")).replace("&lt;br&gt;", "<br>")
    text = re.sub(r"`([^`]*)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)


def _table_html(lines: list[str]) -> str:
    rows = [table_cells(line) for line in lines]
    right: list[bool] = []
    header = None
    if len(lines) >= 2 and _SEPARATOR.match(lines[1]):
        right = [c.endswith(":") and not c.startswith(":") for c in rows[1]]
        header, rows = rows[0], rows[2:]
    cls = lambda k: ' class="num"' if k < len(right) and right[k] else ""  # noqa: E731
    out = ["<table>"]
    if header and any(header):
        out.append("<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in header) + "</tr>")
    out += ["<tr>" + "".join(f"<td{cls(k)}>{_inline(c)}</td>" for k, c in enumerate(r)) + "</tr>" for r in rows]
    return "\n".join(out + ["</table>"])
