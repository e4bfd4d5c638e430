"""How long a user's lr scheduler warms up, in its own steps: no cut of the lr before that.

Known warm-ups: LinearLR rising (``start_factor < end_factor``) for ``total_iters``; ConstantLR below 1 for
``total_iters``; OneCycleLR's first phase (``pct_start·total_steps``); SequentialLR's first scheduler, up to its
first milestone; ChainedScheduler's longest; a LambdaLR's (transformers' ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup`` …) read by evaluating its factor until it stops rising (:func:`lambda_warmup`:
an asymptotic rise, such as 1 − 0.9·exp(−k/τ), ends where it has made 95 % of its rise). Schedulers that only
decay (StepLR, CosineAnnealingLR, ReduceLROnPlateau …) warm up for 0 steps; any other is unknown (``None``).
"""

from __future__ import annotations

from typing import Any

from torch.optim import lr_scheduler

MAX_PROBE = 1_000_000
"""Steps of a LambdaLR's factor evaluated at most, looking for where it stops rising."""
RISE_DONE = 0.95
"""Share of its rise after which an asymptotic warm-up counts as ended (:func:`lambda_warmup`)."""
CREEP = 1.25
"""A rise that goes on for more than this many times the steps it took to make :data:`RISE_DONE` of itself is
asymptotic (a linear warm-up: 1/0.95 ≈ 1.05; a half-cosine one: 1.17; 1 − 0.9·exp(−k/140): 4453/420 ≈ 10.6)."""
_DECAY_ONLY = (
    lr_scheduler.StepLR,
    lr_scheduler.MultiStepLR,
    lr_scheduler.ExponentialLR,
    lr_scheduler.CosineAnnealingLR,
    lr_scheduler.CosineAnnealingWarmRestarts,
    lr_scheduler.PolynomialLR,
    lr_scheduler.ReduceLROnPlateau,
)


def scheduler_warmup(scheduler: Any) -> int | None:
    """Scheduler steps until ``scheduler``'s warm-up ends (module docstring); 0 for a decay-only one, ``None``
    when unknown."""
    if isinstance(scheduler, lr_scheduler.LinearLR):
        return scheduler.total_iters if scheduler.start_factor < scheduler.end_factor else 0
    if isinstance(scheduler, lr_scheduler.ConstantLR):
        return scheduler.total_iters if scheduler.factor < 1 else 0
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return int(scheduler._schedule_phases[0]["end_step"]) + 1
    if isinstance(scheduler, lr_scheduler.SequentialLR):
        first = scheduler_warmup(scheduler._schedulers[0])
        return None if first is None else min(first, scheduler._milestones[0])
    if isinstance(scheduler, lr_scheduler.ChainedScheduler):
        each = [scheduler_warmup(s) for s in scheduler._schedulers]
        return None if None in each else max(each)  # type: ignore[type-var]
    if isinstance(scheduler, lr_scheduler.LambdaLR):
        return max(lambda_warmup(fn) for fn in scheduler.lr_lambdas)
    if isinstance(scheduler, _DECAY_ONLY):
        return 0
    return None


def lambda_warmup(factor: Any) -> int:
    """Where a LambdaLR ``factor``'s warm-up ends: the first step ``e`` with ``factor(e + 1) <= factor(e)`` (a
    linear or cosine warm-up's last step), unless the rise creeps on toward its limit — it lasts more than
    :data:`CREEP` × the steps to :data:`RISE_DONE` of the rise ``factor(e) − factor(0)`` — when it ends at that 95 %
    step instead: 1 − 0.9·exp(−k/140) is at 0.955 by step 420 and rises until float saturation at 4,453 (issue
    #25), and a cut held that long is the schedule switched off."""
    end = next((i for i in range(MAX_PROBE) if factor(i + 1) <= factor(i)), MAX_PROBE)
    start = factor(0)
    done = start + RISE_DONE * (factor(end) - start)
    near = next(i for i in range(end + 1) if factor(i) >= done)  # a second pass: no list of MAX_PROBE values
    return end if end <= CREEP * near else near
