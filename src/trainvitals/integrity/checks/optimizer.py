"""Who the optimizers train: leaves outside every optimizer, frozen parameters inside one, parameters in several."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.diagnoses import frozen_change_causes
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import GraphWalk
from trainvitals.text.prose import listed

if TYPE_CHECKING:
    import lightning.pytorch as pl

UNOPTIMIZED_LEAVES = FindingKind(
    "unoptimized_leaves",
    metric="unoptimized_params",
    label="tensors with a gradient in no optimizer",
    critical="{n} tensor(s) get gradients but belong to no optimizer: unregistered on the module (layers in a "
    "plain Python list?) or left out of configure_optimizers; they never train",
)
FROZEN_IN_OPTIMIZER = FindingKind(
    "frozen_in_optimizer", warning="frozen parameters (requires_grad=False) in an optimizer"
)
FROZEN_CHANGED = FindingKind("frozen_changed", warning="frozen parameters that the optimizer still changes")
# Not critical, never raised: a module shared by two optimizers on purpose (an encoder trained by two losses).
SHARED_BY_OPTIMIZERS = FindingKind(
    "shared_by_optimizers", warning="parameters stepped by more than one optimizer", strict=False
)


@register_check(order=40)
class UnoptimizedLeavesCheck(Check):
    """On a walk: leaves that get gradients but belong to no optimizer param group, and whether they are
    registered on the module. Logs ``graph/unoptimized_params`` and, of those, ``graph/unregistered_params``."""

    kinds = (UNOPTIMIZED_LEAVES,)
    metrics = (("unregistered_params", "of those, not registered on the module"),)

    def __init__(self) -> None:
        self._unoptimized = self._unregistered = 0

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._unoptimized = self._unregistered = 0

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        if not fit.opt_of:
            return
        unoptimized = [
            t for t in walk.leaves if id(t) not in fit.opt_of and (isinstance(t, nn.Parameter) or id(t) in fit.names)
        ]
        if not unoptimized:
            return
        registered = {id(p) for p in pl_module.parameters()}
        names = tuple(fit.names.get(id(t), f"<tensor {tuple(t.shape)}>") for t in unoptimized)
        unregistered = [n for n, t in zip(names, unoptimized) if id(t) not in registered]
        self._unoptimized += len(names)
        self._unregistered += len(unregistered)
        which = "they" if len(unregistered) == len(names) else listed(unregistered)
        why = (
            f"{which} are not registered on the module (kept in a plain Python list, dict or attribute): use "
            "nn.ModuleList / nn.ModuleDict / nn.Parameter so that `parameters()` includes them"
            if unregistered
            else "they are registered, but configure_optimizers left them out"
        )
        fit.record(
            UNOPTIMIZED_LEAVES,
            names,
            f"{listed(names)} receive gradients but belong to no optimizer param group, so they never change: {why}.",
        )

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        return {
            UNOPTIMIZED_LEAVES.window_tag: float(self._unoptimized),
            "graph/unregistered_params": float(self._unregistered),
        }


@register_check(order=50)
class FrozenParamsCheck(Check):
    """At fit start (not again when a fit resumes): parameters with ``requires_grad=False`` in an optimizer;
    at each checked step, their
    version, so that one the step changed is reported at the batch end with the cause."""

    kinds = (FROZEN_IN_OPTIMIZER, FROZEN_CHANGED)

    def __init__(self) -> None:
        self._versions: list[tuple[str, Tensor, int, int]] = []

    def on_train_start(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for k, named in enumerate(fit.opt_params):
            frozen = tuple(n for n, p in named if not p.requires_grad)
            if frozen and not fit.found(FROZEN_IN_OPTIMIZER, frozen):
                fit.record(
                    FROZEN_IN_OPTIMIZER,
                    frozen,
                    f"{listed(frozen)} are in {fit.optimizer(trainer, k)} but have "
                    "requires_grad=False: they get no gradient, yet momentum or weight decay still change them "
                    "whenever they hold a `.grad`. Build the optimizer from the trainable parameters only "
                    "(`[p for p in self.parameters() if p.requires_grad]`).",
                )

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        if checked:
            self._versions.extend((n, p, p._version, k) for n, p in fit.opt_params[k] if not p.requires_grad)

    def on_train_batch_end(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for name, p, version, k in self._versions:
            if p._version == version:
                continue
            fit.record(
                FROZEN_CHANGED,
                (name,),
                f"`{name}` has requires_grad=False but {fit.optimizer(trainer, k)} changed it: "
                + "; ".join(frozen_change_causes(p, trainer.optimizers[k]))
                + ". Set its `.grad` to None when freezing it, or remove it from the optimizer.",
            )
        self._versions = []


@register_check(order=60)
class SharedByOptimizersCheck(Check):
    """At fit start (not again when a fit resumes): parameters that are in more than one optimizer. Each
    optimizer's step moves them, with its own lr and its own state (momentum, Adam's moments), from whatever
    ``.grad`` holds then."""

    kinds = (SHARED_BY_OPTIMIZERS,)

    def on_train_start(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        owners: dict[int, tuple[str, list[int]]] = {}
        for k, named in enumerate(fit.opt_params):
            for name, p in named:
                name, ks = owners.setdefault(id(p), (name, []))
                if k not in ks:
                    ks.append(k)
        shared: dict[tuple[int, ...], list[str]] = {}
        for name, ks in owners.values():
            if len(ks) > 1:
                shared.setdefault(tuple(ks), []).append(name)
        for ks, names in shared.items():
            if fit.found(SHARED_BY_OPTIMIZERS, tuple(names)):
                continue  # a resumed fit: found before its checkpoint
            optimizers = " and ".join(fit.optimizer(trainer, k) for k in ks)
            fit.record(
                SHARED_BY_OPTIMIZERS,
                tuple(names),
                f"{listed(names)} are in {optimizers}: each of their steps moves them, with its own lr and state "
                "(momentum, Adam's moments), from what `.grad` holds at that step. Two optimizers both built from "
                "`self.parameters()` (a GAN, an actor-critic) step the discriminator with the generator's gradient "
                "too. Unless that is meant, build each optimizer from its own module's parameters "
                "(`self.gen.parameters()`).",
            )
