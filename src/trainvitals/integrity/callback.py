"""Check the computation graph behind each loss, and say in plain words what is wrong and where.

Backpropagation only reaches what the graph connects. A detached loss, a head the loss never uses,
layers kept in a plain Python list, a hidden state carried across steps: each either wastes hours
before anyone notices or fails with an error that names no culprit. :class:`GraphIntegrityCallback`
finds them, with one check a class (:mod:`trainvitals.integrity.checks`, one file each, whose docstring
says what it finds and logs): at fit start (optimizers), before each backward (the loss), on a schedule
in a check window (a walk of its first batch's graph, then ``dead_after_steps`` checked optimizer steps),
at optimizer steps, and on an exception (a diagnosis of autograd's classic errors, added to it as a note).

Findings go to :attr:`GraphIntegrityCallback.findings`, a warning once per kind (rank zero), and a
markdown table at the end of fit (:meth:`GraphIntegrityCallback.summary_markdown`, printed and logged
as the text panel ``graph/findings``). ``strict=True`` raises :class:`GraphIntegrityError` at the first
finding instead, on all ranks at the same step.

Metrics, logged when a check window closes (at its last optimizer step, ``trainer.global_step - 1``, as every
callback's step): per kind of finding, ``graph/findings_<kind>``, how many times it was found so far, and,
for some, its count in that window, ``graph/<metric>`` (:func:`~trainvitals.integrity.checks.finding_kinds`
lists the kinds, each with its metric and what ``trainvitals report`` makes of it;
:func:`~trainvitals.integrity.checks.window_labels` every window metric, in words).

This module runs the check windows, calls the registered checks' hooks in turn, and logs and raises what
they find. The analysis is torch-only: :mod:`trainvitals.integrity.graph` (walks),
:mod:`trainvitals.integrity.tracer` (the step tracer) and :mod:`trainvitals.integrity.diagnoses` (streaks,
reasons, diagnoses).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_callable, check_int
from trainvitals.integrity.checks import registered_checks
from trainvitals.integrity.checks.base import HOOKS, Checks, Fit, overriding
from trainvitals.integrity.findings import NOTHING_CHECKED, Finding, FindingKind, GraphIntegrityError
from trainvitals.integrity.graph import first_tensor, sequence_mark, walk_graph
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.sharing import RESTORED_SUMMARY, SUMMARY
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.text.markdown import markdown_table
from trainvitals.text.prose import listed
from trainvitals.text.terminal import markdown_to_text


class GraphIntegrityCallback(TrainvitalsCallback):
    r"""Check the autograd graph behind each loss and diagnose autograd errors.

    Cost: every step, a few attribute reads and one ``loss.detach()`` kept for a finiteness check that
    runs, with one host sync, when a check window closes. Every ``check_every_n_steps`` optimizer
    steps a window opens: its first batch walks the graph (O(graph nodes), Python only, with module forward
    hooks noting which modules ran); then, for ``dead_after_steps`` optimizer steps per
    optimizer, gradients are checked: the first check reads every gradient once (a min/max per tensor,
    one host sync), later ones only the gradients that were zero so far. The window's close syncs once
    more and logs. Under manual optimization the leak check may read gradients left after a step (one
    sync). ``strict=True`` syncs every step (finiteness, and the raise decision under DDP).

    Works with manual optimization and several optimizers (gradients are checked per optimizer at its
    step), and with ``torch.compile``: a compiled region is one ``CompiledFunctionBackward`` node, so the
    walk sees the parameters it uses and stale inputs fed to it, not the operations inside; no module
    hook is put inside it (one would fail a guard and compile its graphs again), so for an unreachable
    parameter there it cannot say whether its module ran. Its own forwards (the batch-independence check,
    a diagnosis's re-run) run eagerly and are not taken for the step's: they compile nothing. Diagnoses
    that re-run the step (a loss without ``grad_fn``, an in-place error without an optimizer step behind
    it) need automatic optimization on one process; elsewhere they say less.
    Stale-graph detection reads autograd's private sequence counter (``torch.autograd._get_sequence_nr``,
    present in torch 2.13); a torch without it skips that check.

    Args:
        check_every_n_steps: optimizer steps between the starts of two check windows (the first at
            step 0). Must be >= 1.
        dead_after_steps: a parameter is reported unused or dead after this many consecutive checked
            optimizer steps (of its optimizer) without a gradient or with an exactly zero one; also the
            length of a window. Must be >= 1 and <= ``check_every_n_steps``.
        detect_anomaly_steps: run the batches that start before optimizer step N under
            ``torch.autograd`` anomaly detection (NaN checks on): the one-batch self-test before a long
            run; anomaly mode also records each node's forward traceback, which the diagnoses quote.
            Must be >= 0.
        check_batch_independence: on the first batch, check that output i does not depend on input
            j ≠ i (catches ``view``/``permute`` bugs that mix examples). BatchNorm layers in training
            mode run in eval mode for this check (it says so).
        batch_input: maps a batch to the model's input for that check; default: the first tensor of
            the batch. The model is called as ``pl_module(x)``.
        strict: raise :class:`GraphIntegrityError` at the first finding instead of warning; a param group
            at lr 0 is only reported (it may be kept fixed on purpose).
        verbose: also print the findings table at the end of training. By default the terminal gets
            the one line at fit end; the table goes to TensorBoard (``graph/findings``), ``trainvitals
            report`` and :meth:`summary_markdown`.

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range (named in the message).
        GraphIntegrityError: with ``strict=True``, during training, at the first finding.
    """

    provides = (SUMMARY, RESTORED_SUMMARY)

    def __init__(
        self,
        check_every_n_steps: int = 50,
        dead_after_steps: int = 3,
        detect_anomaly_steps: int = 0,
        check_batch_independence: bool = False,
        batch_input: Callable[[Any], Tensor] | None = None,
        strict: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.dead_after_steps = check_int("dead_after_steps", dead_after_steps, 1, self.check_every_n_steps)
        self.detect_anomaly_steps = check_int("detect_anomaly_steps", detect_anomaly_steps, 0)
        self.check_batch_independence = check_bool("check_batch_independence", check_batch_independence)
        self.batch_input = check_callable("batch_input", batch_input, none_ok=True) or first_tensor
        self.strict = check_bool("strict", strict)
        self.verbose = check_bool("verbose", verbose)
        self.key_state_by(check_every_n_steps=self.check_every_n_steps, dead_after_steps=self.dead_after_steps)

        # The state of a fit that has not started: the counts, the findings, the check window, the checks.
        self.add_state("_raise_at_batch_start", False, persistent=False)
        self.add_state("_walks", 0, key="walks")
        self.add_state("_grad_checks", 0, key="grad_checks")
        self._fit: Fit
        self.add_state("_fit", functools.partial(Fit, self.strict, self.dead_after_steps, self.message), key="fit")
        self._checks: Checks
        self.add_state("_checks", self._build_checks, key="checks")
        self._hooks = {hook: overriding(self._checks, hook) for hook in HOOKS}

    @override
    def reset(self) -> None:
        """The declared state back to its defaults (new checks among them), and the hooks of the new checks."""
        super().reset()
        self._hooks = {hook: overriding(self._checks, hook) for hook in HOOKS}

    def _build_checks(self) -> Checks:
        """The registered checks this callback's arguments turn on, in their order: the order their hooks are
        called in (the order of findings within a hook)."""
        return Checks(check for cls in registered_checks() if (check := cls.build(self)) is not None)

    @property
    def findings(self) -> list[Finding]:
        """Every problem found in this fit, the first time each (kind, names) was."""
        return self._fit.findings

    @property
    def counts(self) -> dict[FindingKind, int]:
        """Per kind, how many times it was found in this fit."""
        return self._fit.counts

    # ------------------------------------------------------------------------------------ the hooks

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        fit = self._fit
        fit.mark = sequence_mark()
        fit.step = trainer.global_step
        fit.start(trainer, pl_module)
        self._call("on_train_start", trainer, pl_module)
        self._raise_at_batch_start = True  # the first batch's checks (batch mixing) raise before its step
        self._maybe_raise(trainer)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        fit = self._fit
        fit.batch, fit.batch_idx = batch, batch_idx
        step = fit.step = trainer.global_step
        self._call("on_train_batch_start", trainer, pl_module, batch)
        if self._raise_at_batch_start:
            self._raise_at_batch_start = False
            self._maybe_raise(trainer)
        if not fit.window_open and step >= fit.next_check:
            self._open_window(trainer, step)

    def _open_window(self, trainer: "pl.Trainer", step: int) -> None:
        fit = self._fit
        fit.window_open = True
        fit.window_left = self.dead_after_steps * max(1, len(trainer.optimizers))
        fit.next_check = step + self.check_every_n_steps
        fit.walk_batch = True
        self._walks += 1
        self._call("on_window_open", trainer)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        # No collective here (a strict raise decision, a loss sync): under manual optimization ranks can run
        # different numbers of backwards. Both wait for the batch end.
        fit = self._fit
        fit.last_loss = loss
        if loss.grad_fn is not None:
            fit.losses.append(loss.grad_fn)
        self._call("on_before_backward", trainer, pl_module, loss)
        if fit.walk_batch:
            self._call("on_walk", trainer, pl_module, loss, walk_graph(loss, fit.mark))

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        fit = self._fit
        if pl_module.automatic_optimization:
            # Backward is over; Lightning still holds the loss, so its graph is freed there, not here.
            fit.release_graph()
        k = fit.opt_index.get(id(optimizer))
        if k is None:
            return
        fit.stepped.append(k)
        checked = fit.window_open and fit.window_left > 0
        if checked:
            fit.window_left -= 1
            self._grad_checks += 1
        self._call("on_before_optimizer_step", trainer, pl_module, k, checked)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        fit = self._fit
        self._call("on_train_batch_end", trainer, pl_module)
        fit.walk_batch = False
        if fit.window_open and (fit.window_left <= 0 or trainer.global_step >= fit.next_check):
            self._close_window(trainer)
        elif self.strict:  # a non-finite loss raises at the end of its step
            self._call("on_sync", trainer)
        fit.end_batch()
        # Nodes created from here on belong to the next step, including its batch-transfer hooks
        # (``on_after_batch_transfer`` runs before ``on_train_batch_start``).
        fit.mark = sequence_mark()
        self._maybe_raise(trainer)

    def _close_window(self, trainer: "pl.Trainer") -> None:
        fit = self._fit
        fit.window_open = False
        complete = fit.window_left <= 0
        metrics = self._call("on_window_close", trainer, complete)
        # At the last optimizer step the window checked, as every callback logs a step: global_step is past it.
        log_scalars(trainer, {**metrics, **self._count_metrics()}, step=max(trainer.global_step - 1, 0))

    def _call(self, hook: str, *args: Any) -> dict[str, float]:
        """Call the checks' ``hook`` (those that override it, in order) with the Fit and ``args``; returns the
        metrics they return (``on_window_close``, ``on_sync``)."""
        metrics: dict[str, float] = {}
        for call in self._hooks[hook]:
            metrics.update(call(self._fit, *args) or {})
        return metrics

    def _count_metrics(self) -> dict[str, float]:
        return {k.counter: float(v) for k, v in self.counts.items()}

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._call("on_exception", trainer, pl_module, exception)
        self.teardown(trainer, pl_module, "fit")
        if self.counts:
            # The run ends here, before any check window closes: log the counters now, so that
            # ``trainvitals report`` sees why it failed.
            log_scalars(trainer, self._count_metrics(), step=trainer.global_step)
        self._publish(trainer)

    # ------------------------------------------------------------------------- findings, strict, end

    def _maybe_raise(self, trainer: "pl.Trainer") -> None:
        if not self.strict:
            return
        fit = self._fit
        if trainer.strategy.reduce_boolean_decision(fit.pending is not None, all=False):
            pending, fit.pending = fit.pending, None
            if pending is None:
                raise GraphIntegrityError(self.message("another rank found a graph problem."))
            raise GraphIntegrityError(self.message(pending.message, pending.kind.value))

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: how much was checked, the findings by kind, and the headline one in words:
        the first of a kind that breaks a run (the report's critical ones), else the first."""
        checked = f"{self._walks} graph walk(s) and {self._grad_checks} gradient check(s)"
        if not self.findings and not (self._walks or self._grad_checks):
            return (
                "nothing checked: no graph walk and no gradient check ran (the run may have ended before its "
                "first step)."
            )
        if not self.findings:
            return f"clean: no findings in {checked}."
        kinds = sorted({f.kind.value for f in self.findings})
        critical = [f for f in self.findings if f.kind.critical is not None]
        first = (critical or self.findings)[0]
        return (
            f"{len(self.findings)} finding(s) in {checked} ({', '.join(kinds)}); first "
            f"{'breaking the run' if critical else 'of them'}, at step {first.step} [{first.kind.value}]: "
            f"{_first_sentence(first.message)} The full table: the Text tab's graph/findings, or trainvitals report."
        )

    def summary_markdown(self) -> str:
        """The findings as a markdown table (step, kind, names, message), or a clean bill of health (of at least
        one walk or gradient check: else :data:`~trainvitals.integrity.findings.NOTHING_CHECKED`)."""
        if not self.findings and not (self._walks or self._grad_checks):
            return NOTHING_CHECKED
        if not self.findings:
            return (
                f"**Graph integrity: clean bill of health.** No findings in {self._walks} graph walk(s) and "
                f"{self._grad_checks} gradient check(s)."
            )
        rows = [(f.step, f.kind.value, listed(f.names), f.message) for f in self.findings]
        return "\n".join(markdown_table(("step", "kind", "names", "finding"), rows, align="r"))

    def _publish(self, trainer: "pl.Trainer") -> None:
        table = self.summary_markdown()
        log_text(trainer, "graph/findings", table, step=trainer.global_step)
        if self.verbose:
            self.info(f"findings\n{markdown_to_text(table)}")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._fit.window_open:
            self._close_window(trainer)
        elif any((metrics := self._call("on_sync", trainer)).values()):  # after the last window: still on the charts
            log_scalars(trainer, {**metrics, **self._count_metrics()}, step=max(trainer.global_step - 1, 0))
        self._publish(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        for check in self._checks:
            check.teardown()
        self._fit.end_batch()


_SENTENCE_END = re.compile(r"(?<=[\w)`'\]])\.\s+(?=[A-Z])")


def _first_sentence(message: str) -> str:
    """A finding's first sentence, with its full stop: what is wrong, before the why and the fix."""
    head = _SENTENCE_END.split(message.strip(), maxsplit=1)[0].rstrip(".")
    return head + "."
