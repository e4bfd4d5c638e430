"""A param group whose learning rate is 0 while its parameters require grad: silently frozen."""

from __future__ import annotations

from typing import Any

import torch

import lightning.pytorch as pl

from trainvitals.callbacks.integrity_checks.base import Check, Fit
from trainvitals.core.findings import FindingKind
from trainvitals.core.graph import owner_module
from trainvitals.core.integrity import listed


class ZeroLrCheck(Check):
    """A param group at ``lr == 0`` whose parameters require grad: they get a gradient every step (its
    compute and memory) but never change, since SGD's and Adam's steps, weight decay included, scale
    with the learning rate.

    Judged at fit start for an optimizer that no lr scheduler drives (its lr stays 0), otherwise at each
    checked optimizer step: a group at lr 0 at every checked step of a complete window is reported when
    the window closes. A warm-up from 0, or a schedule that touches 0 once, is not; a schedule that
    stays at 0 while training goes on is.
    """

    kinds = (FindingKind.ZERO_LR,)

    def __init__(self) -> None:
        self._streak: dict[tuple[int, int], int] = {}  # (optimizer, group) -> checked steps in a row at lr 0

    def on_train_start(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        scheduled = {id(config.scheduler.optimizer) for config in trainer.lr_scheduler_configs}
        for k, optimizer in enumerate(trainer.optimizers):
            if id(optimizer) not in scheduled:
                for g, group in enumerate(optimizer.param_groups):
                    if self._frozen(group):
                        self._record(fit, trainer, k, g, "and no lr scheduler changes it")

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._streak.clear()

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        if not checked:
            return
        for g, group in enumerate(trainer.optimizers[k].param_groups):
            if self._frozen(group):
                self._streak[k, g] = self._streak.get((k, g), 0) + 1
            else:
                self._streak.pop((k, g), None)

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        for (k, g), steps in self._streak.items():
            if complete and steps >= fit.dead_after_steps:
                self._record(fit, trainer, k, g, f"at each of its last {steps} checked optimizer steps")
        return {}

    @staticmethod
    def _frozen(group: dict[str, Any]) -> bool:
        """lr exactly 0 (a float or a tensor: one host read, on a checked step) and a parameter that trains."""
        lr = group.get("lr")
        return lr is not None and float(lr) == 0.0 and any(
            isinstance(p, torch.Tensor) and p.requires_grad for p in group["params"]
        )

    @staticmethod
    def _record(fit: Fit, trainer: "pl.Trainer", k: int, g: int, when: str) -> None:
        trainable = [p for p in trainer.optimizers[k].param_groups[g]["params"] if p.requires_grad]
        modules = tuple(dict.fromkeys(owner_module(fit.names.get(id(p), "?")) or "<root>" for p in trainable))
        fit.record(
            FindingKind.ZERO_LR,
            (f"optimizer {k} param group {g}", *modules),
            f"Param group {g} of {fit.optimizer(trainer, k)} has lr=0 {when}, yet its {len(trainable)} "
            f"parameter(s) require grad (module {listed(modules)}): they get a gradient every step but never "
            "change. If they are meant to stay fixed, freeze them (`requires_grad_(False)`, which also saves "
            "their gradients); otherwise give the group a learning rate (a schedule that ends at 0 while "
            "training goes on: end the run or the schedule together).",
        )

    def state_dict(self) -> dict[str, Any]:
        return {"zero_lr_streak": [[k, g, steps] for (k, g), steps in self._streak.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streak = {(int(k), int(g)): int(steps) for k, g, steps in state.get("zero_lr_streak", [])}
