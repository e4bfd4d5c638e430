"""The callbacks' end-of-run markdown as plain text for a terminal: aligned tables, no markup.

The callbacks write their diagnoses once, as markdown (TensorBoard's Text tab renders it); the demo and
``trainvitals report --format text`` print the same content through :func:`markdown_to_text`, which
knows the few constructs the callbacks use: pipe tables (alignment from the ``|---:|`` row), headings,
``**bold**`` and ```code``` spans, bullets. Anything else passes through unchanged.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

WIDTH = 120
"""Characters a table line may take before its last column is wrapped (a terminal of ~120 columns)."""

_SEPARATOR_CELL = re.compile(r"^:?-{1,}:?$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]*)`")


def markdown_to_text(markdown: str) -> str:
    """``markdown`` for a terminal: tables aligned in columns, headings underlined, emphasis removed."""
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out += format_table([table_cells(line) for line in lines[i:j]])
            i = j
            continue
        heading = _HEADING.match(lines[i])
        if heading:
            title = inline(heading.group(2))
            out += [title, ("=" if len(heading.group(1)) <= 2 else "-") * len(title)]
        else:
            out.append(inline(lines[i]))
        i += 1
    return "\n".join(out)


def inline(text: str) -> str:
    """``text`` without markdown emphasis: ``**bold**`` and ```code``` spans keep their words, ``<br>`` breaks a line."""
    return _CODE.sub(r"\1", _BOLD.sub(r"\1", text)).replace("<br>", " ").replace("\\|", "|")


def format_table(rows: Sequence[Sequence[str]], indent: str = "", width: int = WIDTH) -> list[str]:
    """Rows of cells (a markdown table's, separator row included or not) as aligned lines.

    The separator row ``|---|---:|`` sets each column's alignment (``---:`` right, else left) and marks
    the row above it as the header, which is underlined; an all-empty header (``| | |``) is left out.
    A last column that would run past ``width`` characters is wrapped under itself.
    """
    rows = [list(r) for r in rows]
    aligns: list[str] = []
    header: list[str] | None = None
    if len(rows) >= 2 and rows[1] and all(_SEPARATOR_CELL.match(c.strip()) for c in rows[1]):
        aligns = [">" if c.strip().endswith(":") and not c.strip().startswith(":") else "<" for c in rows[1]]
        header, rows = rows[0], rows[2:]
        if not any(c.strip() for c in header):
            header = None
    body = [[inline(c) for c in r] for r in ([header] if header else []) + rows]
    if not body:
        return []
    n = max(len(r) for r in body)
    body = [r + [""] * (n - len(r)) for r in body]
    widths = [max(len(r[k]) for r in body) for k in range(n)]
    aligns += ["<"] * (n - len(aligns))
    start = len(indent) + sum(widths[:-1]) + 2 * (n - 1)
    if n > 1 and aligns[-1] == "<" and start + widths[-1] > width:
        widths[-1] = max(30, width - start)
    lines = []
    for r in body:
        if aligns[-1] == "<":
            last = textwrap.wrap(r[-1], widths[-1], break_long_words=False, break_on_hyphens=False) or [""]
        else:
            last = [f"{r[-1]:>{widths[-1]}}"]
        cells = [f"{c:{a}{w}}" for c, a, w in zip(r[:-1], aligns, widths)]
        lines.append(indent + "  ".join([*cells, last[0]]).rstrip())
        lines += [" " * start + more for more in last[1:]]
    if header:
        lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return lines


def table_cells(line: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` is a literal bar inside a cell)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]
