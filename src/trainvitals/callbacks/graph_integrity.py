"""Check the computation graph behind each loss, and say in plain words what is wrong and where.

Backpropagation only reaches what the graph connects. A detached loss, a head the loss never uses,
layers kept in a plain Python list, a hidden state carried across steps: each either wastes hours
before anyone notices or fails with an error that names no culprit. :class:`GraphIntegrityCallback`
finds them:

- before backward, every step: the loss has no ``grad_fn`` (and why), is not finite, is not a scalar;
- before backward, on a schedule: a walk from ``loss.grad_fn`` to the ``AccumulateGrad`` leaves (and
  into reentrant checkpoint regions of a module) finds trainable parameters the loss cannot reach,
  and why — reported once they also went a window of steps without a gradient (one batch may skip an
  auxiliary head or an expert), at once under DDP with ``find_unused_parameters=False`` —, leaves that
  belong to no optimizer, and nodes created in an earlier step (state carried across steps, named by
  its module attribute);
- after backward (at ``on_before_optimizer_step``, when the gradient of the step is complete, per
  optimizer), during a window of consecutive steps on the same schedule: parameters without a
  gradient (unused) or with an exactly zero one (dead) for ``dead_after_steps`` steps in a row, what
  DDP with ``find_unused_parameters=False`` would make of them, frozen parameters an optimizer still
  changes, and, under manual optimization, gradients left over from before an optimizer's previous
  step and an optimizer that steps before the backward that gives its parameters their gradients;
- on an exception: autograd's three classic errors get a diagnosis naming the tensor, module and
  operation, added to the exception as a note; the original exception propagates unchanged.

Findings go to :attr:`GraphIntegrityCallback.findings`, a warning once per kind (rank zero), and a
markdown table at the end of fit (:meth:`GraphIntegrityCallback.summary_markdown`, printed and logged
as the text panel ``graph/findings``). ``strict=True`` raises :class:`GraphIntegrityError` at the first
finding instead, on all ranks at the same step.

Metrics, logged when a check window closes (step = ``trainer.global_step``), counts for that window:
``graph/unused_params`` and ``graph/dead_params`` (parameters without / with an exactly zero gradient
for ``dead_after_steps`` steps in a row), ``graph/nonfinite_losses`` (summed over ranks),
``graph/leaked_graphs`` (walked losses that reach an earlier step's graph), ``graph/unoptimized_params``
and ``graph/unregistered_params`` (leaves that get gradients but are in no optimizer / not registered
on the module); and ``graph/findings_<kind>``, how many times each kind was found so far.

The analysis is torch-only and lives in :mod:`trainvitals.core.graph` (walks, the tracer) and
:mod:`trainvitals.core.integrity` (streaks, reasons, diagnoses); this module decides when it runs and
what is recorded, logged and raised.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import trainvitals
from trainvitals._validation import check_bool, check_callable, check_int
from trainvitals.callbacks._writers import log_scalars, log_text, note_unrecorded
from trainvitals.core.findings import Finding, FindingKind
from trainvitals.core.graph import (
    AutogradError,
    all_zero,
    batch_mixing,
    batchnorm_in_eval,
    classify_autograd_error,
    first_tensor,
    sequence_mark,
    tensor_names,
    walk_graph,
)
from trainvitals.core.integrity import (
    SHOWN,
    GradientStreaks,
    Rerun,
    describe_stale_graph,
    diagnose_inplace,
    diagnose_no_grad,
    diagnose_second_backward,
    frozen_change_causes,
    listed,
    unreached_reasons,
    why_no_grad,
)
from trainvitals.core.tracer import GraphTracer

# A diagnosis points at the user's code: frames in Lightning and trainvitals are not the culprit.
_SKIP_DIRS = (os.path.dirname(pl.__file__), os.path.dirname(trainvitals.__file__))
_MAX_PENDING_LOSSES = 1024  # losses kept for the finiteness check before they are counted on the device


_ERROR_KIND = {
    AutogradError.NO_GRAD: FindingKind.NO_GRAD_ERROR,
    AutogradError.SECOND_BACKWARD: FindingKind.SECOND_BACKWARD,
    AutogradError.INPLACE: FindingKind.INPLACE_MODIFIED,
}


class GraphIntegrityError(RuntimeError):
    """Raised by :class:`GraphIntegrityCallback` with ``strict=True`` at the first finding."""


def _ddp_without_unused_search(trainer: "pl.Trainer") -> bool:
    """DDP with ``find_unused_parameters=False``: a step in which a parameter gets no gradient fails the next."""
    ddp = trainer.strategy.model
    return isinstance(ddp, DistributedDataParallel) and not ddp.find_unused_parameters


def _ignore(*_: Any, **__: Any) -> None:
    """Stands in for ``self.log`` while a step is re-run for a diagnosis."""


class GraphIntegrityCallback(Callback):
    r"""Check the autograd graph behind each loss and diagnose autograd errors.

    Cost: every step, a few attribute reads and one ``loss.detach()`` kept for a finiteness check that
    runs, with one host sync, when a check window closes. Every ``check_every_n_steps`` optimizer
    steps a window opens: its first batch walks the graph (O(graph nodes), Python only, with a global
    module forward hook noting which modules ran); then, for ``dead_after_steps`` optimizer steps per
    optimizer, gradients are checked: the first check reads every gradient once (a min/max per tensor,
    one host sync), later ones only the gradients that were zero so far. The window's close syncs once
    more and logs. Under manual optimization the leak check may read gradients left after a step (one
    sync). ``strict=True`` syncs every step (finiteness, and the raise decision under DDP).

    Works with manual optimization and several optimizers (gradients are checked per optimizer at its
    step), and with ``torch.compile``: a compiled region is one ``CompiledFunctionBackward`` node, so the
    walk sees the parameters it uses and stale inputs fed to it, not the operations inside; module
    forward hooks do not run inside it, so for an unreachable parameter there it cannot say whether its
    module ran. Diagnoses that re-run the step (a loss without ``grad_fn``, an in-place error without an
    optimizer step behind it) need automatic optimization on one process; elsewhere they say less.
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
        strict: raise :class:`GraphIntegrityError` at the first finding instead of warning.
        verbose: print the findings table at fit end (it goes to TensorBoard either way).

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range (named in the message).
        GraphIntegrityError: with ``strict=True``, during training, at the first finding.
    """

    def __init__(
        self,
        check_every_n_steps: int = 50,
        dead_after_steps: int = 3,
        detect_anomaly_steps: int = 0,
        check_batch_independence: bool = False,
        batch_input: Callable[[Any], Tensor] | None = None,
        strict: bool = False,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.dead_after_steps = check_int("dead_after_steps", dead_after_steps, 1, self.check_every_n_steps)
        self.detect_anomaly_steps = check_int("detect_anomaly_steps", detect_anomaly_steps, 0)
        self.check_batch_independence = check_bool("check_batch_independence", check_batch_independence)
        self.batch_input = check_callable("batch_input", batch_input, none_ok=True) or first_tensor
        self.strict = check_bool("strict", strict)
        self.verbose = check_bool("verbose", verbose)
        # Lightning reads the key in every hook call (profiler names): build it once.
        self._state_key = self._generate_state_key(
            check_every_n_steps=check_every_n_steps, dead_after_steps=dead_after_steps
        )

        self._reset()

        # Fit-time maps, built at train start.
        self._names: dict[int, str] = {}
        self._tracked: list[tuple[str, Tensor]] = []  # every parameter in an optimizer, or registered
        self._params_by_name: dict[str, Tensor] = {}
        self._opt_params: list[list[tuple[str, Tensor]]] = []
        self._opt_of: dict[int, int] = {}  # id(parameter) -> optimizer index
        self._opt_index: dict[int, int] = {}  # id(optimizer) -> index in trainer.optimizers
        self._device = torch.device("cpu")  # the module's: where a reduction over ranks happens

        # Per-batch state.
        self._step = 0  # trainer.global_step when the batch started: the step findings are filed under
        self._mark: int | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._losses: list[Node] = []
        self._last_loss: Tensor | None = None
        self._stepped: list[int] = []
        self._walk_batch = False
        self._walked = False  # a loss of the walk batch was walked
        self._compiled = False  # a walked loss went through a torch.compile'd region
        self._reached: set[int] = set()
        self._ran: dict[int, bool] = {}
        self._walk_counts: dict[str, int] = {}  # what the window's walk found, logged as graph/<key>
        self._hook: Any = None
        self._frozen_versions: list[tuple[str, Tensor, int, int]] = []
        self._stale_opts: set[int] = set()
        # Manual optimization: the trainable parameters without a .grad at their last optimizer step of
        # this batch so far, with that optimizer's index.
        self._gradless: dict[str, tuple[int, Tensor]] = {}
        self._pending_losses: list[Tensor] = []
        self._nonfinite = torch.zeros((), dtype=torch.long)  # non-finite losses counted, not yet flushed
        self._anomaly_prev: tuple[bool, bool] | None = None
        self._pending: Finding | None = None

    def _reset(self) -> None:
        """The state of a fit that has not started: what ``state_dict`` saves, and the step-order streaks,
        which it does not (a resumed run counts them afresh)."""
        self.findings: list[Finding] = []
        self.counts: dict[FindingKind, int] = {}
        self._warned: set[FindingKind] = set()
        self._walks = 0
        self._grad_checks = 0
        self._next_check = 0
        self._window_open = False
        self._window_left = 0
        self._streaks = GradientStreaks()
        # Per parameter, its stepping batches in a row whose gradient came only after its last step.
        self._late_streak: dict[str, int] = {}
        self._independence_done = False
        self._unreached: dict[str, str] = {}  # optimizer parameters the walk missed, by name: why, until confirmed

    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            note_unrecorded(trainer, self)
            # A new fit (another fold, another model) starts afresh: Lightning calls ``setup`` before it loads a
            # checkpoint's callback states, so a resumed fit gets its state back after this, and a state loaded
            # for validate/test with a checkpoint does not carry into a later fit.
            self._reset()

    # ------------------------------------------------------------------------------------ fit start

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._mark = sequence_mark()
        self._compiled = False
        self._step = trainer.global_step
        self._names = tensor_names(pl_module)
        self._opt_params, self._opt_of = [], {}
        self._opt_index = {id(opt): k for k, opt in enumerate(trainer.optimizers)}
        tracked: dict[int, tuple[str, Tensor]] = {id(p): (n, p) for n, p in pl_module.named_parameters()}
        for k, opt in enumerate(trainer.optimizers):
            params = [p for group in opt.param_groups for p in group["params"]]
            named = [(self._names.get(id(p), f"optimizer{k}.param{i}"), p) for i, p in enumerate(params)]
            self._opt_params.append(named)
            for name, p in named:
                self._opt_of.setdefault(id(p), k)
                tracked.setdefault(id(p), (name, p))
        self._tracked = list(tracked.values())
        self._params_by_name = dict(self._tracked)
        self._device = pl_module.device
        for k, named in enumerate(self._opt_params):
            frozen = tuple(n for n, p in named if not p.requires_grad)
            if frozen:
                self._record(
                    trainer,
                    FindingKind.FROZEN_IN_OPTIMIZER,
                    frozen,
                    f"{listed(frozen)} are in optimizer {k} ({type(trainer.optimizers[k]).__name__}) but have "
                    "requires_grad=False: they get no gradient, yet momentum or weight decay still change them "
                    "whenever they hold a `.grad`. Build the optimizer from the trainable parameters only "
                    "(`[p for p in self.parameters() if p.requires_grad]`).",
                )
        self._maybe_raise(trainer)

    # ------------------------------------------------------------------------------------ per batch

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._batch, self._batch_idx = batch, batch_idx
        step = self._step = trainer.global_step
        if self.check_batch_independence and not self._independence_done:
            self._independence_done = True
            self._check_independence(trainer, pl_module, batch)
        if not self._window_open and step >= self._next_check:
            self._open_window(trainer, step)
        if step < self.detect_anomaly_steps and self._anomaly_prev is None:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, True)

    def _open_window(self, trainer: "pl.Trainer", step: int) -> None:
        self._window_open = True
        self._window_left = self.dead_after_steps * max(1, len(trainer.optimizers))
        self._next_check = step + self.check_every_n_steps
        self._streaks.clear()
        self._stale_opts.clear()
        self._walk_batch = True
        self._walks += 1
        self._walked = False
        self._reached.clear()
        self._ran.clear()
        self._walk_counts = dict.fromkeys(("leaked_graphs", "unregistered_params", "unoptimized_params"), 0)
        self._hook = nn.modules.module.register_module_forward_hook(self._note_forward)

    def _note_forward(self, module: nn.Module, *_: Any) -> None:
        self._ran[id(module)] = self._ran.get(id(module), False) or torch.is_grad_enabled()

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        self._last_loss = loss
        if loss.grad_fn is not None:
            self._losses.append(loss.grad_fn)
        self._check_loss(trainer, pl_module, loss)
        if self._walk_batch:
            self._walk(trainer, pl_module, loss)
        if self._window_open and not pl_module.automatic_optimization:
            self._observe_zeroed_grads()
        # No collective here (a strict raise decision, a loss flush): under manual optimization ranks can
        # run different numbers of backwards. Both wait for the batch end.

    def _check_loss(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        if loss.grad_fn is None:
            names, why = why_no_grad(loss, pl_module, trainer.optimizers, self._rerun_if_possible(trainer, pl_module))
            self._record(
                trainer,
                FindingKind.LOSS_NO_GRAD,
                names,
                f"The loss has no grad_fn, so backward cannot reach any parameter: {why}.",
            )
        # manual_backward(loss, gradient) of a non-scalar is legitimate; Lightning's own backward is not.
        elif pl_module.automatic_optimization and loss.numel() != 1:
            self._record(
                trainer,
                FindingKind.LOSS_NOT_SCALAR,
                (),
                f"training_step returned a loss of shape {tuple(loss.shape)}, not a scalar: backward needs one "
                "number. Reduce it (`.mean()` over the batch).",
            )
        if not loss.is_floating_point():
            return
        self._pending_losses.append(loss.detach())
        if len(self._pending_losses) >= _MAX_PENDING_LOSSES:
            self._count_nonfinite()

    def _walk(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        walk = walk_graph(loss, self._mark)
        self._walked = True
        self._compiled = self._compiled or any(type(n).__name__ == "CompiledFunctionBackward" for n in walk.nodes)
        self._reached.update(id(t) for t in walk.leaves)
        if walk.stale:
            self._walk_counts["leaked_graphs"] += 1
            self._record(trainer, FindingKind.STALE_GRAPH, *describe_stale_graph(pl_module, walk.stale, self._mark))
        # Under manual optimization a loss may train something else than the model (a latent code fitted by
        # its own optimizer, test-time adaptation); Lightning's own backward trains the model.
        trainable = {id(p) for _, p in self._tracked if p.requires_grad}
        if pl_module.automatic_optimization and trainable and walk.leaves and not walk.stale and not walk.opaque \
                and not any(id(t) in trainable for t in walk.leaves):
            self._record(
                trainer,
                FindingKind.LOSS_NO_GRAD,
                ("loss reaches no parameter",),
                f"The loss reaches none of the model's parameters: its graph ends in {len(walk.leaves)} tensor(s) "
                "made in the step (a loss rebuilt from its value, `torch.tensor(loss.item(), requires_grad=True)`?). "
                "Return the loss tensor itself.",
            )
        if not self._opt_of:
            return
        unoptimized = [
            t for t in walk.leaves
            if id(t) not in self._opt_of and (isinstance(t, nn.Parameter) or id(t) in self._names)
        ]
        if not unoptimized:
            return
        registered = {id(p) for p in pl_module.parameters()}
        names = tuple(self._names.get(id(t), f"<tensor {tuple(t.shape)}>") for t in unoptimized)
        unregistered = [n for n, t in zip(names, unoptimized) if id(t) not in registered]
        self._walk_counts["unoptimized_params"] += len(names)
        self._walk_counts["unregistered_params"] += len(unregistered)
        which = "they" if len(unregistered) == len(names) else listed(unregistered)
        why = (
            f"{which} are not registered on the module (kept in a plain Python list, dict or attribute): use "
            "nn.ModuleList / nn.ModuleDict / nn.Parameter so that `parameters()` includes them"
            if unregistered
            else "they are registered, but configure_optimizers left them out"
        )
        self._record(
            trainer,
            FindingKind.UNOPTIMIZED_LEAVES,
            names,
            f"{listed(names)} receive gradients but belong to no optimizer param group, so they never change: "
            f"{why}.",
        )

    def _observe_zeroed_grads(self) -> None:
        """An optimizer that stepped is cleared once a backward starts with its gradients zeroed."""
        for k in list(self._stale_opts):
            grads = [p.grad for _, p in self._opt_params[k] if p.grad is not None]
            if not grads or bool(all_zero(grads).all()):
                self._stale_opts.discard(k)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        if pl_module.automatic_optimization:
            # Backward is over; Lightning still holds the loss, so its graph is freed there, not here.
            self._release_graph()
        k = self._opt_index.get(id(optimizer))
        if k is None:
            return
        self._stepped.append(k)
        if not pl_module.automatic_optimization:
            self._note_step_order(k)
        if not self._window_open or self._window_left <= 0:
            return
        self._window_left -= 1
        if not pl_module.automatic_optimization:
            if k in self._stale_opts:
                self._record_leak(trainer, k)
            self._stale_opts.add(k)
        self._streaks.update(k, self._opt_params[k])
        self._grad_checks += 1
        self._frozen_versions.extend((n, p, p._version, k) for n, p in self._opt_params[k] if not p.requires_grad)

    def _record_leak(self, trainer: "pl.Trainer", k: int) -> None:
        names = tuple(n for n, _ in self._opt_params[k])
        self._record(
            trainer,
            FindingKind.GRAD_LEAK,
            names,
            f"Optimizer {k} ({type(trainer.optimizers[k]).__name__}, parameters {listed(names)}) stepped with "
            "gradients left over from before its previous step: no zero_grad cleared them, so the gradients of "
            "every loss back-propagated since (including losses meant for another optimizer) were added up. "
            "Call `opt.zero_grad()` before the backward meant for this optimizer.",
        )

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._walk_batch:
            self._check_reachability(trainer, pl_module)
        self._check_frozen_changed(trainer)
        self._check_step_order(trainer)
        if self._window_open and (self._window_left <= 0 or trainer.global_step >= self._next_check):
            self._close_window(trainer)
        elif self.strict:  # a non-finite loss raises at the end of its step
            self._flush_losses(trainer)
        self._end_batch()
        # Nodes created from here on belong to the next step, including its batch-transfer hooks
        # (``on_after_batch_transfer`` runs before ``on_train_batch_start``).
        self._mark = sequence_mark()
        self._maybe_raise(trainer)

    def _check_reachability(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Explain the trainable parameters the walked loss cannot reach. One batch does not make them
        unused (an auxiliary head used every other step, an expert that got no tokens), so a parameter
        of an optimizer is reported when the window closes, if it went without a gradient all window
        long. Reported now: a parameter outside every optimizer (no such record), and any under DDP
        with find_unused_parameters=False, whose next step fails on it."""
        self._walk_batch = False
        self._remove_hook()
        if not self._walked:  # no backward ran in this batch
            return
        unreached = [n for n, p in self._tracked if p.requires_grad and id(p) not in self._reached]
        reasons = unreached_reasons(pl_module, unreached, self._ran)
        ddp = _ddp_without_unused_search(trainer)
        if not ddp:
            self._unreached = {n: why for n, why in reasons.items() if id(self._params_by_name[n]) in self._opt_of}
        self._record_unreachable(trainer, {n: why for n, why in reasons.items() if n not in self._unreached}, ddp)

    def _record_unreachable(self, trainer: "pl.Trainer", reasons: dict[str, str], ddp: bool = False) -> None:
        if not reasons:
            return
        names = tuple(reasons)
        self._record(
            trainer,
            FindingKind.UNREACHABLE_PARAMS,
            names,
            f"{len(names)} trainable parameter(s) cannot be reached from the loss and will get no gradient: "
            + "; ".join(dict.fromkeys(reasons.values())) + "."
            + (" This run's DDP (find_unused_parameters=False) waits for their gradients and fails at the next "
               "step: strategy='ddp_find_unused_parameters_true', or remove or freeze them." if ddp else ""),
        )

    def _note_step_order(self, k: int) -> None:
        # Every step of every batch, outside the check windows too (an optimizer may step once in many
        # batches): one attribute read per parameter. A parameter's last step of the batch decides.
        for name, p in self._opt_params[k]:
            if p.grad is not None:
                self._gradless.pop(name, None)
            elif p.requires_grad:
                self._gradless[name] = (k, p)

    def _check_step_order(self, trainer: "pl.Trainer") -> None:
        """Under manual optimization, a parameter without ``.grad`` at its last optimizer step of the batch
        that holds one at the batch's end got it from a backward after every step: it is in the graph, not
        unused, and no step used its gradient. One batch may do that legitimately (accumulation by hand
        that steps the previous window first); ``dead_after_steps`` of its stepping batches in a row are a
        finding."""
        late = {n: k for n, (k, p) in self._gradless.items() if p.grad is not None}
        self._gradless = {}
        stepped = set(self._stepped)
        for name in [n for n in self._late_streak if n not in late]:  # stepped on time: the streak ends
            if self._opt_of.get(id(self._params_by_name[name])) in stepped:
                del self._late_streak[name]
        for name in late:
            self._late_streak[name] = self._late_streak.get(name, 0) + 1
        self._streaks.got_gradient(tuple(late))
        flagged = [n for n in late if self._late_streak[n] == self.dead_after_steps]
        for k in dict.fromkeys(late[n] for n in flagged):
            names = tuple(n for n in flagged if late[n] == k)
            self._record(
                trainer,
                FindingKind.STEP_BEFORE_BACKWARD,
                names,
                f"Optimizer {k} ({type(trainer.optimizers[k]).__name__}) stepped before the backward that gives "
                f"{listed(names)} their gradients, in {self.dead_after_steps} of its batches in a row: at its step their "
                "`.grad` was None, so the step left them unchanged, and the next zero_grad() throws the gradient "
                "away: they never train. Call `self.manual_backward(loss)` before `opt.step()`.",
            )

    def _check_frozen_changed(self, trainer: "pl.Trainer") -> None:
        for name, p, version, k in self._frozen_versions:
            if p._version == version:
                continue
            opt = trainer.optimizers[k]
            self._record(
                trainer,
                FindingKind.FROZEN_CHANGED,
                (name,),
                f"`{name}` has requires_grad=False but optimizer {k} ({type(opt).__name__}) changed it: "
                + "; ".join(frozen_change_causes(p, opt))
                + ". Set its `.grad` to None when freezing it, or remove it from the optimizer.",
            )
        self._frozen_versions = []

    def _close_window(self, trainer: "pl.Trainer") -> None:
        self._window_open = False
        n = self.dead_after_steps
        # A window the end of the run cut short has no verdict on unused or dead parameters: its streaks
        # are shorter than n, and a 0 logged for it would read as "all parameters train".
        complete = self._window_left <= 0
        unused, dead = self._streaks.at_least(n) if complete else ((), ())
        nonfinite = self._flush_losses(trainer)
        self._record_unreachable(trainer, {name: why for name, why in self._unreached.items() if name in unused})
        self._unreached = {}
        if unused:
            self._record(
                trainer,
                FindingKind.UNUSED_PARAMS,
                unused,
                f"{len(unused)} parameter(s) got no gradient (`.grad` is None) at {n} optimizer steps in a row: "
                f"{listed(unused)}. They are not in the loss's graph; the optimizer skips them. A branch taken only "
                "on some batches (an expert that got no tokens) looks the same for a while: if these train later, "
                "raise dead_after_steps.",
            )
            self._predict_ddp(trainer, unused)
        if dead:
            self._record(
                trainer,
                FindingKind.DEAD_PARAMS,
                dead,
                f"{len(dead)} parameter(s) had a gradient of exactly zero at {n} optimizer steps in a row: "
                f"{listed(dead)}. They are in the graph but the gradient is blocked (a ReLU or clamp of values "
                "that are always negative, a multiplication by zero, a saturated activation)."
                + (" In a torch.compile'd region, a parameter whose output does not reach the loss also gets a "
                   "gradient of zeros rather than none." if self._compiled else ""),
            )
        metrics = {
            "graph/nonfinite_losses": float(nonfinite),
            **{f"graph/{k}": float(v) for k, v in self._walk_counts.items()},
            **self._count_metrics(),
        }
        if complete:
            metrics.update({"graph/unused_params": float(len(unused)), "graph/dead_params": float(len(dead))})
        log_scalars(trainer, metrics, step=trainer.global_step)

    def _count_metrics(self) -> dict[str, float]:
        return {k.counter: float(v) for k, v in self.counts.items()}

    def _predict_ddp(self, trainer: "pl.Trainer", unused: tuple[str, ...]) -> None:
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel) and ddp.find_unused_parameters:
            return
        now = (
            "This run uses DDP with find_unused_parameters=False: the next step fails"
            if isinstance(ddp, DistributedDataParallel)
            else "Under DDP with find_unused_parameters=False (the default of strategy='ddp') the next step fails"
        )
        self._record(
            trainer,
            FindingKind.DDP_UNUSED,
            unused,
            f"{now} with 'Expected to have finished reduction in the prior iteration': the reducer waits for "
            f"gradients of {listed(unused)} that never come. Fix: strategy='ddp_find_unused_parameters_true' "
            "(DDPStrategy(find_unused_parameters=True)), or, if they are not meant to train, remove or freeze them.",
        )

    def _count_nonfinite(self) -> Tensor:
        """Add the non-finite values among the losses kept so far to this rank's device count (no sync)."""
        values, self._pending_losses = self._pending_losses, []
        self._nonfinite = self._nonfinite.to(self._device)
        if values:
            flat = torch.cat([v.reshape(-1).to(self._device) for v in values])
            self._nonfinite = self._nonfinite + flat.isfinite().logical_not().sum()
        return self._nonfinite

    def _flush_losses(self, trainer: "pl.Trainer") -> int:
        """The non-finite losses since the last flush, summed over ranks: one collective and host sync, so
        only where every rank calls it (a batch end, the end of training)."""
        bad = self._count_nonfinite().to(torch.float32)
        self._nonfinite = torch.zeros_like(self._nonfinite)
        count = int(trainer.strategy.reduce(bad, reduce_op="sum").item())
        if count:
            self._record(
                trainer,
                FindingKind.LOSS_NOT_FINITE,
                (),
                f"{count} loss value(s) were NaN or inf (summed over ranks) before step {trainer.global_step}. "
                "Every gradient of such a step is NaN; set detect_anomaly_steps to find the op that made it.",
            )
        return count

    def _release_graph(self) -> None:
        self._losses = []
        self._last_loss = None

    def _end_batch(self) -> None:
        self._release_graph()
        self._batch = None
        self._stepped = []
        if self._anomaly_prev is not None:
            torch.set_anomaly_enabled(*self._anomaly_prev)
            self._anomaly_prev = None

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ------------------------------------------------------------------------------- batch mixing

    def _check_independence(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any) -> None:
        x = self.batch_input(batch)
        with self._isolated_rng(pl_module), batchnorm_in_eval(pl_module) as switched:
            try:
                if x is None:
                    raise ValueError("the batch holds no tensor")
                mixing = batch_mixing(pl_module, x)
            except Exception as err:  # the model called on a guessed input: any failure means "cannot check"
                rank_zero_warn(f"trainvitals GraphIntegrityCallback: could not check batch independence: "
                               f"{type(err).__name__}: {err}")
                return
        if switched:
            rank_zero_info(
                f"trainvitals GraphIntegrityCallback: the batch-independence check ran {len(switched)} BatchNorm layer(s) in eval mode "
                f"({listed(switched)}): in training mode BatchNorm mixes examples through the batch statistics "
                "by design."
            )
        mixed = {i: js for i, js in mixing.items() if js}
        if mixed:
            detail = "; ".join(f"output {i} depends on inputs {js[:SHOWN]}" for i, js in mixed.items())
            self._record(
                trainer,
                FindingKind.BATCH_MIXING,
                tuple(f"output[{i}]" for i in mixed),
                f"Examples are mixed across the batch: {detail}. A `view`/`reshape` or `permute` that moves the "
                "batch dimension is the usual cause (e.g. `x.view(C, B, ...)` on a `(B, C, ...)` tensor).",
            )
        self._maybe_raise(trainer)

    @staticmethod
    @contextmanager
    def _isolated_rng(pl_module: "pl.LightningModule") -> Iterator[None]:
        """An extra forward must not shift the run's random stream (dropout, data augmentation)."""
        device = pl_module.device
        if device.type == "cpu":
            with torch.random.fork_rng(devices=[]):
                yield
        else:
            with torch.random.fork_rng(devices=[device], device_type=device.type):
                yield

    # ----------------------------------------------------------------------------- the step re-run

    def _rerun_if_possible(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Rerun | None:
        # Manual optimization would step optimizers again; several ranks could wait in a collective.
        if pl_module.automatic_optimization and trainer.world_size == 1 and self._batch is not None:
            return functools.partial(self._rerun, pl_module)
        return None

    def _rerun(self, pl_module: "pl.LightningModule") -> tuple[GraphTracer, Any]:
        """Run ``training_step`` on the current batch again under a :class:`GraphTracer`; returns the
        tracer and the loss the step returned.

        Used only when the step is failing anyway; logging is silenced and the random stream restored.
        """
        pl_module.log, pl_module.log_dict = _ignore, _ignore  # type: ignore[method-assign]
        try:
            with self._isolated_rng(pl_module), torch.enable_grad(), GraphTracer(pl_module, _SKIP_DIRS) as tracer:
                output = pl_module.training_step(self._batch, self._batch_idx)
        finally:
            del pl_module.log, pl_module.log_dict
        return tracer, output.get("loss") if isinstance(output, dict) else output

    # ------------------------------------------------------------------------------- exceptions

    @override
    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        self._remove_hook()
        kind = None if isinstance(exception, GraphIntegrityError) else classify_autograd_error(exception)
        if kind is not None:
            try:
                names, message = self._diagnose(kind, trainer, pl_module, exception)
            except Exception as err:  # a diagnosis must never replace the user's error
                names, message = (), f"the diagnosis itself failed ({type(err).__name__}: {err})"
            finding = self._record(trainer, _ERROR_KIND[kind], names, message, warn=False)
            note = f"trainvitals GraphIntegrityCallback [{finding.kind.value}]: {finding.message}"
            if hasattr(exception, "add_note"):
                exception.add_note(note)
            else:  # Python < 3.11
                rank_zero_warn(note)
        self._end_batch()
        if self.counts:
            # The run ends here, before any check window closes: log the counters now, so that
            # ``trainvitals report`` sees why it failed.
            log_scalars(trainer, self._count_metrics(), step=trainer.global_step)
        self._publish(trainer)

    def _diagnose(
        self, kind: AutogradError, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> tuple[tuple[str, ...], str]:
        """Names and message for autograd's error ``kind``, from what this batch recorded."""
        loss, rerun = self._last_loss, self._rerun_if_possible(trainer, pl_module)
        if kind is AutogradError.NO_GRAD:
            found = next((f for f in reversed(self.findings) if f.kind is FindingKind.LOSS_NO_GRAD), None)
            if found is not None:  # already explained before backward
                return found.names, found.message
            return diagnose_no_grad(loss, pl_module, trainer.optimizers, rerun)
        if kind is AutogradError.SECOND_BACKWARD:
            return diagnose_second_backward(loss, self._losses[:-1], pl_module, self._names, self._mark)
        stepped = [
            (p, f"optimizer {k} ({type(trainer.optimizers[k]).__name__})")
            for _, p in self._tracked
            if (k := self._opt_of.get(id(p))) is not None and k in self._stepped
        ]
        return diagnose_inplace(exception, loss, pl_module, self._names, self._mark, stepped, rerun)

    # ------------------------------------------------------------------------- findings, strict, end

    def _record(
        self, trainer: "pl.Trainer", kind: FindingKind, names: tuple[str, ...], message: str, warn: bool = True
    ) -> Finding:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        finding = next((f for f in self.findings if f.kind is kind and f.names == names), None)
        if finding is None:
            finding = Finding(kind, names, message, self._step)
            self.findings.append(finding)
        if warn and kind not in self._warned:
            self._warned.add(kind)
            rank_zero_warn(f"trainvitals GraphIntegrityCallback [{kind.value}]: {message}")
        if self.strict and self._pending is None:
            self._pending = finding
        return finding

    def _maybe_raise(self, trainer: "pl.Trainer") -> None:
        if not self.strict:
            return
        found = self._pending is not None
        if trainer.strategy.reduce_boolean_decision(found, all=False):
            pending, self._pending = self._pending, None
            if pending is None:
                raise GraphIntegrityError("trainvitals GraphIntegrityCallback: another rank found a graph problem.")
            raise GraphIntegrityError(f"trainvitals GraphIntegrityCallback [{pending.kind.value}]: {pending.message}")

    def summary_markdown(self) -> str:
        """The findings as a markdown table (step, kind, names, message), or a clean bill of health."""
        if not self.findings:
            return (
                f"**Graph integrity: clean bill of health.** No findings in {self._walks} graph walk(s) and "
                f"{self._grad_checks} gradient check(s)."
            )
        rows = ["| step | kind | names | finding |", "|---:|---|---|---|"]
        for f in self.findings:
            cells = (str(f.step), f.kind.value, listed(f.names), f.message)
            rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        return "\n".join(rows)

    def _publish(self, trainer: "pl.Trainer") -> None:
        table = self.summary_markdown()
        log_text(trainer, "graph/findings", table, step=trainer.global_step)
        if self.verbose:
            rank_zero_info(f"trainvitals GraphIntegrityCallback: findings\n{table}")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._window_open:
            self._close_window(trainer)
        elif nonfinite := self._flush_losses(trainer):  # after the last window: still on the charts
            log_scalars(trainer, {"graph/nonfinite_losses": float(nonfinite), **self._count_metrics()},
                        step=trainer.global_step)
        self._publish(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hook()
        self._end_batch()

    # ------------------------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "next_check": self._next_check,
            "window_open": self._window_open,
            "window_left": self._window_left,
            **self._streaks.state_dict(),
            "counts": {k.value: v for k, v in self.counts.items()},
            "findings": [{**asdict(f), "kind": f.kind.value, "names": list(f.names)} for f in self.findings],
            "warned": sorted(k.value for k in self._warned),
            "walks": self._walks,
            "grad_checks": self._grad_checks,
            "independence_done": self._independence_done,
            "unreached": dict(self._unreached),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next_check = int(state_dict.get("next_check", 0))
        self._window_open = bool(state_dict.get("window_open", False))
        self._window_left = int(state_dict.get("window_left", 0))
        self._streaks.load_state_dict(state_dict)
        self.counts = {FindingKind(k): int(v) for k, v in state_dict.get("counts", {}).items()}
        self.findings = [
            Finding(FindingKind(f["kind"]), tuple(f["names"]), f["message"], int(f["step"]))
            for f in state_dict.get("findings", [])
        ]
        self._warned = {FindingKind(k) for k in state_dict.get("warned", [])}
        self._walks = int(state_dict.get("walks", 0))
        self._grad_checks = int(state_dict.get("grad_checks", 0))
        self._independence_done = bool(state_dict.get("independence_done", False))
        self._unreached = dict(state_dict.get("unreached", {}))
