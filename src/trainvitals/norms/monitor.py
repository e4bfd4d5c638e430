"""GradNormMonitor: total and per-layer gradient norms, non-finite gradients, spikes and histograms.

Measured once per optimizer step in ``on_before_optimizer_step``, where Lightning hands over the whole
accumulated gradient, already unscaled by the AMP GradScaler and not yet clipped (docs/science.md §1).
A step costs one fused norm over the gradients, shared with the other callbacks that read the step's
norms (:class:`~trainvitals.plumbing.sharing.StepGradNorms`); the per-tensor norms stay on the device until a
logging step, which groups the steps of its window in one batch, reads them back in one transfer and
does the bookkeeping (non-finite steps, spikes) on the host: each step's norm against the spike rule, allowed
√(B / b) for a batch of b examples below the usual B (:mod:`~trainvitals.norms.spikes`; b from the sizes of the
step's micro-batches, host ints, under several ranks summed over them in the same read-back). On the fit's first
non-finite step, when a logging step reads it back before its update and no TrainingGuard is there to do it, the
step's batch is re-run once to name the module that produced the inf/NaN
(:class:`~trainvitals.norms.nonfinite.ProducerSearch`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_choice, check_int
from trainvitals.fused_norms import (
    GROUPINGS,
    NormGroups,
    combine_norms,
    grouped_norms,
    is_dtensor,
    per_tensor_norms,
    validate_norm_type,
)
from trainvitals.lr_scaling.groups import group_lrs
from trainvitals.norms.clipping import SetLR, clip_coef, clips_most, lower_lr, trainer_clip
from trainvitals.norms.nonfinite import ProducerSearch
from trainvitals.norms.producer import SEARCHES, Producer
from trainvitals.norms.spikes import (
    SpikeDetector,
    UsualBatch,
    effective_batch,
    first_spike_note,
    norm_spike,
    relative_noise_weight,
)
from trainvitals.plumbing.amp import grad_scaler
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import StepBatches, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.sharding import reduce_shard_norms
from trainvitals.plumbing.sharing import (
    GRAD_NORM,
    GRAD_SQ_NORMS,
    LR_FACTORS,
    NAN_PRODUCER,
    NONFINITE_STEPS,
    STEP_BATCHES,
    SUMMARY,
)
from trainvitals.plumbing.state import DeclaredState, IndexedStates, optimizer_index
from trainvitals.plumbing.stopping import stopped_early
from trainvitals.plumbing.writers import log_histogram, log_scalars, log_text
from trainvitals.tags import GRAD_NORM_SUMMARIES
from trainvitals.text.markdown import markdown_table

COUNTERS = ("nonfinite_steps", "amp_skipped_steps", "spike_steps")
# Steps whose norms wait on the device for a logging step; a longer logging cadence reads them back
# (one transfer, nothing logged) every this many steps.
MAX_PENDING_STEPS = 256


class TrackState(DeclaredState):
    """What one optimizer's track carries over a resume: its optimizer steps measured, the spike EMA, the usual
    batch its short batches are judged against, the counters (:data:`COUNTERS`)."""

    def __init__(self, spikes: Callable[[], SpikeDetector], usual: Callable[[], UsualBatch]) -> None:
        self.steps: int
        self.add_state("steps", 0)
        self.spikes: SpikeDetector
        self.add_state("spikes", spikes, key="ema")
        self.usual: UsualBatch
        self.add_state("usual", usual, key="usual_batch")
        self.counts: dict[str, int]
        self.add_state("counts", dict.fromkeys(COUNTERS, 0))
        # Clipping by norm, judged at each step read back: steps, those clipped, the sum of their factors, the norm;
        # over every step the sum of the lrs it ran at and of lr × factor (the lr-weighted mean: :func:`_lr_cut`).
        self.clipping: dict[str, float]
        self.add_state(
            "clipping", {"steps": 0, "clipped": 0, "shrink": 0.0, "max_norm": math.nan, "lr": 0.0, "lr_factor": 0.0}
        )


@dataclass
class _Track:
    """One optimizer's parameters and groups, its steps waiting on the device, and the host bookkeeping
    (:attr:`state`, a :class:`TrackState`, what a checkpoint keeps of it)."""

    params: list[torch.nn.Parameter]
    groups: NormGroups
    state: TrackState
    logged_counts: dict[str, int] = field(init=False)  # news: counts ≠ these
    # Measured, not yet read back: (global step, (P,) per-tensor norms, 0 for a parameter without a
    # gradient, this rank's noise weight, the lr the step ran at under clipping by norm). ``latest`` is the newest
    # row, read back or not.
    pending: list[tuple[int, Tensor, float, float]] = field(default_factory=list)
    latest: Tensor | None = None
    latest_step: int | None = None
    # The last step read back: (global step, total, {group: norm}); the last step whose norms were logged.
    last_read: tuple[int, float, dict[str, float]] | None = None
    logged_step: int | None = None
    # What the next report says, with layer names resolved (they outlive a regrouping): this fit's
    # first non-finite step as (step, non-finite groups), and the latest spike as (step, message).
    nonfinite: tuple[int, list[str]] | None = None
    spike: tuple[int, str] | None = None
    unreported: list[tuple[int, str]] = field(default_factory=list)  # the spikes read back, not yet logged
    # The first non-finite step read back at a later step, after its update: too late to re-run its batch.
    read_late: int | None = None
    warned_nonfinite: bool = False
    reported_spikes: int = field(init=False)
    said_spike: bool = False  # this fit's first spike went to the console; the later ones are counted

    def __post_init__(self) -> None:
        # What the checkpoint's counters held was logged and reported by the fit that wrote it.
        self.logged_counts = dict(self.counts)
        self.reported_spikes = self.counts["spike_steps"]

    @property
    def steps(self) -> int:
        return self.state.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.state.steps = value

    @property
    def spikes(self) -> SpikeDetector:
        return self.state.spikes

    @property
    def counts(self) -> dict[str, int]:
        return self.state.counts


class GradNormMonitor(TrainvitalsCallback):
    r"""Log the gradient norm, per layer and in total, once per optimizer step.

    Logged (step = ``trainer.global_step`` of the optimizer step; with several optimizers every tag
    gets an ``optimizer_<i>/`` infix after ``grad_norm/``):

    - ``grad_norm/total``: ‖g‖_p over every parameter of the optimizer that has a gradient — the
      accumulated, AMP-unscaled gradient, before the Trainer's clipping (under manual optimization, after any
      ``clip_gradients`` the training step ran before ``opt.step()``);
    - ``grad_norm/<group>``: the norm of each group (``grouping``: ``"parameter"``, ``"module"`` or
      ``"block"``, the top-level child); total^p = Σ group^p (a module named like one of the tags
      here, e.g. ``total``, is logged as ``grad_norm/total (layer)``);
    - ``grad_norm/clipped_total``: the norm after the Trainer's gradient clipping, when it clips; where it clips by
      L2 norm and shrinks at least half the steps, the fit-end line says so, with their mean factor (every step
      judged, from the totals read back: :mod:`~trainvitals.norms.clipping`);
    - ``grad_norm/nonfinite_steps``: steps whose gradient held inf/NaN (one warning names the layers
      of the first, and the module that produced it: see ``name_producer``); ``grad_norm/amp_skipped_steps``:
      such steps under a GradScaler, which skips them and lowers its scale — calibration, not divergence.
      A non-finite norm is counted, not logged;
    - ``grad_norm/spike_steps``: steps with a total above ``spike_factor`` × its running EMA, or
      √(B / b) × that for a step of b examples below the usual B (an epoch's short last batch, whose norm noise
      alone makes up to √(B / b) times larger: :class:`~trainvitals.norms.spikes.UsualBatch`); the
      latest spike (step, ratio, three largest groups) goes to the text panel ``grad_norm/spikes``, the
      fit's first to the console too (the later ones are counted there at fit end);
    - every ``histogram_every_n_steps``: histograms ``grad_norm/hist/<group>`` of gradient values and
      ``grad_norm/hist/group_norms`` of the group norms (TensorBoard, global rank zero only).

    Args:
        norm_type: p of the p-norm, > 0 or ``"inf"``.
        grouping: how per-layer norms are grouped: ``"parameter"``, ``"module"`` or ``"block"``.
        log_every_n_steps: logging cadence in optimizer steps; ``None`` uses the Trainer's
            ``log_every_n_steps``. Steps that do not log do no host sync.
        histogram_every_n_steps: histogram cadence in optimizer steps; 0 turns histograms off.
        spike_factor: a total above ``spike_factor`` × EMA(total) is a spike; must be > 1.
        ema_beta: decay of that EMA per optimizer step, in [0, 1).
        spike_warmup_steps: steps before spikes are looked for (the EMA needs history).
        name_producer: without a TrainingGuard (which names it itself), re-run the batch of the fit's first
            non-finite step once to name the module that produced the inf/NaN. Only a logging step is read
            before its update (every step with ``log_every_n_steps=1``): the batches of a logging step are
            kept by reference until the next step, and a non-finite step read back later is too late (its
            update has made the weights non-finite), which the warning says.
        producer_search: how, as TrainingGuard's: ``"flags"`` or ``"anomaly"`` (``torch.autograd.detect_anomaly``).

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
    """

    provides = (GRAD_NORM, NONFINITE_STEPS, SUMMARY)
    reads = (GRAD_SQ_NORMS, LR_FACTORS, STEP_BATCHES)

    def __init__(
        self,
        norm_type: float | int | str = 2.0,
        grouping: str = "module",
        log_every_n_steps: int | None = None,
        histogram_every_n_steps: int = 100,
        spike_factor: float = 5.0,
        ema_beta: float = 0.98,
        spike_warmup_steps: int = 20,
        name_producer: bool = True,
        producer_search: str = "flags",
    ) -> None:
        super().__init__()
        self.norm_type = validate_norm_type(norm_type)
        self.grouping = check_choice("grouping", grouping, GROUPINGS)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 1, none_ok=True)
        self.histogram_every_n_steps = check_int("histogram_every_n_steps", histogram_every_n_steps, 0)
        self.spike_factor, self.ema_beta, self.spike_warmup_steps = SpikeDetector.check_arguments(
            spike_factor, ema_beta, spike_warmup_steps, names=("spike_factor", "ema_beta", "spike_warmup_steps")
        )
        self.name_producer = check_bool("name_producer", name_producer)
        self.producer_search = check_choice("producer_search", producer_search, SEARCHES)
        self.key_state_by(
            norm_type=self.norm_type,
            grouping=self.grouping,
            spike_factor=self.spike_factor,
            ema_beta=self.ema_beta,
        )
        # Tracks are built at an optimizer's first step (they need its parameters); what a checkpoint keeps
        # of them is declared apart, so that a loaded state is kept by a fit that builds no track.
        self._track_states: IndexedStates
        self.add_state(
            "_track_states",
            partial(
                IndexedStates,
                partial(
                    TrackState,
                    partial(SpikeDetector, self.spike_factor, self.ema_beta, self.spike_warmup_steps),
                    partial(UsualBatch, round(1.0 / (1.0 - self.ema_beta))),  # over the spike EMA's horizon
                ),
            ),
            key="tracks",
        )
        self._tracks: dict[int, _Track]
        self.add_state("_tracks", {}, persistent=False)
        # Under several ranks: their number, and the sum over them of a read-back's noise weights (each rank's own).
        self._ranks: tuple[int, Callable[[Tensor], Tensor]] | None
        self.add_state("_ranks", None, persistent=False)
        self._clip_pending: tuple[int, int] | None  # (optimizer index, step) to measure after clipping
        self._clip_norm: float | None  # the Trainer's clipping by L2 norm: its threshold (set at fit start)
        self.add_state("_clip_norm", None, persistent=False)
        self.add_state("_clip_pending", None, persistent=False)
        # Per optimizer index, read at the end of training for the clipping advice: its class, family and lrs set.
        self._set_lrs: dict[int, tuple[str, str, list[SetLR]]]
        self.add_state("_set_lrs", {}, persistent=False)
        # A GradScaler skips non-finite steps: they are calibration, not divergence.
        self.add_state("_amp_scaler", False, persistent=False)
        # This monitor names the producer itself: asked to, and no TrainingGuard does (set at fit start).
        self.add_state("_searching", False, persistent=False)
        self._manual: bool
        self.add_state("_manual", False, persistent=False)
        self.search: ProducerSearch  # without a TrainingGuard: the producer of the fit's first inf/NaN
        self.add_state("search", partial(ProducerSearch, self.producer_search), persistent=False)

    @property
    def last_total(self) -> dict[int, Tensor]:
        """The latest step's total norm per optimizer index (0-d tensor on the gradients' device).

        Computed when read; reading it as a number syncs with the device.
        """
        return {i: combine_norms(t.latest, self.norm_type) for i, t in self._tracks.items() if t.latest is not None}

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._amp_scaler = grad_scaler(trainer) is not None
        self._searching = self.name_producer and self.vitals.provider(NAN_PRODUCER) is None
        self._manual = not pl_module.automatic_optimization  # a training_step that is never re-run
        clip = trainer_clip(trainer, pl_module)
        self._clip_norm = clip if clip is not None and not math.isnan(clip) and self.norm_type == 2.0 else None
        world = trainer.world_size
        self._ranks = (world, partial(trainer.strategy.reduce, reduce_op="sum")) if world > 1 else None
        self._read_lrs(trainer)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, i: int) -> None:
        StepBatches.of(self.vitals).start(self, trainer, batch, i)  # the step's micro-batches: its noise weight
        if not self._searching or self.search.searched:
            return
        every = logging_every(trainer, self.log_every_n_steps)
        if not self._tracks or any(is_logging_step(t.steps, every) for t in self._tracks.values()):
            self.search.keep(trainer.global_step, pl_module, batch, i)  # by reference: no copy
        else:
            self.search.let_go()

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        StepBatches.of(self.vitals).backward(self, trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        index = optimizer_index(trainer, optimizer)
        track = self._track(index, pl_module, optimizer)
        if track.latest_step == trainer.global_step:
            return  # LBFGS evaluates its closure, and Lightning this hook, several times per step: the first counts
        norms = self.vitals.grad_norms.norms(trainer, optimizer, track.params, self.norm_type)
        if norms is None:
            return
        step = trainer.global_step
        track.latest, track.latest_step = norms, step
        sizes = StepBatches.of(self.vitals).backward_sizes(trainer)
        weight = relative_noise_weight(sizes, loss_divisor(trainer, pl_module))  # host floats
        track.pending.append((step, norms, weight, self._step_lr(optimizer)))

        logs = is_logging_step(track.steps, logging_every(trainer, self.log_every_n_steps))
        if logs or len(track.pending) >= MAX_PENDING_STEPS:
            self._read_back(track, together=True)
            self._search_producer(trainer, pl_module, optimizer, track, step)
        if logs and trainer_clip(trainer, pl_module) is not None:
            self._clip_pending = (index, step)  # logged with the clipped norm: one event, one CSV row
        elif logs:
            self._log(trainer, index, track, step)
        if self.histogram_every_n_steps and track.steps % self.histogram_every_n_steps == 0 and trainer.is_global_zero:
            self._log_histograms(trainer, index, track, step)
        track.steps += 1

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        self._warn_nonfinite()  # after every callback's optimizer-step hook: a TrainingGuard has searched by then
        if self._clip_pending is None:
            return
        index, step = self._clip_pending
        self._clip_pending = None
        track = self._tracks[index]
        grads = [p.grad for p in track.params if p.grad is not None]
        local = combine_norms(per_tensor_norms(grads, self.norm_type), self.norm_type)
        clipped = reduce_shard_norms(trainer, local.to(track.latest), self.norm_type)
        self._log(trainer, index, track, step, extra={self._tag(trainer, "clipped_total", index): clipped})

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # A run that fails in its optimizer step (an OOM, a NaN-refusing optimizer, Ctrl-C) still gets
        # that logging step's norms and warnings, without the clipped norm it did not reach.
        if self._clip_pending is not None:
            index, step = self._clip_pending
            self._clip_pending = None
            self._log(trainer, index, self._tracks[index], step)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A run stopped early (by a stopping callback) gets its last measured step's norms logged: the
        # chart ends where the run did. Otherwise a non-finite step or a spike after the last logging
        # step is still reported: the counters (only they) are logged at the last measured step when
        # they changed since they were logged.
        for index, track in self._tracks.items():
            self._read_back(track, together=True)
            if track.last_read is None:
                continue
            step = track.last_read[0]
            if stopped_early(trainer) and step != track.logged_step:
                self._log(trainer, index, track, step)
            elif track.counts != track.logged_counts:
                self._log(trainer, index, track, step, norms=False)
        self._warn_nonfinite()
        self._read_lrs(trainer)  # the lrs the fit ended at: its clipping advice's

    @override
    def state_dict(self) -> dict[str, Any]:
        for track in self._tracks.values():  # the steps still on the device enter the counters first
            # No collective here: a user may save a checkpoint on one rank alone. The pending steps are judged at this
            # rank's batches, the same on every rank wherever the sampler gives the ranks batches of one size
            # (Lightning's DistributedSampler pads them so).
            self._read_back(track)
        return super().state_dict()

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: per optimizer, the steps measured, the last norm and the counters."""
        parts = []
        for index, track in self._tracks.items():
            self._read_back(track)
            if track.last_read is not None:
                c = track.counts
                parts.append(
                    f"{'optimizer ' + str(index) + ': ' if len(self._tracks) > 1 else ''}{track.steps} steps "
                    f"measured, last ‖g‖ {track.last_read[1]:.4g} (optimizer step {track.last_read[0]}), "
                    f"non-finite {c['nonfinite_steps']}, "
                    f"AMP-skipped {c['amp_skipped_steps']}, spikes {c['spike_steps']}"
                    + _clipped_most(track, *self._set_lrs.get(index, ("", "unsure", [])))
                )
        return "; ".join(parts) or "no optimizer step was measured."

    def summary_markdown(self) -> str:
        """End-of-run markdown: per optimizer, the last total norm, its largest groups, and the counters."""
        rows = []
        for index, track in self._tracks.items():
            self._read_back(track)
            if track.last_read is None:
                continue
            last, total, group_norms = track.last_read
            largest = ", ".join(f"`{name}` {value:.3g}" for name, value in _largest(group_norms))
            counts = track.counts
            rows.append(
                (
                    index,
                    track.steps,
                    f"{total:.4g} (step {last})",
                    largest,
                    counts["nonfinite_steps"],
                    counts["amp_skipped_steps"],
                    counts["spike_steps"],
                )
            )
        if not rows:
            return "No optimizer step was measured."
        return "\n".join(
            markdown_table(
                ("optimizer", "steps", "last ‖g‖", "largest groups (last step)", "non-finite", "AMP-skipped", "spikes"),
                rows,
                align="lrrlrrr",
            )
        )

    # ------------------------------------------------------------------ helpers
    def _read_lrs(self, trainer: "pl.Trainer") -> None:
        """Each optimizer's class, family and the lrs set on its groups (under a scheduler their base lrs,
        :func:`~trainvitals.lr_scaling.groups.group_lrs`), for the clipping advice; host floats, no sync."""
        if self._clip_norm is None:
            return
        self._set_lrs = {}
        for lr in group_lrs(trainer, self.vitals.shared(LR_FACTORS)):
            opt = trainer.optimizers[lr.optimizer]
            read = self._set_lrs.setdefault(
                lr.optimizer, (type(getattr(opt, "optimizer", opt)).__name__, lr.family, [])
            )
            if lr.base > 0:  # a frozen group has no lr to lower
                read[2].append(SetLR(lr.name, lr.base, lr.base_said(), lr.term))

    def _step_lr(self, optimizer: torch.optim.Optimizer) -> float:
        """Under clipping by norm, the lr ``optimizer``'s step runs at, summed over its param groups (the weight of
        its clip factor, :func:`_lr_cut`): the scheduler's × BandSchedule's and TrainingGuard's factors whatever the
        order of the hooks (:meth:`~trainvitals.plumbing.lr_factors.LRFactors.lr`); a host float, no sync. The sum
        weights the steps as each group's lr does where one schedule scales the groups alike (their lrs keep their
        ratios). 0 without clipping by norm."""
        if self._clip_norm is None:
            return 0.0
        factors = self.vitals.shared(LR_FACTORS)
        groups = getattr(optimizer, "optimizer", optimizer).param_groups
        return sum(float(group["lr"]) if factors is None else factors.lr(group) for group in groups)

    def _track(self, index: int, pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer) -> _Track:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        track = self._tracks.get(index)
        if track is not None and len(params) == len(track.params) and all(map(operator.is_, params, track.params)):
            return track
        # First step, or parameters were added to the optimizer (e.g. a backbone unfrozen by
        # BackboneFinetuning): regroup, keeping the counters and the spike EMA.
        names = {p: n for n, p in pl_module.named_parameters()}
        param_names = [names.get(p, f"unregistered.{i}") for i, p in enumerate(params)]
        groups = NormGroups.from_names(param_names, self.grouping)
        if track is not None:
            self._read_back(track, together=True)  # its rows have the old parameters' columns
            track.params, track.groups = params, groups
            return track
        track = _Track(params, groups, self._track_states.get(index))
        self._tracks[index] = track
        return track

    def _tag(self, trainer: "pl.Trainer", name: str, index: int = 0) -> str:
        if len(trainer.optimizers) > 1:
            return f"grad_norm/optimizer_{index}/{name}"
        return f"grad_norm/{name}"

    def _read_back(self, track: _Track, together: bool = False) -> None:
        """Group the pending steps' norms in one batch, read them back in one transfer, and count.

        A non-finite total is a non-finite step, or under a GradScaler (which skips such steps and
        lowers its scale: calibration, not divergence) an AMP-skipped one; finite totals go through
        the spike rule (:func:`~trainvitals.norms.spikes.norm_spike`), each at its step's effective batch. Under
        several ranks, ``together`` (every rank reads back at this step, in a hook) sums the steps' noise weights
        over the ranks in one collective first, so that every rank judges each step at the same batch; otherwise
        (a summary or a checkpoint, which may run on one rank) this rank's batches stand for every rank's.
        """
        if not track.pending:
            return
        steps = [step for step, _, _, _ in track.pending]
        weights = [weight for _, _, weight, _ in track.pending]
        lrs = [lr for _, _, _, lr in track.pending]
        group_norms = grouped_norms(
            torch.stack([norms for _, norms, _, _ in track.pending]), track.groups, self.norm_type
        )
        track.pending = []
        totals = combine_norms(group_norms, self.norm_type)
        n = len(steps)
        parts = [totals, group_norms[-1]]
        world, reduce = self._ranks or (1, None)
        reduced = together and reduce is not None
        if reduced:  # the window's weights summed over the ranks: one collective
            parts.append(reduce(torch.tensor(weights, dtype=torch.float64, device=totals.device)))
        host = torch.cat(parts).tolist()  # one transfer: the totals, the last step's groups (the ranks' weights)
        totals_host, last_groups = host[:n], host[n : n + len(track.groups.names)]
        summed = host[-n:] if reduced else [world * w for w in weights]
        batches = [effective_batch(w, world) for w in summed]
        track.last_read = (steps[-1], totals_host[-1], dict(zip(track.groups.names, last_groups)))
        if self._clip_norm is not None:  # every step read back, against the threshold: host floats only
            self._count_clipped(track, totals_host, lrs)
        nonfinite_row, spike_rows = None, []
        for row, (total, batch) in enumerate(zip(totals_host, batches)):
            if not math.isfinite(total):
                counter = "amp_skipped_steps" if self._amp_scaler else "nonfinite_steps"
                track.counts[counter] += 1
                if counter == "nonfinite_steps" and track.nonfinite is None and nonfinite_row is None:
                    nonfinite_row = row
            elif (spike := norm_spike(total, batch, track.spikes, track.state.usual)) is not None:
                track.counts["spike_steps"] += 1
                spike_rows.append((row, *spike))
        rows = [r for r in (nonfinite_row, *(r for r, _, _ in spike_rows)) if r is not None]
        if not rows:
            return
        # Rare: a second transfer, for those steps' group norms only.
        found = {r: dict(zip(track.groups.names, values)) for r, values in zip(rows, group_norms[rows].tolist())}
        if nonfinite_row is not None:
            track.nonfinite = (
                steps[nonfinite_row],
                [n for n, v in found[nonfinite_row].items() if not math.isfinite(v)],
            )
        for row, ratio, short in spike_rows:  # each to the panel; the fit's first also to the console
            at = steps[row]
            layers = ", ".join(name for name, _ in _largest(found[row]))
            track.spike = (
                at,
                f"gradient-norm spike at optimizer step {at}: {ratio:.1f}× its running average{short}; "
                f"largest layers: {layers}",
            )
            track.unreported.append(track.spike)

    def _count_clipped(self, track: _Track, totals: list[float], lrs: list[float]) -> None:
        """Count the finite ``totals`` that clipping by norm shrank, and the sum of their factors
        (:func:`~trainvitals.norms.clipping.clip_coef`, threshold / norm): the mean shrink of a clipped step; and
        over those steps the sums of the lrs they ran at (``lrs``) and of lr × factor, whose ratio is the base-lr
        cut that moves the weights as far as the clipping did under a schedule (:func:`_lr_cut`)."""
        steps = [(clip_coef(total, self._clip_norm), lr) for total, lr in zip(totals, lrs) if math.isfinite(total)]
        shrunk = [f for f, _ in steps if f < 1.0]
        clipping = track.state.clipping
        clipping["steps"] += len(steps)
        clipping["clipped"] += len(shrunk)
        clipping["shrink"] += sum(shrunk)
        # .get: a checkpoint of before the lr sums has none (its weighted cut then covers the steps since)
        clipping["lr"] = clipping.get("lr", 0.0) + sum(lr for _, lr in steps)
        clipping["lr_factor"] = clipping.get("lr_factor", 0.0) + sum(f * lr for f, lr in steps)
        clipping["max_norm"] = self._clip_norm

    def _log(
        self,
        trainer: "pl.Trainer",
        index: int,
        track: _Track,
        step: int,
        norms: bool = True,
        extra: dict[str, Tensor] | None = None,
    ) -> None:
        """Write the counters (``norms``: and the last read-back step's total and group norms) and ``extra``
        in one call to the loggers; report news once."""
        tag = lambda name: self._tag(trainer, name, index)  # noqa: E731
        metrics: dict[str, float | Tensor] = {tag(name): count for name, count in track.counts.items()}
        if self._clip_norm is not None and track.state.clipping["steps"]:  # the report's lr cut, over every step
            metrics[tag("clip_lr_cut")] = _lr_cut(track.state.clipping)
        if norms and track.last_read is not None:
            track.logged_step, total, group_norms = track.last_read
            metrics[tag("total")] = total
            metrics.update({tag(_layer_tag(name)): value for name, value in group_norms.items()})
        # A non-finite step is counted and its layers named in a warning; a NaN point draws nothing in a chart.
        log_scalars(trainer, {**metrics, **(extra or {})}, step, finite_only=True)
        track.logged_counts = dict(track.counts)
        if track.unreported and track.counts["spike_steps"] > track.reported_spikes:
            track.reported_spikes = track.counts["spike_steps"]
            for at, message in track.unreported:
                if not track.said_spike:
                    track.said_spike = True
                    self.info(message + first_spike_note(f"{tag('spike_steps')} and the fit-end line"))
                log_text(trainer, tag("spikes"), message, at)
            track.unreported = []

    def _search_producer(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer,
        track: _Track,
        step: int,
    ) -> None:
        """After a read-back that found the fit's first non-finite step: re-run its batches once to name the
        producer, when that step is this one (not yet applied: the weights are those its batches ran with);
        every rank reads back the same norms, so all of them search at the same step."""
        if track.nonfinite is None or not self._searching or self.search.searched:
            return
        if track.nonfinite[0] != step or not self.search.batches:
            track.read_late = step if track.nonfinite[0] != step else None
            self.search.give_up()  # the weights have moved on: nothing left to re-run
            return
        # Every step before this first non-finite one had finite gradients and was applied.
        self.search.search(trainer, pl_module, optimizer, self.search.batches, track.steps > 0, self)

    def _warn_nonfinite(self) -> None:
        """Once per track, the first non-finite step read back: the layers whose gradient held it (they carry the
        inf/NaN; the one that made it may be earlier), and the producer, named by a TrainingGuard or by this
        monitor's own re-run of the batch."""
        for track in self._tracks.values():
            if track.nonfinite is None or track.warned_nonfinite:
                continue
            track.warned_nonfinite = True
            at, layers = track.nonfinite
            guard = self.vitals.provider(NAN_PRODUCER)
            producer: Producer | None = getattr(guard, "producer", None) if guard is not None else self.search.producer
            by = "TrainingGuard's" if guard is not None else "a"
            if producer is not None:
                cause = (
                    f"It was made by {producer.describe()}, as {by} re-run of the batch found: fix that "
                    "operation (clamp its input, compute it in float32, add an epsilon) before the lr."
                )
            else:
                cause = (
                    "Without a GradScaler this is divergence or an operation that made an inf/NaN: lower the lr, "
                    "check the loss for log(0)/division by zero, or enable gradient clipping."
                    + self._why_no_producer(track, guard is not None)
                )
            self.warn(
                f"non-finite gradient (inf/NaN) at optimizer step {at}; first in: {', '.join(layers[:5]) or 'unknown'}"
                f" (the layers whose gradient held it). {cause}"
            )

    def _why_no_producer(self, track: _Track, guarded: bool) -> str:
        """Why the warning names no producer, in a sentence (empty beside a TrainingGuard, which says it)."""
        if guarded:
            return ""
        if self._manual:
            return (
                " Its producer is not searched under manual optimization: a training_step that steps its "
                "optimizers itself cannot be re-run."
            )
        if not self.name_producer:
            return " name_producer=True (or TrainingGuard()) names the layer that made it."
        if track.read_late is not None:
            return (
                f" Its producer cannot be named: the step was read back at step {track.read_late}, after its "
                "update made the weights non-finite; log_every_n_steps=1 reads each step before its update, "
                "and TrainingGuard() does at any cadence."
            )
        if self.search.rerun:
            batches = ", ".join(map(str, self.search.rerun))
            return f" A re-run of batch {batches} stayed finite: the inf/NaN did not come back from the same input."
        return " TrainingGuard() names the layer that made it."

    def _log_histograms(self, trainer: "pl.Trainer", index: int, track: _Track, step: int) -> None:
        by_group: dict[int, list[Tensor]] = {}
        sharded = False
        for i, p in enumerate(track.params):
            if p.grad is not None and is_dtensor(p.grad):
                sharded = True  # rank zero holds a shard: a histogram of it would not be the layer's
            elif p.grad is not None:
                by_group.setdefault(int(track.groups.index[i]), []).append(p.grad.reshape(-1))
        if sharded:
            self.warn(
                "the histograms of sharded (FSDP2, DTensor) gradients are not drawn: global rank zero holds only"
                " its shard of them. Their norms and the histogram of the layers' norms are whole.",
                once=True,
            )
        for g, grads in by_group.items():
            log_histogram(trainer, self._tag(trainer, f"hist/{track.groups.names[g]}", index), grads, step)
        group_norms = grouped_norms(track.latest, track.groups, self.norm_type)
        log_histogram(trainer, self._tag(trainer, "hist/group_norms", index), group_norms, step)


def _clipped_most(track: _Track, optimizer: str, family: str, lrs: list[SetLR]) -> str:
    """The fit-end line's sentence when clipping by norm shrank most steps (:func:`~trainvitals.norms.clipping.
    clips_most`): their share and mean factor; under SGD (``family``, of the class ``optimizer``) the mean factor
    over every step is an lr cut, said as one on the lr set (``lrs``: under a scheduler its base lr,
    :func:`~trainvitals.norms.clipping.lower_lr`); under Adam-like optimizers it cancels. "" otherwise."""
    clipping = track.state.clipping
    steps, clipped = int(clipping["steps"]), int(clipping["clipped"])
    if not clips_most(clipped, steps):
        return ""
    said = (
        f"; gradient clipping at {clipping['max_norm']:g} (by norm) clipped {clipped} of {steps} steps "
        f"({clipped / steps:.0%}), each to ×{clipping['shrink'] / clipped:.2g} in mean (threshold / pre-clip norm): it "
        "rescales the typical step, not the outliers it is for"
    )
    report = "`trainvitals report` sets the threshold against the noise level"
    if family == "adam":
        return f"{said} (under {optimizer} a factor common to the steps cancels: no lr cut); {report}"
    scale, plain = _lr_cut(clipping), _plain_cut(clipping)
    unknown = "" if family == "sgd" else f" (how {optimizer or 'this optimizer'} responds is unknown)"
    weighted = (
        f" (the steps' factors in mean weighted by the lr each ran at, Σ lr·f / Σ lr, the base-lr cut that moves the "
        f"weights as far; ×{plain:.2g} unweighted)"
        if f"{scale:.2g}" != f"{plain:.2g}"
        else ""
    )
    return (
        f"{said}; under {optimizer if family == 'sgd' else 'SGD'}, whose step is lr × gradient{unknown}, it is an lr "
        f"cut of ×{scale:.2g} over the {steps} steps{weighted}: raise gradient_clip_val ({report}), or "
        f"{lower_lr(scale, lrs)} instead"
    )


def _plain_cut(clipping: dict[str, float]) -> float:
    """The mean clip factor over every step counted, an unclipped one ×1: the lr cut at a constant lr."""
    return (clipping["shrink"] + clipping["steps"] - clipping["clipped"]) / clipping["steps"]


def _lr_cut(clipping: dict[str, float]) -> float:
    """The lr cut clipping by norm amounts to under SGD over every step counted: Σ lr_t f_t / Σ lr_t, the clip
    factors' mean weighted by the lr each step ran at. Lowering the base lr by it scales the schedule and moves the
    weights as far in sum (Σ lr_t · f_t · g_t against Σ lr_t · s · g_t); at a constant lr the plain mean
    (:func:`_plain_cut`), which it falls back to where every step ran at lr 0."""
    lr = clipping.get("lr", 0.0)
    return clipping.get("lr_factor", 0.0) / lr if lr > 0 else _plain_cut(clipping)


def _layer_tag(group: str) -> str:
    """The tag name of a group's norm: its name, unless a module is named like a summary (``total``, ...)."""
    return f"{group} (layer)" if group in GRAD_NORM_SUMMARIES else group


def _largest(group_norms: dict[str, float], k: int = 3) -> list[tuple[str, float]]:
    """The ``k`` largest groups, largest first; a NaN norm counts as 0."""
    return sorted(group_norms.items(), key=lambda item: 0.0 if math.isnan(item[1]) else item[1], reverse=True)[:k]
