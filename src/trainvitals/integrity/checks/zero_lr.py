"""A param group whose learning rate is 0 while its parameters require grad: silently frozen."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import owner_module
from trainvitals.text.prose import listed

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Not critical: lr=0 is also a way to freeze a part of the model on purpose.
ZERO_LR = FindingKind(
    "zero_lr",
    warning="a param group at lr exactly 0 whose parameters require grad: they do not train",
    strict=False,
)

MIN_ZERO_LR_STEPS = 10
"""Fewest optimizer steps in a row at lr exactly 0 that are reported (or ``dead_after_steps``, if more): a
warm-up that starts at 0, stepped per epoch or every few steps, spends a few."""


@register_check(order=90)
class ZeroLrCheck(Check):
    """A param group at ``lr == 0`` whose parameters require grad: they get a gradient every step (its
    compute and memory) but never change, since SGD's and Adam's steps, weight decay included, scale
    with the learning rate.

    Judged only on the lr read at the optimizer steps, whatever sets it (a scheduler, a callback, a manual
    loop): a group at lr exactly 0 for its last ``max(dead_after_steps, MIN_ZERO_LR_STEPS)`` optimizer
    steps or more is reported when a complete check window closes. A lr held on the device is read at
    checked steps only (a host sync), and its other steps are not counted.
    """

    kinds = (ZERO_LR,)

    def __init__(self) -> None:
        self._streak: dict[tuple[int, int], int]  # (optimizer, group) -> optimizer steps in a row at lr 0
        self.add_state("_streak", {}, key="streak")

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        for g, group in enumerate(trainer.optimizers[k].param_groups):
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and not checked:
                continue
            if (
                lr is not None
                and float(lr) == 0.0
                and any(isinstance(p, torch.Tensor) and p.requires_grad for p in group["params"])
            ):
                self._streak[k, g] = self._streak.get((k, g), 0) + 1
            else:
                self._streak.pop((k, g), None)

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        least = max(fit.dead_after_steps, MIN_ZERO_LR_STEPS)
        for (k, g), steps in self._streak.items():
            if complete and steps >= least:
                self._record(fit, trainer, k, g, steps)
        return {}

    @staticmethod
    def _record(fit: Fit, trainer: "pl.Trainer", k: int, g: int, steps: int) -> None:
        trainable = [p for p in trainer.optimizers[k].param_groups[g]["params"] if p.requires_grad]
        modules = tuple(dict.fromkeys(owner_module(fit.names.get(id(p), "?")) or "<root>" for p in trainable))
        fit.record(
            ZERO_LR,
            (f"optimizer {k} param group {g}", *modules),
            f"Param group {g} of {fit.optimizer(trainer, k)} had lr exactly 0 at each of its last {steps} "
            f"optimizer steps, yet its {len(trainable)} parameter(s) require grad (module {listed(modules)}): "
            "they got a gradient at each of those steps but did not change. A warm-up that starts at exactly 0 "
            "spends these steps (start it above 0); a schedule or a manually set lr that ends at 0 while "
            "training goes on, too (end the run with it); if the group is meant to stay fixed, set "
            "`requires_grad=False` on its parameters, which also saves their gradients.",
        )
