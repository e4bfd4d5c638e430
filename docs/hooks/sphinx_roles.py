"""MkDocs hook: the docstrings' Sphinx roles (``:class:`~a.b.C```) shown as code, as Sphinx would show them.

mkdocstrings renders ``:mod:`x``` as the text ``:mod:`` before ``<code>x</code>``; this drops the role and,
for a ``~`` target, keeps the last name only. Nothing is fetched or linked: the build needs no network.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|obj|exc|const):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_code, html)
