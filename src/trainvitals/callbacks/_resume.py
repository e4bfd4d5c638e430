"""Whether a fit continues a callback's state or starts it afresh.

Lightning calls a callback's ``load_state_dict`` before ``on_fit_start`` when ``fit(ckpt_path=...)``
resumes — and also for ``validate``/``test``/``predict`` with a checkpoint, whose state must not carry
into a later fit of the same callback object (another fold, another model).
"""

from __future__ import annotations

import lightning.pytorch as pl


def resumes(trainer: "pl.Trainer") -> bool:
    """Whether the fit now starting restores a checkpoint (``trainer.ckpt_path`` is this run's)."""
    return trainer.ckpt_path is not None
