"""Parameters the loss does not reach, and parameters whose gradient is missing or zero for a while."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from trainvitals.compiled import compiled_modules
from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.diagnoses import unreached_reasons
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import GraphWalk
from trainvitals.plumbing.extra_forward import in_extra_forward
from trainvitals.text.prose import counted, listed

if TYPE_CHECKING:
    import lightning.pytorch as pl

UNREACHABLE_PARAMS = FindingKind("unreachable_params", warning="parameters the loss cannot reach")
# A branch taken only on some batches (an expert without tokens for a while) is unused in one window and
# trains in the next: a parameter that never trains is still unused in the last one.
UNUSED_PARAMS = FindingKind(
    "unused_params",
    metric="unused_params",
    label="parameters without a gradient",
    critical="{n} parameter(s) got no gradient in the last check window: not in the loss's graph (an unused "
    "head, a detached branch)",
    last_window=True,
)
DEAD_PARAMS = FindingKind(
    "dead_params",
    metric="dead_params",
    label="parameters with an exactly zero gradient",
    warning="parameters with an exactly zero gradient all check window long",
)
DDP_UNUSED = FindingKind("ddp_unused", warning="parameters DDP finds unused (find_unused_parameters)")


def _ddp_without_unused_search(trainer: "pl.Trainer") -> bool:
    """DDP with ``find_unused_parameters=False``: a step in which a parameter gets no gradient fails the next."""
    ddp = trainer.strategy.model
    return isinstance(ddp, DistributedDataParallel) and not ddp.find_unused_parameters


@register_check(order=20)
class ReachabilityCheck(Check):
    """The walk of a window's first batch finds the trainable parameters the loss cannot reach, and why
    (module forward hooks note which modules ran, and with grad mode on: during that batch only, on the modules
    outside ``torch.compile``'d regions, where a hook would fail a guard of the compiled graphs and compile them
    anew, and not in trainvitals' own forwards, :func:`~trainvitals.plumbing.extra_forward.extra_forward`). One
    batch does not
    make them unused (an auxiliary head used every other step, an expert that got no tokens): a
    parameter of an optimizer is reported when the window closes if it also went the whole window
    without a gradient; one outside every optimizer, or any under DDP with
    ``find_unused_parameters=False`` (whose next step fails on it), at once.

    At each checked optimizer step the gradients of its parameters extend ``fit.streaks``: a parameter
    without a gradient (unused) or with an exactly zero one (dead) for ``dead_after_steps`` steps in a
    row is reported when the window closes, with what DDP without the unused-parameter search would
    make of it. Logs ``graph/unused_params`` and ``graph/dead_params`` for complete windows.
    """

    kinds = (UNREACHABLE_PARAMS, UNUSED_PARAMS, DEAD_PARAMS, DDP_UNUSED)

    def __init__(self) -> None:
        self._unreached: dict[str, str]  # optimizer parameters the walk missed, by name: why, until confirmed
        self.add_state("_unreached", {}, key="unreached")
        self._walked = False  # a loss of the walk batch was walked
        self._compiled: bool  # a walked loss of this fit went through a torch.compile'd region
        self.add_state("_compiled", False, persistent=False)
        self._reached: set[int] = set()
        self._ran: dict[int, bool] = {}
        self._regions: list[str] = []  # the fit's torch.compile'd modules (compiled_modules' names)
        self._hookable: list[nn.Module] = []  # the modules outside them
        self._hooks: list[RemovableHandle] = []

    def on_train_start(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._regions, self._hookable = compiled_modules(pl_module)

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        fit.streaks.clear()
        self._walked = False
        self._reached.clear()
        self._ran.clear()
        self._hooks = [m.register_forward_hook(self._note_forward) for m in self._hookable]

    def _note_forward(self, module: nn.Module, *_: Any) -> None:
        if not in_extra_forward():
            self._ran[id(module)] = self._ran.get(id(module), False) or torch.is_grad_enabled()

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        self._walked = True
        self._compiled = self._compiled or any(type(n).__name__ == "CompiledFunctionBackward" for n in walk.nodes)
        self._reached.update(id(t) for t in walk.leaves)

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        if checked:
            fit.streaks.update(k, fit.opt_params[k])

    def on_train_batch_end(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not fit.walk_batch:
            return
        self.teardown()
        if not self._walked:  # no backward ran in this batch
            return
        unreached = [n for n, p in fit.tracked if p.requires_grad and id(p) not in self._reached]
        reasons = unreached_reasons(pl_module, unreached, self._ran, self._regions)
        ddp = _ddp_without_unused_search(trainer)
        if not ddp:
            self._unreached = {n: why for n, why in reasons.items() if id(fit.params_by_name[n]) in fit.opt_of}
        self._record_unreachable(fit, {n: why for n, why in reasons.items() if n not in self._unreached}, ddp)

    def _record_unreachable(self, fit: Fit, reasons: dict[str, str], ddp: bool = False) -> None:
        if not reasons:
            return
        names = tuple(reasons)
        fit.record(
            UNREACHABLE_PARAMS,
            names,
            f"{len(names)} trainable parameter(s) cannot be reached from the loss and will get no gradient: "
            + "; ".join(dict.fromkeys(reasons.values()))
            + "."
            + (
                " This run's DDP (find_unused_parameters=False) waits for their gradients and fails at the next "
                "step: strategy='ddp_find_unused_parameters_true', or remove or freeze them."
                if ddp
                else ""
            ),
        )

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        n = fit.dead_after_steps
        # A window the end of the run cut short has no verdict on unused or dead parameters: its streaks
        # are shorter than n, and a 0 logged for it would read as "all parameters train".
        unused, dead = fit.streaks.at_least(n) if complete else ((), ())
        self._record_unreachable(fit, {name: why for name, why in self._unreached.items() if name in unused})
        self._unreached = {}
        if unused:
            fit.record(
                UNUSED_PARAMS,
                unused,
                f"{len(unused)} parameter(s) got no gradient (`.grad` is None) at {counted(n, 'optimizer step')} "
                "in a row: "
                f"{listed(unused)}. They are not in the loss's graph; the optimizer skips them. A branch taken only "
                "on some batches (an expert that got no tokens) looks the same for a while: if these train later, "
                "raise dead_after_steps.",
            )
            self._predict_ddp(fit, trainer, unused)
        if dead:
            fit.record(
                DEAD_PARAMS,
                dead,
                f"{len(dead)} parameter(s) had a gradient of exactly zero at {counted(n, 'optimizer step')} in a row: "
                f"{listed(dead)}. They are in the graph but the gradient is blocked (a ReLU or clamp of values "
                "that are always negative, a multiplication by zero, a saturated activation)."
                + (
                    " In a torch.compile'd region, a parameter whose output does not reach the loss also gets a "
                    "gradient of zeros rather than none."
                    if self._compiled
                    else ""
                ),
            )
        if not complete:
            return {}
        return {
            UNUSED_PARAMS.window_tag: float(len(unused)),
            DEAD_PARAMS.window_tag: float(len(dead)),
        }

    @staticmethod
    def _predict_ddp(fit: Fit, trainer: "pl.Trainer", unused: tuple[str, ...]) -> None:
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel) and ddp.find_unused_parameters:
            return
        now = (
            "This run uses DDP with find_unused_parameters=False: the next step fails"
            if isinstance(ddp, DistributedDataParallel)
            else "Under DDP with find_unused_parameters=False (the default of strategy='ddp') the next step fails"
        )
        fit.record(
            DDP_UNUSED,
            unused,
            f"{now} with 'Expected to have finished reduction in the prior iteration': the reducer waits for "
            f"gradients of {listed(unused)} that never come. Fix: strategy='ddp_find_unused_parameters_true' "
            "(DDPStrategy(find_unused_parameters=True)), or, if they are not meant to train, remove or freeze them.",
        )

    def on_exception(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        self.teardown()  # before a diagnosis re-runs the step

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
