"""What the text-file readers share: a file read whole or not at all, and one cut short in the middle of a line."""

from __future__ import annotations

from pathlib import Path

from trainvitals.report.events import Damage


def read_lines(path: Path, name: str) -> tuple[str, list[Damage]]:
    """The whole lines of the file ``path`` (``name`` under LOGDIR, for messages) and its damage: a last line
    without its newline (a writer killed mid-line: that line is left out), or a file that cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as err:
        found = Damage(file=name, size=0, lost=0, first=0, regions=0, last_step=None, reason="")
        found.add(0, 0, f"the file cannot be read ({err.strerror or err})")
        return "", [found]
    if not data or data.endswith(b"\n"):
        return data.decode("utf-8", "replace"), []
    start = data.rfind(b"\n") + 1
    found = Damage(file=name, size=len(data), lost=0, first=0, regions=0, last_step=None, reason="")
    found.add(start, len(data) - start, "the file ends inside a line: cut short, or still being written")
    return data[:start].decode("utf-8", "replace"), [found]


def last_read(damage: list[Damage], step: int | None) -> list[Damage]:
    """``damage`` with ``step``, the last step read whole before it, filled in."""
    for found in damage:
        found.last_step = step
    return damage
