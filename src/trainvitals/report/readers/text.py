"""What the text-file readers share: a file cut short in the middle of a line."""

from __future__ import annotations

from trainvitals.report.events import Damage


def cut_short(name: str, data: bytes, last_step: int | None) -> list[Damage]:
    """A :class:`~trainvitals.report.events.Damage` for a text file ``name`` whose ``data`` does not end in a
    newline (a writer killed in the middle of a line: its last line is not read), else none; ``last_step``: the
    last step read whole."""
    if not data or data.endswith(b"\n"):
        return []
    start = data.rfind(b"\n") + 1
    found = Damage(file=name, size=len(data), lost=0, first=0, regions=0, last_step=last_step, reason="")
    found.add(start, len(data) - start, "the file ends inside a line: cut short, or still being written")
    return [found]
