"""How long a user's lr scheduler warms up, in its own steps: no cut of the lr before that.

Known warm-ups: LinearLR rising (``start_factor < end_factor``) for ``total_iters``; ConstantLR below 1 for
``total_iters``; OneCycleLR's first phase (``pct_start·total_steps``); SequentialLR's first scheduler, up to its
first milestone; ChainedScheduler's longest; a LambdaLR's (transformers' ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup`` …) read by evaluating its factor until it stops rising. Schedulers that only
decay (StepLR, CosineAnnealingLR, ReduceLROnPlateau …) warm up for 0 steps; any other is unknown (``None``).
"""

from __future__ import annotations

from typing import Any

from torch.optim import lr_scheduler

MAX_PROBE = 1_000_000
"""Steps of a LambdaLR's factor evaluated at most, looking for where it stops rising."""
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
        return max(_rising(fn) for fn in scheduler.lr_lambdas)
    if isinstance(scheduler, _DECAY_ONLY):
        return 0
    return None


def _rising(factor: Any) -> int:
    """The first step ``i`` with ``factor(i + 1) <= factor(i)``: where a warm-up's factor stops rising."""
    for i in range(MAX_PROBE):
        if factor(i + 1) <= factor(i):
            return i
    return MAX_PROBE
