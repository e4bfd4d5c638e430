"""What every integrity check is (:class:`Check`) and what the checks of one fit share (:class:`Fit`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.autograd.graph import Node

import trainvitals
from trainvitals.integrity.diagnoses import Rerun
from trainvitals.integrity.findings import Finding, FindingKind
from trainvitals.integrity.graph import GraphWalk, tensor_names
from trainvitals.integrity.tracer import GraphTracer
from trainvitals.plumbing.base import DeclaredState
from trainvitals.plumbing.rerun import rerun_quietly

# A diagnosis points at the user's code: frames in Lightning and trainvitals are not the culprit.
_SKIP_DIRS = (os.path.dirname(pl.__file__), os.path.dirname(trainvitals.__file__))


class Fit:
    """What the checks of one fit share: the findings, who owns which parameter, the check window, the batch.

    :class:`~trainvitals.integrity.callback.GraphIntegrityCallback` keeps it up to date before
    it calls the checks' hooks; checks read it and file findings with :meth:`record`.

    Attributes:
        findings: every problem found, the first time each (kind, names) was; ``counts``: per kind, how
            many times it was found; ``pending``: with ``strict``, the first finding not raised yet.
        dead_after_steps: the callback's argument: checked optimizer steps in a row that make a finding.
        message: the callback's :meth:`~trainvitals.plumbing.base.TrainvitalsCallback.message`: a check's
            text with the callback's prefix (and a finding's kind in brackets).
        names: ``id(tensor) -> name`` in the model (``tensor_names``).
        tracked: ``(name, parameter)`` of every parameter in an optimizer or registered on the model.
        opt_params: per optimizer (``trainer.optimizers`` order), its ``(name, parameter)`` pairs.
        opt_of: ``id(parameter) -> index`` of its first optimizer.
        window_open, window_left, next_check: the check window: open, checked optimizer steps left in it,
            the optimizer step at which the next one opens.
        walk_batch: this batch is the first of a window: its losses are walked.
        step: ``trainer.global_step`` when the batch started; ``mark``: its ``sequence_mark``.
        batch, batch_idx: the batch under way; ``losses``: the ``grad_fn`` of its losses so far;
            ``last_loss``: the last loss handed to backward; ``stepped``: the optimizers that stepped in it.
    """

    def __init__(self, strict: bool, dead_after_steps: int, message: Callable[[str, str | None], str]) -> None:
        self.strict = strict
        self.dead_after_steps = dead_after_steps
        self.message = message
        self.findings: list[Finding] = []
        self.counts: dict[FindingKind, int] = {}
        self.warned: set[FindingKind] = set()  # kinds warned about (once each, rank zero)
        self.pending: Finding | None = None
        self.names: dict[int, str] = {}
        self.tracked: list[tuple[str, Tensor]] = []
        self.params_by_name: dict[str, Tensor] = {}
        self.opt_params: list[list[tuple[str, Tensor]]] = []
        self.opt_of: dict[int, int] = {}
        self.opt_index: dict[int, int] = {}  # id(optimizer) -> index in trainer.optimizers
        self.device = torch.device("cpu")  # the module's: where a reduction over ranks happens
        self.window_open = False
        self.window_left = 0
        self.next_check = 0
        self.walk_batch = False
        self.step = 0
        self.mark: int | None = None
        self.batch: Any = None
        self.batch_idx = 0
        self.losses: list[Node] = []
        self.last_loss: Tensor | None = None
        self.stepped: list[int] = []

    def record(self, kind: FindingKind, names: tuple[str, ...], message: str, warn: bool = True) -> Finding:
        """Count a finding of ``kind`` naming ``names``; keep it if new, warn once per kind; returns the kept one."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        finding = self._existing(kind, names)
        if finding is None:
            finding = Finding(kind, names, message, self.step)
            self.findings.append(finding)
        if warn and kind not in self.warned:
            self.warned.add(kind)
            rank_zero_warn(self.message(message, kind.value))
        if self.strict and kind.spec.strict and self.pending is None:
            self.pending = finding
        return finding

    def found(self, kind: FindingKind, names: tuple[str, ...]) -> bool:
        """This fit has a finding of ``kind`` naming ``names`` already (a resumed fit: restored from its
        checkpoint). A check that looks once per fit, at its start, files only what is not."""
        return self._existing(kind, names) is not None

    def _existing(self, kind: FindingKind, names: tuple[str, ...]) -> Finding | None:
        return next((f for f in self.findings if f.kind is kind and f.names == names), None)

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Build the fit-time maps: names, and which optimizer owns which parameter."""
        self.names = tensor_names(pl_module)
        self.opt_params, self.opt_of = [], {}
        self.opt_index = {id(opt): k for k, opt in enumerate(trainer.optimizers)}
        tracked: dict[int, tuple[str, Tensor]] = {id(p): (n, p) for n, p in pl_module.named_parameters()}
        for k, opt in enumerate(trainer.optimizers):
            params = [p for group in opt.param_groups for p in group["params"]]
            named = [(self.names.get(id(p), f"optimizer{k}.param{i}"), p) for i, p in enumerate(params)]
            self.opt_params.append(named)
            for name, p in named:
                self.opt_of.setdefault(id(p), k)
                tracked.setdefault(id(p), (name, p))
        self.tracked = list(tracked.values())
        self.params_by_name = dict(self.tracked)
        self.device = pl_module.device

    def state_dict(self) -> dict[str, Any]:
        """The findings and the check window (floats, strings and lists: a checkpoint that JSON can read)."""
        return {
            "next_check": self.next_check,
            "window_open": self.window_open,
            "window_left": self.window_left,
            "counts": {k.value: v for k, v in self.counts.items()},
            "findings": [{**asdict(f), "kind": f.kind.value, "names": list(f.names)} for f in self.findings],
            "warned": sorted(k.value for k in self.warned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_check = int(state.get("next_check", 0))
        self.window_open = bool(state.get("window_open", False))
        self.window_left = int(state.get("window_left", 0))
        self.counts = {FindingKind(k): int(v) for k, v in state.get("counts", {}).items()}
        self.findings = [
            Finding(FindingKind(f["kind"]), tuple(f["names"]), f["message"], int(f["step"]))
            for f in state.get("findings", [])
        ]
        self.warned = {FindingKind(k) for k in state.get("warned", [])}

    def end_batch(self) -> None:
        self.release_graph()
        self.batch = None
        self.stepped = []

    def release_graph(self) -> None:
        self.losses = []
        self.last_loss = None

    @staticmethod
    def optimizer(trainer: "pl.Trainer", k: int) -> str:
        """``"optimizer 0 (SGD)"``."""
        return f"optimizer {k} ({type(trainer.optimizers[k]).__name__})"

    def rerun_if_possible(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Rerun | None:
        """Re-runs the batch's ``training_step`` under a :class:`GraphTracer`, where that is safe."""
        # Manual optimization would step optimizers again; several ranks could wait in a collective.
        if pl_module.automatic_optimization and trainer.world_size == 1 and self.batch is not None:
            return functools.partial(self._rerun, pl_module)
        return None

    def _rerun(self, pl_module: "pl.LightningModule") -> tuple[GraphTracer, Any]:
        """Run ``training_step`` on the current batch again under a :class:`GraphTracer`; returns the
        tracer and the loss the step returned.

        Used only when the step is failing anyway; it leaves no trace (:func:`rerun_quietly`).
        """
        with rerun_quietly(pl_module), torch.enable_grad(), GraphTracer(pl_module, _SKIP_DIRS) as tracer:
            output = pl_module.training_step(self.batch, self.batch_idx)
        return tracer, output.get("loss") if isinstance(output, dict) else output


class Check(DeclaredState):
    """One integrity check: the hooks it needs, its state, its finding kinds and their messages.

    :class:`~trainvitals.integrity.callback.GraphIntegrityCallback` calls each hook of the
    checks that override it, in the order of its checks, with the shared :class:`Fit` first. The
    hooks are Lightning's, and four of the callback's schedule: a check window opens
    (``on_window_open``), a loss of its first batch was walked (``on_walk``), the window closes
    (``on_window_close``), a point every rank reaches outside a close (``on_sync``). Its state is
    declared (:meth:`~trainvitals.plumbing.base.DeclaredState.add_state`, in ``__init__``): the callback
    builds its checks afresh for each fit and saves each check's persistent states under its class name.

    Attributes:
        kinds: the finding kinds this check files.
    """

    kinds: tuple[FindingKind, ...] = ()

    def on_train_start(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The fit's maps are built; the first batch has not started."""

    def on_train_batch_start(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any
    ) -> None:
        """A batch starts (before a window opens at it)."""

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        """A check window opens at this batch."""

    def on_before_backward(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor
    ) -> None:
        """A loss goes to backward; no collective here (ranks may run different numbers of backwards)."""

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        """A loss of a window's first batch was walked (``fit.mark`` separates this step's nodes)."""

    def on_before_optimizer_step(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", k: int, checked: bool
    ) -> None:
        """Optimizer ``k`` is about to step with this step's gradients; ``checked``: a step of the window."""

    def on_train_batch_end(self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The batch is over (before a window closes at it)."""

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        """The window closes (a point every rank reaches); ``complete``: all its steps were checked.
        Returns the window's metrics to log."""
        return {}

    def on_sync(self, fit: Fit, trainer: "pl.Trainer") -> dict[str, float]:
        """A point every rank reaches outside a window's close (a strict run's batch end, the end of
        training after the last window). Returns metrics worth logging there."""
        return {}

    def on_exception(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        """The fit failed with ``exception``."""

    def teardown(self) -> None:
        """Remove whatever the check installed (hooks)."""


class Checks(list):  # list[Check]
    """A fit's checks in the order their hooks are called; one declared state of the callback, saved as
    ``{check class name: its state}``."""

    def state_dict(self) -> dict[str, Any]:
        return {type(check).__name__: check.state_dict() for check in self}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for check in self:
            if type(check).__name__ in state:
                check.load_state_dict(state[type(check).__name__])


HOOKS = tuple(name for name in vars(Check) if name.startswith("on_"))
"""The hooks the callback calls on its checks."""


def overriding(checks: Sequence[Check], hook: str) -> list[Callable[..., Any]]:
    """The ``hook`` methods of the ``checks`` that override it, bound, in order: a step calls only those."""
    return [getattr(check, hook) for check in checks if getattr(type(check), hook) is not getattr(Check, hook)]
