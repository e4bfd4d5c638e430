"""What every integrity check is (:class:`Check`), how one is registered (:func:`register_check`), and what
the checks of one fit share (:class:`Fit`).

A check is one class in one file of this package: it declares its finding kinds
(:class:`~trainvitals.integrity.findings.FindingKind`, their report rows) in that file and is registered
with ``@register_check(order=...)``; the package imports every file in it, so the callback runs it and
``trainvitals report`` reads its kinds. No Lightning import at import time (the report imports the checks);
the hooks receive Lightning's objects.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # Lightning's own, without importing Lightning
from torch import Tensor
from torch.autograd.graph import Node

import trainvitals
from trainvitals.integrity.diagnoses import GradientStreaks, Rerun
from trainvitals.integrity.findings import Finding, FindingKind
from trainvitals.integrity.graph import GraphWalk, tensor_names
from trainvitals.integrity.tracer import GraphTracer
from trainvitals.plumbing.state import DeclaredState

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from trainvitals.integrity.callback import GraphIntegrityCallback


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
        streaks: the unused/dead gradient streaks of the window's checked steps (filled by
            ``ReachabilityCheck``; a gradient that comes after its step ends one, ``StepOrderCheck``).
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
        self.streaks = GradientStreaks()
        self.walk_batch = False
        self.step = 0
        self.mark: int | None = None
        self.batch: Any = None
        self.batch_idx = 0
        self.losses: list[Node] = []
        self.last_loss: Tensor | None = None
        self.stepped: list[int] = []

    def record(
        self, kind: FindingKind, names: tuple[str, ...], message: str, warn: bool = True, step: int | None = None
    ) -> Finding:
        """Count a finding of ``kind`` naming ``names``; keep it if new, warn once per kind; returns the kept one.
        ``step``: the optimizer step the finding is of, when not the current one (a window's earlier step)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        finding = self._existing(kind, names)
        if finding is None:
            finding = Finding(kind, names, message, self.step if step is None else step)
            self.findings.append(finding)
        if warn and kind not in self.warned:
            self.warned.add(kind)
            rank_zero_warn(self.message(message, kind.value))
        if self.strict and kind.strict and self.pending is None:
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
            **self.streaks.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_check = int(state.get("next_check", 0))
        self.window_open = bool(state.get("window_open", False))
        self.window_left = int(state.get("window_left", 0))
        self.counts = {finding_kind(k): int(v) for k, v in state.get("counts", {}).items()}
        self.findings = [
            Finding(finding_kind(f["kind"]), tuple(f["names"]), f["message"], int(f["step"]))
            for f in state.get("findings", [])
        ]
        self.warned = {finding_kind(k) for k in state.get("warned", [])}
        self.streaks.load_state_dict(state)

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
        import lightning.pytorch as pl  # loaded by the fit already: only a failing step gets here

        from trainvitals.plumbing.rerun import rerun_quietly

        # A diagnosis points at the user's code: frames in Lightning and trainvitals are not the culprit.
        skip = (os.path.dirname(pl.__file__), os.path.dirname(trainvitals.__file__))
        with rerun_quietly(pl_module), torch.enable_grad(), GraphTracer(pl_module, skip) as tracer:
            output = pl_module.training_step(self.batch, self.batch_idx)
        return tracer, output.get("loss") if isinstance(output, dict) else output


class Check(DeclaredState):
    """One integrity check: the hooks it needs, its state, its finding kinds and their messages.

    :class:`~trainvitals.integrity.callback.GraphIntegrityCallback` calls each hook of the
    checks that override it, in increasing registered ``order`` (:func:`register_check`), with the shared
    :class:`Fit` first. The hooks are Lightning's, and four of the callback's schedule: a check window opens
    (``on_window_open``), a loss of its first batch was walked (``on_walk``), the window closes
    (``on_window_close``), a point every rank reaches outside a close (``on_sync``). Its state is
    declared (:meth:`~trainvitals.plumbing.state.DeclaredState.add_state`, in ``__init__``): the callback
    builds its checks afresh for each fit and saves each check's persistent states under its class name.

    Attributes:
        kinds: the finding kinds this check files (each filed by one check only).
        metrics: ``(metric, label)`` of the window metrics ``graph/<metric>`` it logs besides its kinds' own,
            with the report's words for them.
    """

    kinds: tuple[FindingKind, ...] = ()
    metrics: tuple[tuple[str, str], ...] = ()

    @classmethod
    def build(cls, callback: GraphIntegrityCallback) -> Check | None:
        """The check for a fit of ``callback`` (its arguments as attributes), ``None`` when they turn it off."""
        return cls()

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


_C = TypeVar("_C", bound=type[Check])
_CHECKS: dict[int, type[Check]] = {}  # order -> check


def register_check(order: int) -> Callable[[_C], _C]:
    """Register a :class:`Check` subclass, and the finding kinds it lists, as the check at ``order``.

    The callback builds the registered checks (:meth:`Check.build`) in increasing ``order``: the order
    their hooks are called in, so the order their findings are filed in within a hook, and the order of
    the report's rows. The built-in checks are at 10, 20, ...; a class registered again (a reloaded
    module) replaces its earlier self.

    Example::

        CONSTANT_LOSS = FindingKind("constant_loss", warning="a loss that does not change")

        @register_check(order=95)
        class ConstantLossCheck(Check):
            kinds = (CONSTANT_LOSS,)

    Raises:
        TypeError: if ``order`` is not an int or the decorated object is not a :class:`Check` subclass.
        ValueError: if another check is registered at ``order``, or files one of its kinds' names.
    """
    if isinstance(order, bool) or not isinstance(order, int):
        raise TypeError(f"`order` must be an int, got {order!r}")

    def decorator(check: _C) -> _C:
        if not (isinstance(check, type) and issubclass(check, Check)):
            raise TypeError(f"register_check decorates a Check subclass, got {check!r}")
        others = {o: c for o, c in _CHECKS.items() if not _same_class(c, check)}
        if order in others:
            raise ValueError(f"`order`: {others[order].__name__} is registered at {order} already")
        taken = {kind.value: c for c in others.values() for kind in c.kinds}
        for kind in check.kinds:
            if kind.value in taken:
                raise ValueError(f"{check.__name__}: kind {kind.value!r} is filed by {taken[kind.value].__name__}")
        others[order] = check
        _CHECKS.clear()
        _CHECKS.update(sorted(others.items()))
        return check

    return decorator


def unregister_check(check: type[Check]) -> None:
    """Remove ``check`` (and its kinds) from the registry; one that is not registered is ignored."""
    for order, registered in list(_CHECKS.items()):
        if registered is check:
            del _CHECKS[order]


def _same_class(a: type, b: type) -> bool:
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def registered_checks() -> tuple[type[Check], ...]:
    """The registered checks, in their order."""
    return tuple(_CHECKS.values())


def finding_kinds() -> tuple[FindingKind, ...]:
    """The registered checks' finding kinds: by check order, then as each check lists them."""
    return tuple(kind for check in _CHECKS.values() for kind in check.kinds)


def finding_kind(value: str) -> FindingKind:
    """The registered kind named ``value`` (a checkpoint's findings name their kinds).

    Raises:
        ValueError: if no registered check files a kind of that name.
    """
    kind = next((k for k in finding_kinds() if k.value == value), None)
    if kind is None:
        raise ValueError(f"no registered integrity check files a finding kind {value!r}")
    return kind


def window_labels() -> dict[str, str]:
    """``metric -> label`` of every window metric ``graph/<metric>`` the registered checks log, in their order:
    each check's kinds' metrics, then its other :attr:`Check.metrics`."""
    labels: dict[str, str] = {}
    for check in _CHECKS.values():
        for kind in check.kinds:
            if kind.metric is not None:
                labels[kind.metric] = kind.label or kind.metric.replace("_", " ")
        labels.update(check.metrics)
    return labels
