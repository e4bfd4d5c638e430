"""TrainingGuard: answer a loss or gradient-norm spike, or an inf/NaN, instead of only counting it.

The callback is a thin adapter over :mod:`trainvitals.guard.decision` (what a step says, what to do),
:mod:`trainvitals.guard.snapshot` (the rollback target) and :mod:`trainvitals.norms.producer` (which
module made the first inf/NaN). It reads the step's total gradient norm from the fit's shared
measurements (:mod:`trainvitals.plumbing.sharing`): no pass of its own over the gradients.

The guard decides in ``on_before_optimizer_step`` and acts only once every callback has read the step,
whatever its place in the callbacks list: the gradients are dropped (``p.grad = None``, which SGD and
Adam skip without touching their state) right before the update — after the optimizer's closure, through
the optimizer's step pre-hook, installed at fit start — and a rollback restores the snapshot after the
optimizer's step (its post-hook; or at the batch's end when a GradScaler skipped the step itself).

Cost: a skip must be known before the optimizer steps, so each optimizer step reads its decision back
to the host — one transfer of a ``(4 + world_size,)`` vector (after one all-reduce of it under DDP),
as a GradScaler does for its own skip (one more on a non-finite step: which micro-batch's loss was); on
CUDA that read waits for the step's backward, as GradScaler's ``found_inf`` read does. When both actions
are ``"warn"`` nothing must be known before the update: the vectors wait on the device and are read at the
Trainer's logging steps (``log_every_n_steps``; at most 256 steps apart, and at the end of training, before
a checkpoint is written), one transfer for all of them — the first non-finite step's producer is then
named only when that step is a logging step, as GradNormMonitor's is. Besides that: the loss kept on the
device at each backward, the spike rule in Python floats, a snapshot every ``snapshot_every_n_steps`` (when
an action can lead to a rollback: ``"skip"`` or ``"rollback"``), and at each step's first micro-batch a
device-side copy of the module's persistent buffers (BatchNorm's running statistics: what a skipped step's
forward changed, and what a snapshot takes of them), one ``torch._foreach_copy_`` into tensors kept from the
first step, over a list of buffers kept too (the buffers' size in memory; none when both actions are
``"warn"``). The producer search (one extra forward and backward of the bad batch, hooks removed after) runs
once, on the first non-finite step (:class:`~trainvitals.norms.nonfinite.ProducerSearch`, which GradNormMonitor
runs without a guard).
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_choice, check_float, check_int
from trainvitals.guard.decision import (
    ACTIONS,
    NONFINITE,
    SPIKE,
    Budget,
    Reading,
    choose,
    classify,
    pack,
    unpack,
)
from trainvitals.guard.snapshot import WHERE, BufferCopy, Snapshot
from trainvitals.norms.monitor import MAX_PENDING_STEPS
from trainvitals.norms.nonfinite import ProducerSearch
from trainvitals.norms.producer import SEARCHES, Producer
from trainvitals.norms.spikes import SPREAD_Z, SpikeDetector, UsualBatch, relative_noise_weight
from trainvitals.plumbing.amp import grad_scaler, loss_scale
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import StepBatches, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.lr_factors import LRFactors, monitors_after
from trainvitals.plumbing.sharing import GRAD_SQ_NORMS, LR_FACTORS, NAN_PRODUCER, STEP_BATCHES, SUMMARY
from trainvitals.plumbing.state import DeclaredState, IndexedStates, optimizer_index
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.tags import GUARD_EVENT_LOG, SKIP_BATCHES_FILE
from trainvitals.text.markdown import markdown_table

_PANEL_ROWS = 20  # events shown in the text panel, newest last

_DOING = {
    "warn": "the step is applied (action warn)",
    "skip": "this optimizer step is skipped, its gradients dropped and the buffers its forward changed put back",
    "rollback": "weights and optimizer state are rolled back to the snapshot of optimizer step {snapshot}",
    "stop": "the step is skipped and the fit stops after a checkpoint",
}


class SpikeTrack(DeclaredState):
    """One optimizer's spike EMAs of the loss and of the gradient norm, and the usual batch its short batches are
    judged against: a GAN's discriminator and generator differ in both by orders of magnitude, so one EMA over
    their alternating steps would hide a spike of the smaller one."""

    def __init__(self, factor: float, beta: float, warmup: int) -> None:
        self.loss_spikes: SpikeDetector
        self.add_state("loss_spikes", functools.partial(SpikeDetector, factor, beta, warmup, SPREAD_Z))
        self.norm_spikes: SpikeDetector
        self.add_state("norm_spikes", functools.partial(SpikeDetector, factor, beta, warmup, SPREAD_Z))
        self.usual_batch: UsualBatch  # over the spike EMA's horizon
        self.add_state("usual_batch", functools.partial(UsualBatch, round(1.0 / (1.0 - beta))))


class TrainingGuard(TrainvitalsCallback):
    r"""Watch each optimizer step's loss and total gradient norm and act on an inf/NaN or a spike.

    An event is a non-finite loss or gradient (``"nonfinite"``) or a value above ``spike_factor`` × its winsorized
    EMA and above that mean + :data:`~trainvitals.norms.spikes.SPREAD_Z` standard deviations of the values before it
    (``"spike"``, :class:`~trainvitals.norms.spikes.SpikeDetector`, one per optimizer: :class:`SpikeTrack`; the
    loss is what the optimizer's own step backpropagated; a loss spike needs a positive loss; a norm
    from a batch of b examples below the usual B, an epoch's short last one, is allowed √(B/b) times more:
    :class:`~trainvitals.norms.spikes.UsualBatch`). Its action, per kind: ``"warn"``; ``"skip"`` — the optimizer
    step is not applied, the gradients dropped, and the module's persistent buffers (BatchNorm's running statistics,
    which the step's forward already updated) put back as they were at the step's first micro-batch (under a
    GradScaler a non-finite gradient is the scaler's own skip: a finite loss with it is calibration and no event,
    and the scaler's skip is not repeated); ``"rollback"`` — weights, buffers and optimizer state restored from the
    in-memory snapshot of the last clean step as it started (taken every ``snapshot_every_n_steps``, the buffers as
    of before its forward; the batches since are not re-run, i.e. skipped, as PaLM does), the lr multiplied by
    ``lr_factor`` for the ``lr_factor_steps`` steps after (in ``param_groups`` from each such step's first batch
    start to its optimizer step's end, so LearningRateMonitor and ``optimizer_step`` see it, and put back before the
    LR scheduler steps, which keeps shaping the lr); ``"stop"`` — the step skipped, a checkpoint written through the
    Trainer, the fit stopped. After ``budget_events`` skips (or rollbacks) within ``budget_window`` steps, the next
    event gets the next action: skip → rollback → stop. Every rank takes the same decision, from numbers reduced
    over ranks.
    With both actions ``"warn"`` the steps are read back at the Trainer's logging steps only (no host read on
    the others; module docstring), and their events recorded then, each at its own step.
    On each fit's first non-finite step the module that produced the inf/NaN is named (:attr:`producer`;
    under gradient accumulation the first micro-batch whose loss was non-finite is the one re-run, else the
    step's last; a re-run that stays finite is said, with the step's batches).

    Logged at each event (step = ``trainer.global_step``), and once at the end of fit:

    - ``guard/skipped_steps``, ``guard/rollbacks``, ``guard/events``: counts since the run began;
    - ``guard/lr_factor``: at each step the factor applies to, and 1 at the first step after;
    - ``guard/event_log`` (text panel): the summary line (:meth:`summary_line`), then the latest events as a table;
    - ``skip_batches.json`` in the logger's folder: every event as ``{global_step, epoch, batch_idx,
      batches, loss, grad_norm, kind, action, detail, producer}`` (non-finite numbers as strings), for a user to
      skip them: ``batches`` are the step's micro-batches, ``batch_idx`` the one whose loss was non-finite (else
      the step's last), ``producer`` the module that made the first inf/NaN when this event's search named it.

    Args:
        on_nonfinite: action for an inf/NaN loss or gradient: one of ``"warn"``, ``"skip"``, ``"rollback"``, ``"stop"``.
        on_spike: action for a spike, same choices.
        spike_factor: a value above ``spike_factor`` × its EMA (and above the spread term) is a spike; > 1.
        ema_beta: decay of the EMAs per optimizer step, in [0, 1).
        spike_warmup_steps: steps before spikes are looked for.
        snapshot_every_n_steps: optimizer steps between snapshots (at a clean step; taken only when an action is
            ``"skip"`` or ``"rollback"``, which can lead to a rollback); 0: none (a rollback is then a skip, or a
            stop when the budget escalated to it).
        snapshot_on: ``"cpu"`` or ``"device"`` (the parameters'): where the snapshot is kept.
        lr_factor: lr multiplier after a rollback, in (0, 1].
        lr_factor_steps: optimizer steps the factor applies for after a rollback (default 100, the default snapshot
            interval: about the steps a rollback takes back).
        budget_events: skips (or rollbacks) allowed within ``budget_window`` before escalating; ≥ 1.
        budget_window: the budget's window in optimizer steps; ≥ 1.
        name_producer: on the first non-finite step, re-run the batch to name the module that made the inf/NaN.
        producer_search: how: ``"flags"`` (finiteness flags on every module's output, the default) or
            ``"anomaly"`` (the batch re-run under ``torch.autograd.detect_anomaly``; it sees NaN gradients only).
        snapshot_in_checkpoint: also save the snapshot itself in checkpoints (default: only its step).

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
        ValueError: on an ``lr_factor`` < 1 that cannot take effect, naming the argument that prevents it:
            ``lr_factor_steps=0``, ``snapshot_every_n_steps=0`` (no snapshot, no rollback), or no action
            (``on_nonfinite``, ``on_spike``) that can lead to a rollback (``"skip"``, escalated, or ``"rollback"``).
    """

    provides = (NAN_PRODUCER, SUMMARY)
    reads = (GRAD_SQ_NORMS, STEP_BATCHES)

    def __init__(
        self,
        on_nonfinite: str = "skip",
        on_spike: str = "warn",
        spike_factor: float = 5.0,
        ema_beta: float = 0.98,
        spike_warmup_steps: int = 20,
        snapshot_every_n_steps: int = 100,
        snapshot_on: str = "cpu",
        lr_factor: float = 1.0,
        lr_factor_steps: int = 100,
        budget_events: int = 3,
        budget_window: int = 1000,
        name_producer: bool = True,
        producer_search: str = "flags",
        snapshot_in_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.on_nonfinite = check_choice("on_nonfinite", on_nonfinite, ACTIONS)
        self.on_spike = check_choice("on_spike", on_spike, ACTIONS)
        self.actions = {NONFINITE: self.on_nonfinite, SPIKE: self.on_spike}
        factor, beta, warmup = SpikeDetector.check_arguments(
            spike_factor, ema_beta, spike_warmup_steps, names=("spike_factor", "ema_beta", "spike_warmup_steps")
        )
        self.spike_factor, self.ema_beta, self.spike_warmup_steps = factor, beta, warmup
        self.snapshot_every_n_steps = check_int("snapshot_every_n_steps", snapshot_every_n_steps, 0)
        self.snapshot_on = check_choice("snapshot_on", snapshot_on, WHERE)
        self.lr_factor = check_float("lr_factor", lr_factor, 0.0, 1.0, low_open=True)
        self.lr_factor_steps = check_int("lr_factor_steps", lr_factor_steps, 0)
        self.budget_events = events = check_int("budget_events", budget_events, 1)
        self.budget_window = window = check_int("budget_window", budget_window, 1)
        self.name_producer = check_bool("name_producer", name_producer)
        self.producer_search = check_choice("producer_search", producer_search, SEARCHES)
        self.snapshot_in_checkpoint = check_bool("snapshot_in_checkpoint", snapshot_in_checkpoint)
        self._rolls_back = any(action in ("skip", "rollback") for action in self.actions.values())  # or escalated to
        self._check_lr_factor()
        self.key_state_by(on_nonfinite=self.on_nonfinite, on_spike=self.on_spike, spike_factor=factor)

        self.skipped_steps: int
        self.add_state("skipped_steps", 0)
        self.rollbacks: int
        self.add_state("rollbacks", 0)
        self.events: list[dict[str, Any]]
        """Every event of the run, as written to ``skip_batches.json``."""
        self.add_state("events", [])
        self.budget: Budget
        self.add_state("budget", functools.partial(Budget, events, window))
        self.tracks: IndexedStates  # a SpikeTrack per optimizer index, built at its first step
        self.add_state("tracks", functools.partial(IndexedStates, functools.partial(SpikeTrack, factor, beta, warmup)))
        self.snapshot_step: int | None
        """The optimizer step of the latest snapshot (kept across a resume; the snapshot only when asked)."""
        self.add_state("snapshot_step", None)
        self.lr_steps_left: int
        self.add_state("lr_steps_left", 0)
        self.search: ProducerSearch  # the producer, searched on each fit's first non-finite step
        self.add_state("search", functools.partial(ProducerSearch, self.producer_search), persistent=False)
        self.stop_reason: str | None
        """Why the guard stopped the fit, and where its checkpoint is; ``None`` if it did not."""
        self.add_state("stop_reason", None)
        self.snapshot: Snapshot
        self.add_state(
            "snapshot", functools.partial(Snapshot, self.snapshot_on), persistent=self.snapshot_in_checkpoint
        )
        self._step: dict[str, Any]  # scratch: this step's losses, batches, RNG states, decision; the params
        self.add_state("_step", dict, persistent=False)
        self._waiting: list[tuple[Any, ...]]  # all actions "warn": the steps not read back yet, rows on the device
        self.add_state("_waiting", list, persistent=False)
        self._unsaid: dict[str, int]  # per kind whose first "warn" event this fit was said: the later ones, counted
        self.add_state("_unsaid", dict, persistent=False)
        self._lr: dict[str, Any]  # whether guard/lr_factor was logged at the last step (the lrs: plumbing.lr_factors)
        self.add_state("_lr", dict, persistent=False)
        self._hooks: list[Any] = []  # the optimizers' step pre- and post-hooks, installed for one fit
        self._buffers = BufferCopy()  # the persistent buffers at this step's start: what a skip puts back
        self._skips = any(action != "warn" for action in self.actions.values())  # else no step is ever skipped
        self._amp = False
        self._folder = ""

    def _check_lr_factor(self) -> None:
        """An ``lr_factor`` < 1 that no rollback can ever apply is refused, naming what prevents it."""
        if self.lr_factor == 1.0:
            return
        why = None
        if self.lr_factor_steps == 0:
            why = "`lr_factor_steps=0` applies it for no step after a rollback"
        elif self.snapshot_every_n_steps == 0:
            why = "`snapshot_every_n_steps=0` takes no snapshot, so no rollback happens"
        elif not self._rolls_back:
            why = (
                f"neither `on_nonfinite={self.on_nonfinite!r}` nor `on_spike={self.on_spike!r}` can lead to a rollback "
                '("skip", escalated by the budget, or "rollback")'
            )
        if why is not None:
            raise ValueError(f"`lr_factor={self.lr_factor:g}` cannot take effect: {why}")

    # ------------------------------------------------------------------ hooks
    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.lr_factor != 1.0:  # LearningRateMonitor reads the lr after this callback has scaled it
            monitors_after(trainer, self)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._amp = grad_scaler(trainer) is not None
        self._folder = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank, once
        self._unsaid = {}
        self._step["fit"] = (trainer, pl_module)
        self._remove_hooks()
        if self.lr_factor != 1.0:  # declared for the fit: the factor while steps are left (LRScalingAdvisor reads it)
            self.vitals.shared(LR_FACTORS, LRFactors).own(
                "TrainingGuard", lambda: self.lr_factor if self.lr_steps_left > 0 else 1.0
            )
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
            self._hooks.append(optimizer.register_step_post_hook(self._after_step))

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:  # the epoch's first lr, as LearningRateMonitor logs it
            factors.epoch_start(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:  # saved between a step's micro-batches: the scheduler's lrs, not the scaled ones
            factors.unscaled_checkpoint(trainer, checkpoint)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, i: int) -> None:
        if StepBatches.of(self.vitals).start(self, trainer, batch, i):  # a new optimizer step's first micro-batch
            self._step.update(batches=[], losses=[])
            self._scale_lr(trainer)
            if self._skips:
                self._buffers.take(pl_module)
        self._step["batches"].append(i)
        if self.name_producer:  # references and the RNG state: no copy of the batch
            self.search.keep(trainer.global_step, pl_module, batch, i)
        self._step["batch_idx"] = i

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        loss = loss.detach()
        scale = loss_scale(trainer)  # the GradScaler's scale is in the loss here
        loss = loss if scale is None else loss / scale.to(loss)
        # Normalised, on the device, tagged with the step it is backpropagated for: a manual GAN's generator
        # step after the discriminator's, on the same batch, is judged on its own loss.
        self._step.setdefault("losses", []).append((self._step.get("batch_idx"), loss, trainer.global_step))
        StepBatches.of(self.vitals).backward(self, trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        if self._step.get("decided") == step:
            return  # LBFGS evaluates its closure, and Lightning this hook, several times per step
        self._step["decided"] = step
        params = self._params_of(optimizer)
        sq_norm = self.vitals.grad_norms.sq_norm(trainer, optimizer, params)
        own = [(i, held) for i, held, at in self._step.get("losses", []) if at == step]
        losses = [held for _, held in own]
        # The micro-batches' sum, as Lightning normalises them (one micro-batch: its own loss, no device op).
        loss = (losses[0] if len(losses) == 1 else torch.stack(losses).sum()) if losses else None
        device = next((t.device for t in (sq_norm, loss) if t is not None), pl_module.device)
        noise = relative_noise_weight(
            StepBatches.of(self.vitals).backward_sizes(trainer), loss_divisor(trainer, pl_module)
        )
        row = pack(loss, sq_norm, trainer.global_rank, trainer.world_size, device, noise)
        if trainer.world_size > 1:
            row = trainer.strategy.reduce(row, reduce_op="sum")
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:  # a step the GradScaler skips runs no post-hook: the scheduler's lrs back now
            factors.before_step(optimizer, grad_scaler(trainer))
        batches = list(self._step.get("batches", []))
        held = (step, trainer.current_epoch, batches, own, noise, optimizer_index(trainer, optimizer), row)
        if self._skips:  # the step's one host read: a skip must be known before the step
            self._decide(trainer, pl_module, optimizer, params, held, unpack(row.tolist(), bool(own), noise), False)
            return
        # Every action "warn": the rows wait on the device for a logging step, read then in one transfer.
        self._waiting.append(held)
        if is_logging_step(step, logging_every(trainer)) or len(self._waiting) >= MAX_PENDING_STEPS:
            self._read_waiting(trainer, pl_module, optimizer, params)

    def _read_waiting(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer | None = None,
        params: list[torch.nn.Parameter] | None = None,
    ) -> None:
        """The rows waiting on the device read back in one transfer and decided in order (all actions "warn"): the
        current step's event is acted on as usual (its producer searched before its update), an earlier one's
        recorded now, too late for a search (its update made the weights what they are)."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        values = torch.stack([held[-1] for held in waiting]).tolist()
        for held, row in zip(waiting, values):
            late = optimizer is None or held[0] != trainer.global_step
            self._decide(trainer, pl_module, optimizer, params, held, unpack(row, bool(held[3]), held[4]), late)

    def _decide(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer | None,
        params: list[torch.nn.Parameter] | None,
        held: tuple[int, int, list[int], list[tuple[int | None, Tensor]], float, int, Tensor],
        reading: Reading,
        late: bool,
    ) -> None:
        """What the step ``held`` (its step, epoch, micro-batches, losses, noise weight, optimizer index, row) says,
        judged against that optimizer's :class:`SpikeTrack`, and the action: acted on
        once every callback has read the step (:meth:`_before_step`, :meth:`_after_step`), or at once when
        ``late`` (read back after its update)."""
        step, epoch, batches, losses, _, index, _ = held
        track: SpikeTrack = self.tracks.get(index)  # type: ignore[assignment]
        kind, seen = classify(reading, track.loss_spikes, track.norm_spikes, track.usual_batch)
        if kind == NONFINITE and self._amp and math.isfinite(reading.loss):
            return  # the GradScaler skips this step and lowers its scale: calibration
        if kind is None:
            self._take_snapshot(trainer, pl_module, step)
            self._spend_lr_step()
        else:
            action = choose(kind, self.actions, self.budget, step, self.snapshot.step is not None)
            if action == "warn":
                self._spend_lr_step()
            pending = dict(
                trainer=trainer, pl_module=pl_module, optimizer=optimizer, params=params, step=step, epoch=epoch,
                batches=batches, losses=losses, kind=kind, seen=seen, reading=reading, action=action, prepared=late,
                before=self._step.get("last"),
            )  # fmt: skip
            if late:
                pending["where"] = self._culprit(kind, batches, losses)
                if kind == NONFINITE and self.name_producer and not self.search.searched:
                    self.search.give_up()
                    pending["late"] = trainer.global_step
                self._conclude(pending)
            else:
                self._step["pending"] = pending
        self._step["last"] = (step, kind)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        self._finish()  # a step the GradScaler skipped: the optimizer's hooks did not run
        stop = self._step.pop("stop", None)
        if stop is None:
            return
        step, reason = stop
        # Named by the global step it holds (the bad step's, counted though not applied), as ModelCheckpoint's are;
        # the reason set first, so that the checkpoint's guard state says the stop too.
        path = os.path.join(self._folder, "checkpoints", f"guard-stop-step={trainer.global_step}.ckpt")
        self.stop_reason = f"{reason}; checkpoint: {path}"
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.warn(f"stopping the fit: {self.stop_reason}")
        log_text(trainer, GUARD_EVENT_LOG, self.summary_markdown(), step)  # the panel's summary says the stop

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._read_waiting(trainer, pl_module)
        self._put_back_lr()
        self._remove_hooks()
        log_scalars(trainer, self._counters(), trainer.global_step)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._put_back_lr()
        self._remove_hooks()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._put_back_lr()
        self._remove_hooks()
        self._step, self._waiting = {}, []

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._waiting:  # the steps still on the device enter the counters and the spike averages first
            self._read_waiting(*self._step["fit"])
        return super().state_dict()

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: events, skips, rollbacks, the producer of the first inf/NaN."""
        producer = f"; first inf/NaN made by {self.producer.describe()}" if self.producer else ""
        unsaid = sum(self._unsaid.values())
        quiet = (
            f"; {unsaid} later warn-only event(s) this fit not said (each is in {SKIP_BATCHES_FILE})" if unsaid else ""
        )
        return (
            f"{len(self.events)} event(s): {self.skipped_steps} step(s) skipped, {self.rollbacks} rollback(s)"
            f"{'; stopped: ' + self.stop_reason if self.stop_reason else ''}{producer}{quiet}"
        )

    def summary_markdown(self) -> str:
        """End-of-run markdown (the dashboard's ``diagnosis/TrainingGuard`` panel): the summary line, then the
        last events as the event-log panel has them."""
        lines = [self.summary_line()]
        if self.events:
            lines += ["", *self._event_table()]
        return "\n".join(lines)

    def _event_table(self) -> list[str]:
        """The last ``_PANEL_ROWS`` events as a markdown table, newest last."""
        columns = ("global_step", "epoch", "batch_idx", "kind", "action", "loss", "grad_norm")
        rows = [[e[c] for c in columns] for e in self.events[-_PANEL_ROWS:]]
        return markdown_table(columns, rows, align="rrrllrr")

    # ------------------------------------------------------------------ actions
    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The optimizer's step pre-hook. A closure (Lightning's, which runs every callback's
        ``on_before_optimizer_step``, the guard's decision included) is wrapped, so the guard acts after it
        and before the update; without one (a GradScaler ran it already) the guard acts now."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            self._prepare(optimizer)
            return None

        def then_prepare() -> Any:
            result = closure()
            self._prepare(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_prepare}
        return (args[0], then_prepare, *args[2:]), kwargs

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The optimizer's step post-hook: the lrs put back (the LR scheduler steps next), the rollback and the
        event's record."""
        self._put_back_lr()
        pending = self._step.get("pending")
        if pending is not None and pending["optimizer"] is optimizer:
            self._finish()

    def _prepare(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Before the update, after every reader of the step: name the producer, drop the gradients."""
        pending = self._step.get("pending")
        if pending is None or pending["prepared"] or optimizer not in (None, pending["optimizer"]):
            return
        pending["prepared"] = True
        trainer, pl_module, kind = pending["trainer"], pending["pl_module"], pending["kind"]
        pending["where"] = self._culprit(kind, pending["batches"], pending["losses"])
        if kind == NONFINITE and self.name_producer and not self.search.searched:
            # A clean previous step was applied: non-finite weights now are that optimizer step's doing.
            before = pending["before"]
            applied = before is not None and before[0] == trainer.global_step - 1 and before[1] is None
            batch_idx = pending["where"][0]
            pending["producer"] = self.search.search(
                trainer, pl_module, pending["optimizer"], [] if batch_idx is None else [batch_idx], applied, self
            )
            pending["searched"] = True
        if pending["action"] != "warn" and not (kind == NONFINITE and self._amp):  # the GradScaler skips it
            for p in pending["params"]:
                p.grad = None

    def _finish(self) -> None:
        """After the update (or the GradScaler's skip): the rollback, the counters, the event's record."""
        self._prepare()
        pending = self._step.pop("pending", None)
        if pending is not None:
            self._conclude(pending)

    def _conclude(self, pending: dict[str, Any]) -> None:
        """The event ``pending`` acted on and recorded: the rollback, the counters, the warning, the record."""
        trainer, pl_module, step, kind = pending["trainer"], pending["pl_module"], pending["step"], pending["kind"]
        action, reading, seen = pending["action"], pending["reading"], pending["seen"]
        producer = pending.get("producer")
        if action == "rollback":
            try:
                self.snapshot.restore(pl_module, trainer.optimizers)
            except (RuntimeError, ValueError) as error:  # parameters added since (a backbone unfrozen): no target
                self.cannot_measure(f"could not roll back to the snapshot ({error}); skipping the step instead")
                action = "skip"
            else:
                self.rollbacks += 1
                self.lr_steps_left = self.lr_factor_steps if self.lr_factor != 1.0 else 0
        if action in ("skip", "stop"):
            self._put_back_buffers(pl_module)
        if action == "skip":
            self.skipped_steps += 1
        elif action == "stop":
            self._step["stop"] = (step, f"{seen} at optimizer step {step}")
        escalated = ACTIONS.index(action) > ACTIONS.index(self.actions[kind])
        doing = _DOING[action].format(snapshot=self.snapshot.step)
        if kind == NONFINITE and self._amp and action != "warn":
            doing += " (the GradScaler skips the optimizer step itself)"
        batch_idx, batches = pending["where"]
        found = f"; made by {producer.describe()}" if producer else ""
        if "late" in pending:
            found = (
                f"; read back at optimizer step {pending['late']}, after its update: too late to re-run its batch and "
                "name the module that made the inf/NaN (every action is warn: the guard reads at logging steps only)"
            )
        if pending.get("searched") and producer is None and self.search.rerun:
            found = f"; the re-run of batch {self.search.rerun[-1]} was finite" + (
                f": the inf/NaN came from another micro-batch of the step (batches {batches[0]}–{batches[-1]})"
                if len(batches) > 1
                else ""
            )
        searched = "late" in pending or pending.get("searched")
        if searched and producer is None and not pending["pl_module"].automatic_optimization:
            found = (
                "; the module that made the inf/NaN is not searched under manual optimization (a training_step "
                "that steps its optimizers itself cannot be re-run)"
            )
        event = {
            "global_step": step,
            "epoch": pending["epoch"],
            "batch_idx": batch_idx,
            "batches": batches,
            "loss": _number(reading.loss),
            "grad_norm": _number(reading.grad_norm),
            "kind": kind,
            "action": action,
            "detail": seen + found,
            "producer": producer.describe() if producer else None,
        }
        self.events.append(event)
        if action == "warn" and kind in self._unsaid:  # a run that diverged under "warn": one line, not one a step
            self._unsaid[kind] += 1
        else:
            self._say(event, pending, doing, escalated, found)
        self._record(trainer, step)

    def _say(self, event: dict[str, Any], pending: dict[str, Any], doing: str, escalated: bool, found: str) -> None:
        """The event's warning; under ``"warn"`` the fit's first of its kind says that the later ones are counted."""
        first = ""
        if event["action"] == "warn":
            self._unsaid[event["kind"]] = 0
            first = (
                f" (this fit's first {event['kind']} event under warn; later ones are counted in the fit-end line, "
                "not said)"
            )
        producer, (batch_idx, batches) = pending.get("producer"), pending["where"]
        budget = f" ({self.budget.events} skips/rollbacks in {self.budget.window} steps spent: escalated)"
        span = f"batch {batch_idx}" + (f" of batches {batches[0]}–{batches[-1]}" if len(batches) > 1 else "")
        self.warn(
            f"{pending['seen']} at optimizer step {event['global_step']} (epoch {event['epoch']}, {span}); {doing}"
            f"{budget if escalated else ''}{first}."
            + (f" The first inf/NaN was made by {producer.describe()}." if producer else "")
            + (f" {found[2].upper()}{found[3:]}." if found and not producer else "")
        )

    def _put_back_buffers(self, pl_module: "pl.LightningModule") -> None:
        """A skipped step's buffers as they were at its first micro-batch: its forward (and the producer search's
        re-run, which restores its own) updated BatchNorm's running statistics with the bad batch."""
        try:
            self._buffers.restore(pl_module)
        except RuntimeError as error:  # a buffer registered or replaced during the step
            self.cannot_measure(f"could not put the skipped step's buffers back ({error})")

    def _culprit(
        self, kind: str, batches: list[int], losses: list[tuple[int | None, Tensor]]
    ) -> tuple[int | None, list[int]]:
        """The batch to name for a step's event and the step's micro-batches: the first micro-batch whose loss was
        non-finite when the loss is (one more host read, on this step only), else the step's last."""
        last = batches[-1] if batches else self._step.get("batch_idx")
        if kind != NONFINITE or not losses:
            return last, batches
        finite = torch.stack([held.reshape(()) for _, held in losses]).isfinite().tolist()
        return next((i for (i, _), ok in zip(losses, finite) if not ok), last), batches

    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        """The optimizer's parameters, as the same list while they stay the same: the hub then serves this
        step's norms from its cached index instead of building one per step."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        held = self._step.get("params")
        if held is not None and len(held) == len(params) and all(map(operator.is_, held, params)):
            return held
        self._step["params"] = params
        return params

    def _take_snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int) -> None:
        every = self.snapshot_every_n_steps if self._rolls_back else 0  # warn and stop never roll back
        if every and (self.snapshot.step is None or step - self.snapshot.step >= every):
            try:
                # The buffers as the step's first micro-batch found them: its forward moved them since.
                self.snapshot.take(step, pl_module, trainer.optimizers, self._buffers.copies())
            except torch.OutOfMemoryError:  # on the device: the run goes on, with the older snapshot
                self.cannot_measure("no memory for a snapshot on the device; snapshot_on='cpu' keeps it in host memory")
                return
            self.snapshot_step = step

    def _scale_lr(self, trainer: "pl.Trainer") -> None:
        """At an optimizer step's first batch, for ``lr_factor_steps`` applied steps after a rollback: each
        group's lr × ``lr_factor`` (:class:`~trainvitals.plumbing.lr_factors.LRFactors`), put back right after the
        optimizer's step, before the LR scheduler steps: LearningRateMonitor and ``optimizer_step`` see it, the
        scheduler keeps shaping the lr. ``guard/lr_factor`` logged, and 1 at the first step after."""
        if self.lr_steps_left <= 0:
            if self._lr.pop("logged", False):
                log_scalars(trainer, {"guard/lr_factor": 1.0}, trainer.global_step)
            return
        self._lr["logged"] = True
        log_scalars(trainer, {"guard/lr_factor": self.lr_factor}, trainer.global_step)
        if self.lr_factor != 1.0:
            self.vitals.shared(LR_FACTORS).apply(trainer.optimizers)

    def _spend_lr_step(self) -> None:
        """An applied optimizer step: one fewer for the lr factor."""
        self.lr_steps_left = max(self.lr_steps_left - 1, 0)

    def _put_back_lr(self) -> None:
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:
            factors.put_back()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._buffers.close()
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:
            factors.close()

    # ------------------------------------------------------------------ the producer
    @property
    def producer(self) -> Producer | None:
        """Where this fit's first inf/NaN was made, once found (the same on every rank)."""
        return self.search.producer

    def offers(self, name: str) -> bool:
        """Whether the guard provides ``name`` in this configuration: the producer only when it searches."""
        return name != NAN_PRODUCER or self.name_producer

    # ------------------------------------------------------------------ records
    def _counters(self) -> dict[str, float]:
        return {
            "guard/skipped_steps": self.skipped_steps,
            "guard/rollbacks": self.rollbacks,
            "guard/events": len(self.events),
        }

    def _record(self, trainer: "pl.Trainer", step: int) -> None:
        """The counters to the loggers, the events to the text panel and to ``skip_batches.json`` (rank zero)."""
        log_scalars(trainer, self._counters(), step)
        log_text(trainer, GUARD_EVENT_LOG, self.summary_markdown(), step)
        if trainer.is_global_zero and self._folder:
            try:
                os.makedirs(self._folder, exist_ok=True)
                with open(os.path.join(self._folder, SKIP_BATCHES_FILE), "w") as f:
                    json.dump(self.events, f, indent=1)
            except OSError as error:
                self.cannot_measure(f"could not write {SKIP_BATCHES_FILE} in {self._folder}: {error}")


def _number(x: float) -> float | str:
    """``x``, or its name when it is not finite (JSON has no inf/NaN)."""
    return x if math.isfinite(x) else str(x)
