"""How far the training loss has fallen since the start of the run: what tells a plateau the run never left from a
minimum, where the gradient's statistics cannot.

On a saddle G ≈ 0 as at a minimum, and the steps are mostly noise: the noise band holds on both. A stop or an lr
cut means "converged at this lr", which is false while the training loss still sits where it started.
:class:`LossProgress` keeps the mean training loss of the run's first :data:`START_STEPS` optimizer steps and a
bias-corrected EMA of it, on the loss's device (no sync); the stopper and BandSchedule read it on the steps
that read the host anyway. Torch only.

The sums are float64 where the device has it, float32 on one without (Apple's MPS:
:func:`~trainvitals.plumbing.wide.wide_dtype`). float32 is exact enough for the one thing decided on them, a drop
compared with ``min_loss_drop`` (0.1 by default): the start sums at most :data:`START_STEPS` losses (a relative error
below 1e-6), and the EMA forgets its rounding (~1e-7 a step) as it forgets the losses, at β a step, so its relative
error stays below 1/(1 − β) steps' worth (≤ 1e-5 at β = 0.98) over any length of run instead of growing with it:
the drop is off by ~1e-5 at most, 3 orders below any ``min_loss_drop`` worth setting.

A fall counts only beyond the loss's own noise too (:meth:`LossProgress.allows`): a 10-step mean of a tiny, noisy
loss (fine-tuning a converged model, its first steps raised by a fresh optimizer's state) and its EMA differ by tens
of percent by chance alone, and a relative threshold alone read that as "fallen". The start's standard error is the
sample one of its step losses, s/√n; the EMA's, of i.i.d. step losses of variance σ², is
σ·√(Σ w_i²)/Σ w_i with weights w_i = (1 − β)β^(t−i), Σ w_i = 1 − β^t, Σ w_i² = (1 − β)(1 − β^(2t))/(1 + β)
(the variance of an exponentially weighted mean; σ² from the EMA of the squared losses less the EMA's square). A
trend inside either window raises its variance: it errs towards "not fallen", as a correlation between steps
misses it. In float32 the EMA's variance cancels below ~1e-7 of the loss's square, far below any ``min_loss_drop``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from trainvitals.plumbing.state import DeclaredState
from trainvitals.plumbing.wide import wide_dtype

START_STEPS = 10
"""Optimizer steps (with a finite loss) whose mean loss is the start: the stopper's default check period."""

NOISE_Z = 1.645
"""Standard errors of start − current a fall must pass to count (one-sided 95 % of a normal): "not fallen" on a
flat loss in about 95 % of runs, as the band's own intervals are read."""


def plateau_advice(acts: str = "stop the run") -> str:
    """What to do about a run that ended on a plateau it never left, for the fit-end line and the report: what gets a
    run off a plateau, and the switch for a run that started at its minimum, where the band may ``acts``."""
    return (
        "to leave a plateau, train at a higher learning rate or with a warm-up, or change the initialisation or add "
        "normalisation layers; a run that started at its minimum (fine-tuning a converged model) is no plateau: "
        f"min_loss_drop=None lets the band {acts} there"
    )


class LossProgress(DeclaredState):
    """The training loss's progress: its mean over the first ``start_steps`` optimizer steps, a smoothed current
    mean, the fraction it has fallen by (:attr:`drop`) and that fraction's noise (:attr:`noise`), all ``()``
    tensors on the loss's device (float64, or float32 where the device has no float64: module docstring).

    :meth:`add` takes each micro-batch's loss as its backward sees it; :meth:`step` closes the optimizer step, whose
    loss is the mean of its micro-batches. A step whose loss is not finite is left out of both. Every state is a
    sum or an EMA, so the mean over ranks (``reduce_states``, ``"mean"``) is the progress of the ranks' mean loss;
    its squares' mean is a rank's, not the ranks' mean's: the noise is one rank's loss's, an upper bound.

    Args:
        beta: decay of the current loss's EMA per step, in [0, 1): the stopper's ``ema_beta`` (0.98, a memory of
            about 50 steps, as the band's own EMAs: a mini-batch loss's noise averaged over some 100 steps).
        start_steps: steps whose mean is the start, ≥ 1.
    """

    def __init__(self, beta: float, start_steps: int = START_STEPS) -> None:
        self.start_steps = start_steps
        self.beta = beta
        self._micro: list[Tensor]
        self.add_state("_micro", [], persistent=False)  # this step's micro-batch losses
        zero = torch.zeros((), dtype=torch.float64)
        self.add_state("start_sum", zero, dist_reduce_fx="mean")
        self.add_state("start_sq", zero, dist_reduce_fx="mean")  # Σ x²: the start's sampling error
        self.add_state("start_count", zero, dist_reduce_fx="mean")
        self.add_state("ema", zero, dist_reduce_fx="mean")
        self.add_state("ema_sq", zero, dist_reduce_fx="mean")  # the EMA of x²: the current loss's variance
        self.add_state("weight", zero, dist_reduce_fx="mean")  # 1 − β^t: the EMA's bias correction

    def add(self, loss: Tensor, divisor: float = 1.0) -> None:
        """One micro-batch's ``loss`` (any shape with one element) as backpropagated, times ``divisor`` (what
        Lightning divided it by, and a GradScaler's scale undone by the caller): kept on its device."""
        self._micro.append(loss.detach().reshape(()).to(wide_dtype(loss.device)) * divisor)

    def step(self) -> None:
        """Close an optimizer step: its loss, the mean of its micro-batches, feeds the start while fewer than
        ``start_steps`` finite steps were seen, and the EMA. A step with no loss (no backward) changes nothing."""
        if not self._micro:
            return
        loss = self._micro[0] if len(self._micro) == 1 else torch.stack(self._micro).mean()
        self._micro = []
        names = ("start_sum", "start_sq", "start_count", "ema", "ema_sq", "weight")
        if self.ema.device != loss.device or self.ema.dtype != loss.dtype:  # a new or restored state: on the CPU
            for name in names:  # cast there first: MPS takes no float64 tensor, not even to cast it
                setattr(self, name, getattr(self, name).to(loss.dtype).to(loss.device))
        finite = torch.isfinite(loss)
        value = torch.where(finite, loss, 0.0)
        early = finite & (self.start_count < self.start_steps)
        self.start_sum = self.start_sum + torch.where(early, value, 0.0)
        self.start_sq = self.start_sq + torch.where(early, value * value, 0.0)
        self.start_count = self.start_count + early
        keep = torch.where(finite, self.beta, 1.0)  # an invalid step leaves the EMA as it was
        self.ema = keep * self.ema + (1.0 - keep) * value
        self.ema_sq = keep * self.ema_sq + (1.0 - keep) * value * value
        self.weight = keep * self.weight + (1.0 - keep)

    @property
    def start(self) -> Tensor:
        """The mean loss of the first ``start_steps`` finite steps; NaN until they are seen."""
        known = self.start_count >= self.start_steps - 1e-9  # a mean over ranks of integer counts
        return torch.where(known, self.start_sum / self.start_count.clamp_min(1.0), torch.nan)

    @property
    def current(self) -> Tensor:
        """The bias-corrected EMA of the step losses; NaN before the first finite one."""
        return torch.where(
            self.weight > 0, self.ema / self.weight.clamp_min(torch.finfo(self.weight.dtype).tiny), torch.nan
        )

    @property
    def drop(self) -> Tensor:
        """(start − current)/start: the fraction the loss has fallen by since the start (negative: risen); NaN
        while the start is unknown or not positive (a fraction of it means nothing then)."""
        start = self.start
        return torch.where(start > 0, (start - self.current) / start, torch.nan)

    @property
    def noise(self) -> Tensor:
        """:data:`NOISE_Z` standard errors of start − current, a fraction of the start: the least :attr:`drop`
        told from noise (module docstring); NaN where :attr:`drop` is."""
        n = self.start_count.clamp_min(2.0)
        start_var = (self.start_sq - self.start_sum * self.start_sum / n).clamp_min(0.0) / (n - 1.0) / n
        weight = self.weight.clamp_min(torch.finfo(self.weight.dtype).tiny)
        current = self.current
        sigma2 = (self.ema_sq / weight - current * current).clamp_min(0.0)
        spread = (1.0 - self.beta) * (1.0 - (1.0 - weight) ** 2) / ((1.0 + self.beta) * weight * weight)
        start = self.start
        return torch.where(start > 0, NOISE_Z * torch.sqrt(start_var + sigma2 * spread) / start, torch.nan)

    def allows(self, min_drop: float) -> Tensor:
        """``()`` bool: a decision may be taken — the start is known and the loss has fallen by at least
        ``min_drop`` of it and beyond its noise (:attr:`noise`), or the start is not positive (the rule cannot
        apply)."""
        start = self.start
        return (start <= 0) | ((self.drop >= min_drop) & (self.drop >= self.noise))

    def summary(self) -> dict[str, Any]:
        """``start``, ``current``, ``drop``, ``noise`` (NaN where unknown) and ``known`` (the start is), as floats:
        one transfer from the device."""
        start, current, drop, noise = torch.stack([self.start, self.current, self.drop, self.noise]).tolist()
        return {"start": start, "current": current, "drop": drop, "noise": noise, "known": not math.isnan(start)}
