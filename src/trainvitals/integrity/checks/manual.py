"""Under manual optimization: gradients left over from an optimizer's previous step, and an optimizer that
steps before the backward that gives its parameters their gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import all_zero
from trainvitals.text.prose import listed

if TYPE_CHECKING:
    import lightning.pytorch as pl

GRAD_LEAK = FindingKind("grad_leak", warning="gradients left over from an earlier step (manual optimization)")
STEP_BEFORE_BACKWARD = FindingKind(
    "step_before_backward",
    critical="an optimizer stepped before the backward that gives its parameters their gradients ({n}): they "
    "never train",
)


@register_check(order=70)
class GradLeakCheck(Check):
    """During a window: an optimizer that steps again before a backward started with its gradients zeroed
    (cleared by ``zero_grad``) stepped with gradients left over from before its previous step."""

    kinds = (GRAD_LEAK,)

    def __init__(self) -> None:
        self._stale_opts: set[int] = set()  # optimizers that stepped and were not cleared since

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._stale_opts.clear()

    def on_before_backward(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor
    ) -> None:
        """An optimizer that stepped is cleared once a backward starts with its gradients zeroed."""
        if not fit.window_open or pl_module.automatic_optimization:
            return
        for k in list(self._stale_opts):
            grads = [p.grad for _, p in fit.opt_params[k] if p.grad is not None]
            if not grads or bool(all_zero(grads).all()):
                self._stale_opts.discard(k)

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        if not checked or pl_module.automatic_optimization:
            return
        if k in self._stale_opts:
            names = tuple(n for n, _ in fit.opt_params[k])
            fit.record(
                GRAD_LEAK,
                names,
                f"Optimizer {k} ({type(trainer.optimizers[k]).__name__}, parameters {listed(names)}) stepped with "
                "gradients left over from before its previous step: no zero_grad cleared them, so the gradients of "
                "every loss back-propagated since (including losses meant for another optimizer) were added up. "
                "Call `opt.zero_grad()` before the backward meant for this optimizer.",
            )
        self._stale_opts.add(k)


@register_check(order=80)
class StepOrderCheck(Check):
    """On every batch under manual optimization (an optimizer may step once in many batches; one attribute
    read per parameter and step): a parameter without ``.grad`` at its last optimizer step of the batch
    that holds one at the batch's end got it from a backward after every step: it is in the graph, not
    unused (``fit.streaks`` is told), and no step used its gradient. One batch may do that legitimately
    (accumulation by hand that steps the previous window first); ``dead_after_steps`` of its stepping
    batches in a row are a finding. Its own streaks are not saved: a resumed run counts them afresh.
    """

    kinds = (STEP_BEFORE_BACKWARD,)

    def __init__(self) -> None:
        # The trainable parameters without a .grad at their last optimizer step of this batch so far, with
        # that optimizer's index.
        self._gradless: dict[str, tuple[int, Tensor]] = {}
        # Per parameter, its stepping batches in a row whose gradient came only after its last step.
        self._late_streak: dict[str, int] = {}

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        if pl_module.automatic_optimization:
            return
        for name, p in fit.opt_params[k]:
            if p.grad is not None:
                self._gradless.pop(name, None)
            elif p.requires_grad:
                self._gradless[name] = (k, p)

    def on_train_batch_end(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if pl_module.automatic_optimization:
            return
        late = {n: k for n, (k, p) in self._gradless.items() if p.grad is not None}
        self._gradless = {}
        stepped = set(fit.stepped)
        for name in [n for n in self._late_streak if n not in late]:  # stepped on time: the streak ends
            if fit.opt_of.get(id(fit.params_by_name[name])) in stepped:
                del self._late_streak[name]
        for name in late:
            self._late_streak[name] = self._late_streak.get(name, 0) + 1
        fit.streaks.got_gradient(tuple(late))
        n = fit.dead_after_steps
        flagged = [name for name in late if self._late_streak[name] == n]
        for k in dict.fromkeys(late[name] for name in flagged):
            names = tuple(name for name in flagged if late[name] == k)
            fit.record(
                STEP_BEFORE_BACKWARD,
                names,
                f"Optimizer {k} ({type(trainer.optimizers[k]).__name__}) stepped before the backward that gives "
                f"{listed(names)} their gradients, in {n} of its batches in a row: at its step their "
                "`.grad` was None, so the step left them unchanged, and the next zero_grad() throws the gradient "
                "away: they never train. Call `self.manual_backward(loss)` before `opt.step()`.",
            )
