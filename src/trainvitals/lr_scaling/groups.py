"""Each param group's lr as a user sets it and as its steps run now: the one reading of the lrs that LRScalingAdvisor
advises on and GradNormMonitor's clipping advice names, so that both say which lr a number is.

Under a scheduler the lr in ``param_groups`` moves (a OneCycleLR ends near 0) while the value a user sets does not:
that one, the base lr (:func:`~trainvitals.plumbing.lr_factors.base_lr`: OneCycleLR's ``max_lr``, the optimizer's lr
under LambdaLR or a cosine), is what a message asks to change, and the lr now is quoted beside it only as "now".
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import lightning.pytorch as pl

from trainvitals.lr_scaling.rules import optimizer_family, param_group_labels
from trainvitals.plumbing.lr_factors import LRFactors, base_lr


class GroupLR(NamedTuple):
    """A param group's lrs at one moment, named as LearningRateMonitor names it (``SGD``, ``Adam/pg2``)."""

    name: str
    family: str  # the optimizer's (:func:`~trainvitals.lr_scaling.rules.optimizer_family`)
    group: dict[str, Any]
    optimizer: int  # its optimizer's place in trainer.optimizers
    base: float  # the lr a user sets, which advice scales: the scheduler's base lr, else the scheduled one
    scheduled: float  # as the scheduler set it for the next step
    now: float  # the lr the next step runs at: scheduled × the factors
    factors: dict[str, float]  # BandSchedule's cut, TrainingGuard's factor: the owners scaling it now (≠ 1)
    scheduler: str | None  # the class name of the lr scheduler stepping its optimizer
    kept: bool  # whether a base lr is kept apart from the lr now (not under ReduceLROnPlateau, which decays in place)
    set_as: str  # what the base lr is, in words ("OneCycleLR's max_lr")
    step: int  # the optimizer step the lr now is for (trainer.global_step: the next to run), which "now" is dated by

    @property
    def moves(self) -> bool:
        """Whether the lr now may differ from the base lr (a scheduler or a factor acts on it): then a message
        says "base lr" and what it is, with the lr now beside it."""
        return self.scheduler is not None or bool(self.factors)

    @property
    def term(self) -> str:
        """What a message calls the lr it quotes: ``"base lr"`` where :attr:`moves` from one kept apart, else
        ``"lr"``."""
        return "base lr" if self.moves and self.kept else "lr"

    def now_said(self) -> str:
        """The lr now in words, dated: ``now 0.0356 at optimizer step 60``, with the factors ``now 0.0356 × 0.1
        (BandSchedule) = 0.00356 at optimizer step 60``; the report's lr of a logged step differs by its date."""
        cut = "".join(f" × {value:.3g} ({owner})" for owner, value in self.factors.items())
        return (
            f"now {self.scheduled:.3g}" + (f"{cut} = {self.now:.3g}" if cut else "") + f" at optimizer step {self.step}"
        )

    def base_said(self) -> str:
        """The base lr, what it is and the lr now where that differs: ``0.1 (OneCycleLR's max_lr; now 0.0356)``;
        the value alone where nothing moves it."""
        if not self.moves:
            return f"{self.base:.3g}"
        now = f"; {self.now_said()}" if self.factors or self.scheduled != self.base else ""
        return f"{self.base:.3g} ({self.set_as}{now})"


def group_lrs(trainer: "pl.Trainer", factors: LRFactors | None) -> list[GroupLR]:
    """Every param group of every optimizer with its lrs now (``factors``: the fit's
    :class:`~trainvitals.plumbing.lr_factors.LRFactors`, ``None`` where no callback scales the lr). The scheduler of
    an optimizer is the first of ``trainer.lr_scheduler_configs`` that steps it; where it keeps no base lr
    (ReduceLROnPlateau decays the lr in place) the lr it set now is the base. The lr now is the scheduler's ×
    BandSchedule's cuts and TrainingGuard's factor whatever the order of the hooks, at the end of the fit too; the
    factors stay out of the base lr: in a run at another batch they act on top of it again, as in this one."""
    optimizers = [getattr(opt, "optimizer", opt) for opt in trainer.optimizers]  # DeepSpeed wraps the optimizer
    schedulers: dict[int, Any] = {}
    for config in trainer.lr_scheduler_configs:
        driven = getattr(config.scheduler, "optimizer", None)
        schedulers.setdefault(id(getattr(driven, "optimizer", driven)), config.scheduler)
    names = param_group_labels(
        [type(opt).__name__ for opt in optimizers],
        [[group.get("name") for group in opt.param_groups] for opt in optimizers],
    )
    owners = {} if factors is None else factors.factors()
    scale = math.prod(owners.values())
    read = []
    for number, (opt, group_names) in enumerate(zip(optimizers, names)):
        scheduler = schedulers.get(id(opt))
        for index, (name, group) in enumerate(zip(group_names, opt.param_groups)):
            scheduled = float(group["lr"]) if factors is None else factors.scheduled(group)
            base = base_lr(group, index, scheduler)
            by = None if scheduler is None else type(scheduler).__name__
            if by is None:
                set_as = "the optimizer's lr"  # the one in place: the factors are put back between steps
            elif base is None:
                set_as = f"{by}'s lr now: it keeps no base lr"
            elif "max_lr" in group:
                set_as = f"{by}'s max_lr"
            else:
                set_as = f"the optimizer's lr under {by}"
            family = optimizer_family(type(opt))
            kept = base is not None or by is None
            base = scheduled if base is None else base
            read.append(
                GroupLR(
                    name,
                    family,
                    group,
                    number,
                    base,
                    scheduled,
                    scheduled * scale,
                    owners,
                    by,
                    kept,
                    set_as,
                    trainer.global_step,
                )
            )
    return read
