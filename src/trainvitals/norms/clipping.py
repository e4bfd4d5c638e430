"""Gradient clipping by norm: what the Trainer clips to, by how much it shrinks a step, and when it binds so often
that it rescales the typical step instead of catching outliers.

torch's ``clip_grad_norm_`` (what Lightning's ``gradient_clip_algorithm="norm"`` calls) multiplies every gradient
by ``min(1, max_norm / (‖g‖₂ + 1e-6))``: a clipped step's norm becomes the threshold, its direction stays. Under
SGD, whose step is lr × gradient, that factor is an lr cut for the step; under Adam-like optimizers, which divide by
the RMS of recent gradients, a factor common to the steps cancels (m and √v scale alike) and what is left is each
step's norm set to the threshold's. Torch- and Lightning-free: the report reads it too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import lightning.pytorch as pl

CLIP_EPS = 1e-6
"""torch's ``clip_grad_norm_`` divides by ``‖g‖ + 1e-6``."""
MOST_STEPS = 0.5
"""A clipping that binds on at least this share of the steps is said: it then binds at or below the median norm,
on the typical step rather than the rare outlier clipping is for; at a threshold equal to the noise level, a
pure-noise gradient (whose norm scatters about it) is clipped about half the time."""
MIN_STEPS = 10
"""Fewer steps than this make no share (one step is clipped or not by its own noise)."""
NOISE_MARGIN = 2.0
"""The threshold to suggest, in noise levels sqrt(tr Σ/B): E‖ḡ‖² = ‖G‖² + tr Σ/B, so a norm above 2× the noise level
needs ‖G‖² ≥ 3 tr Σ/B — the true gradient dominating, or a spike — and pure noise, whose norm concentrates near the
noise level over many parameters, is left alone."""


def clip_coef(total: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` multiplies a gradient of L2 norm ``total`` by: ``min(1, max_norm / (total +
    1e-6))``; below 1 when it clips."""
    return min(1.0, max_norm / (total + CLIP_EPS))


def clips_most(clipped: int, steps: int) -> bool:
    """Whether ``clipped`` of ``steps`` is a share worth saying (:data:`MOST_STEPS`, over :data:`MIN_STEPS` steps)."""
    return steps >= MIN_STEPS and clipped >= MOST_STEPS * steps


class SetLR(NamedTuple):
    """A param group's lr as a user sets it, for :func:`lower_lr`: its name, the value, that value in words (with
    what it is and the lr now under a scheduler: ``0.1 (OneCycleLR's max_lr; now 0.0356)``, from
    :class:`~trainvitals.lr_scaling.groups.GroupLR` or the logs), and what to call it: ``"base lr"`` where a
    scheduler or a factor moves the lr now from it, else ``"lr"``."""

    name: str
    value: float
    said: str
    term: str


UNKNOWN_LR = "the lr you set (under a scheduler its base lr: OneCycleLR's max_lr, the optimizer's lr under LambdaLR)"
"""The lr :func:`lower_lr` names where none was read."""


def lower_lr(scale: float, lrs: Sequence[SetLR]) -> str:
    """The lr cut to make instead of clipping that scales every step ×``scale`` in mean (SGD's step is lr ×
    gradient), on the lr a user sets: under a scheduler its base lr, the whole schedule scaled, the lr now only
    beside it. ``lower the base lr 0.1 (OneCycleLR's max_lr; now 0.0356) ×0.32 to 0.032``."""
    if not lrs:
        return f"lower {UNKNOWN_LR} ×{scale:.2g}"
    if len(lrs) == 1:
        return f"lower the {lrs[0].term} {lrs[0].said} ×{scale:.2g} to {lrs[0].value * scale:.2g}"
    each = ", ".join(f"{lr.name}'s {lr.term} {lr.said} to {lr.value * scale:.2g}" for lr in lrs)
    return f"lower each param group's lr ×{scale:.2g} ({each})"


def trainer_clip(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> float | None:
    """The Trainer's gradient clipping of an automatic step: the norm clipped to, NaN when it clips by value,
    ``None`` when it does not clip (or under manual optimization, where the training step clips if it does)."""
    if not pl_module.automatic_optimization or not trainer.gradient_clip_val:
        return None
    by_value = str(trainer.gradient_clip_algorithm or "norm").lower().endswith("value")
    return math.nan if by_value else float(trainer.gradient_clip_val)
