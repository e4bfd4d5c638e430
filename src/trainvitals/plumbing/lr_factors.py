"""Lr multipliers on top of the lr a user's scheduler sets, one optimizer step at a time.

A callback that scales the lr (TrainingGuard after a rollback, BandSchedule after a cut) must not fight the
scheduler: a chainable one (StepLR, ExponentialLR, ReduceLROnPlateau …) computes its next lr from
``group["lr"]``, so a factor left in place would compound at every scheduler step, and one written over the
scheduler's value would undo it. Each step's lrs are therefore saved at the step's first micro-batch, multiplied
by every owner's factor (their product: two owners compose, whatever the order of their hooks), and put back by
the optimizer's step post-hook, before Lightning steps the schedulers: ``optimizer_step`` and the update see the
scaled lr, the scheduler only its own. LearningRateMonitor reads ``group["lr"]`` in its own ``on_train_batch_start``
at every micro-batch (and in ``on_train_epoch_start``), and Lightning calls the callbacks in list order, so each
owner moves the monitors listed before it to right after it (:func:`monitors_after`, at setup) and applies the
factors at an epoch's start too: every lr the monitor logs is the one the step takes, whatever the order given.
A step a GradScaler skips runs no post-hook, and Lightning steps the schedulers before any later hook:
:meth:`LRFactors.before_step` puts the lrs back at ``on_before_optimizer_step`` when the scaler has found an inf,
so the scheduler steps from its own lr then too. A checkpoint written while the factors are applied (a validation
between a step's micro-batches, at ``val_check_interval``, with ModelCheckpoint on its metric) stores the
scheduler's lrs all the same (:meth:`LRFactors.unscaled_checkpoint`, from each owner's ``on_save_checkpoint``): a
resumed run applies its factors once, and a chainable scheduler goes on from its own lr.

Each owner declares its factor once per fit (:meth:`LRFactors.own`, a function read when asked), so a reader
(LRScalingAdvisor) gets the lr a step runs at from :meth:`LRFactors.lr` whatever the order of the hooks, between
steps too (at the end of a fit, when the scheduler's lrs are back in ``param_groups``), the scheduler's own from
:meth:`LRFactors.scheduled`, and what a user set under both from :func:`base_lr`.

Shared per fit through the hub: ``vitals.shared(LR_FACTORS, LRFactors)`` (:mod:`trainvitals.plumbing.sharing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor


def monitors_after(trainer: "pl.Trainer", owner: pl.Callback) -> None:
    """Every LearningRateMonitor listed before ``owner`` in ``trainer.callbacks`` moved to right after it, in their
    order (module docstring): ahead of the owner's hook the monitor would log the scheduler's lr at a step's first
    micro-batch and the scaled one at the next. A new list, so a hook Lightning is calling goes on over the old."""
    callbacks = list(trainer.callbacks)
    ahead = [cb for cb in callbacks[: callbacks.index(owner)] if isinstance(cb, LearningRateMonitor)]
    if ahead:
        rest = [cb for cb in callbacks if all(cb is not monitor for monitor in ahead)]
        at = rest.index(owner) + 1
        trainer.callbacks = rest[:at] + ahead + rest[at:]


class LRFactors:
    """The lr factors of this optimizer step, by owner, and the lrs they scaled (module docstring)."""

    def __init__(self) -> None:
        self._owners: dict[str, Callable[[], float]] = {}
        self._saved: list[tuple[dict[str, Any], Any]] | None = None
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step post-hook's handle

    def own(self, owner: str, factor: Callable[[], float]) -> None:
        """Declare ``owner``'s factor (``owner``: the callback's class name, as messages name it): ``factor()`` is the
        multiplier of the step under way (between steps: of the next one), 1 where it scales nothing; read at each
        :meth:`apply` and :meth:`lr`. Declared again: replaced."""
        self._owners[owner] = factor

    def scale(self) -> float:
        """The product of the owners' factors now: the multiplier on the scheduler's lr."""
        return math.prod(factor() for factor in self._owners.values())

    def factors(self) -> dict[str, float]:
        """The owners whose factor scales the lr now (≠ 1), and their factors: what a message names."""
        now = {owner: float(factor()) for owner, factor in self._owners.items()}
        return {owner: value for owner, value in now.items() if value != 1.0}

    def apply(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Every param group's lr of ``optimizers`` × :meth:`scale` for this step, put back after the optimizer's
        step (:meth:`put_back`). Calling it again in the step applies the factors anew to the lrs saved at the
        first call, which stay the scheduler's."""
        if self._saved is None:
            self._saved = [(g, g["lr"]) for opt in optimizers for g in opt.param_groups]
            for opt in optimizers:
                if id(opt) not in self._hooks:
                    self._hooks[id(opt)] = opt.register_step_post_hook(lambda *_: self.put_back())
        scale = self.scale()
        for group, lr in self._saved:
            group["lr"] = lr * scale

    def scheduled(self, group: dict[str, Any]) -> float:
        """``group``'s lr as its scheduler set it, without the factors: saved while a step's factors are applied, else
        the one in place."""
        return float(next((lr for held, lr in self._saved or [] if held is group), group["lr"]))

    def epoch_start(self, trainer: "pl.Trainer") -> None:
        """At ``on_train_epoch_start``: the factors of the epoch's first step applied now where any scales, for the
        LearningRateMonitor that logs there (module docstring); no scheduler steps before that step's post-hook."""
        if self.scale() != 1.0:
            self.apply(trainer.optimizers)

    def lr(self, group: dict[str, Any]) -> float:
        """The lr ``group`` steps at: :meth:`scheduled` × :meth:`scale`. Right before the owners' hooks have applied
        this step's factors, after them, and between steps (the next step's lr: at the end of a fit, the lr the cuts
        left)."""
        return self.scheduled(group) * self.scale()

    def before_step(self, optimizer: torch.optim.Optimizer, scaler: "torch.amp.GradScaler | None") -> None:
        """At ``on_before_optimizer_step``: when ``scaler`` will skip ``optimizer``'s step (the infs its
        ``unscale_`` found, which Lightning calls before that hook), the scheduler's lrs put back now — the skipped
        step runs no post-hook, and the scheduler steps next, from the lr in place. Reads the found-inf flags only
        while a factor is applied and the scaler has unscaled: the host read GradScaler.step makes next anyway. An
        optimizer that unscales in its own ``step`` (a fused one) has none here, and runs its post-hook."""
        if self._saved is None or scaler is None:
            return
        state = scaler._per_optimizer_states.get(id(optimizer))  # the per-optimizer record unscale_ fills
        found = state["found_inf_per_device"].values() if state else ()
        if sum(float(v.item()) for v in found):
            self.put_back()

    def unscaled_checkpoint(self, trainer: "pl.Trainer", checkpoint: dict[str, Any]) -> None:
        """At ``on_save_checkpoint``: the lrs ``checkpoint`` holds for the param groups the factors scale now, written
        back to the scheduler's (a copy of the optimizers' state, dumped before this hook; the fit's own lrs stay
        scaled until the step). Else a resumed run scaled the scaled lr (× s²) and put it back as the scheduler's.
        Idempotent (every owner calls it); a state with no ``param_groups`` of the optimizer's (a strategy that saves
        the optimizers itself) is left as it is."""
        states = checkpoint.get("optimizer_states") or []
        held = {id(group): lr for group, lr in self._saved or []}
        for optimizer, state in zip(trainer.optimizers, states):
            groups = state.get("param_groups") if isinstance(state, dict) else None
            if groups is not None and len(groups) == len(optimizer.param_groups):
                for group, saved in zip(optimizer.param_groups, groups):
                    if id(group) in held:
                        saved["lr"] = held[id(group)]

    def put_back(self) -> None:
        """The scheduler's lrs back in place (a no-op when nothing is scaled): after each optimizer step, and
        wherever a step ends without one (a GradScaler skips it, the fit fails)."""
        for group, lr in self._saved or []:
            group["lr"] = lr
        self._saved = None

    def close(self) -> None:
        """:meth:`put_back`, and the optimizers' post-hooks removed (at the end of a fit); the owners stay declared,
        so :meth:`lr` still reads the lr the fit ended at."""
        self.put_back()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}


def base_lr(group: dict[str, Any], index: int, scheduler: Any | None) -> float | None:
    """The lr a user sets for param group ``group`` (number ``index`` of its optimizer), which its lr scheduler
    scales: OneCycleLR's peak ``max_lr``; else ``scheduler``'s ``base_lrs`` (what LambdaLR, StepLR,
    CosineAnnealingLR … multiply: the optimizer's lr at construction); else the ``initial_lr`` torch's schedulers
    write in the group (SequentialLR and ChainedScheduler keep no ``base_lrs``; a scheduler stepped by hand is not
    ``scheduler``). ``None`` for none of these: no scheduler (the lr in place is the one set), or one that keeps no
    base lr (ReduceLROnPlateau decays the lr in place). Neither BandSchedule's cuts nor TrainingGuard's factor are
    in it: they act on top of the scheduler's lr (module docstring)."""
    if "max_lr" in group:
        return float(group["max_lr"])
    base = getattr(scheduler, "base_lrs", None)
    if base is not None and index < len(base):
        return float(base[index])
    return float(group["initial_lr"]) if "initial_lr" in group else None
