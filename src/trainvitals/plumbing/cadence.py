"""Which optimizer steps log: a callback's own cadence, else the Trainer's ``log_every_n_steps``.

``Trainer(log_every_n_steps=0)`` (and ``barebones=True``) turns step logging off: Lightning's
``LoggerConnector.should_update_logs`` is then always False, and so is :func:`is_logging_step`.
"""

from __future__ import annotations

import lightning.pytorch as pl


def logging_every(trainer: "pl.Trainer", own: int | None = None) -> int | None:
    """Optimizer steps between two logging steps; ``None`` when logging is off."""
    return own or trainer.log_every_n_steps or None


def is_logging_step(step: int, every: int | None) -> bool:
    """Whether ``step`` (optimizer steps, counted from 0) is a logging step of the cadence ``every``."""
    return every is not None and step % every == 0
