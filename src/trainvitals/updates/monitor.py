"""UpdateMonitor: what an optimizer step did to the weights — ‖Δθ‖, ‖Δθ‖/‖θ‖, its direction, Adam's moments.

The gradient says where the loss would go; the update says where the weights went. On a logging step
the parameters are copied at ``on_before_optimizer_step`` (the gradient is complete, the weights not
yet moved; under plain precision Lightning calls it inside the optimizer's closure, after backward, so
the copy does not live through the forward and backward), and the optimizer's own step post-hook
(``Optimizer.register_step_post_hook``) turns the copy into Δθ once the step is done: exact for every
optimizer, for manual optimization and several optimizers, for LBFGS (several closure evaluations, one
step), and for ``accumulate_grad_batches`` (one step per window). A step that Lightning began but the
optimizer never took (a GradScaler skipping an inf/NaN step) is counted, not logged as a ratio.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from trainvitals._validation import check_choice, check_float, check_int
from trainvitals.fused_norms import GROUPINGS, NormGroups, combine_norms, grouped_norms
from trainvitals.norms.clipping import CLIP_EPS, trainer_clip
from trainvitals.norms.spikes import (
    SpikeDetector,
    UsualBatch,
    effective_batch,
    first_spike_note,
    norm_spike,
    relative_noise_weight,
)
from trainvitals.plumbing.amp import scale_left_in_grads
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import StepBatches, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.sharding import reduce_shard_norms, reduce_shard_sums
from trainvitals.plumbing.sharing import GRAD_SQ_NORMS, STEP_BATCHES, SUMMARY
from trainvitals.plumbing.state import DeclaredState, IndexedStates, optimizer_index
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.text.markdown import markdown_table
from trainvitals.updates.measure import (
    adam_unit_step_norms,
    descent_dots,
    is_adam_like,
    is_noise_scaled,
    snapshot,
    step_change,
)

USUAL_RATIO = 1e-3
"""``usual_ratio``'s default: the rule of thumb of ~1e-3 per step."""


RECORD = ("measured", "above", "below", "with_grad", "still", "full_lr")
"""A group's counts over its logged steps: ratios defined, above and below the usual range; steps with a
non-zero gradient, and of those the steps where Δθ was exactly 0; ratios defined at a full lr
(:data:`FULL_LR_SHARE`), of which ``below`` counts the low ones."""
FULL_LR_SHARE = 0.5
"""A layer's step is at a full lr above this share of the peak lr its param group has had in the fit so far (a cut
to the share itself, StepLR's ``gamma=0.5``, is not): only then does a low ratio say that the lr is too small for the
layer. A schedule's decay or BandSchedule's cut (× 0.1) makes small steps on purpose, also where it decays one param
group alone."""


class UpdateTrackState(DeclaredState):
    """What one optimizer's track carries over a resume: its steps (skipped ones included), the skipped
    steps, the update-norm spikes and their EMA, the usual batch a short one is judged against, and each group's
    counts (:data:`RECORD`)."""

    def __init__(self, spikes: Callable[[], SpikeDetector], usual: Callable[[], UsualBatch]) -> None:
        self.steps: int
        self.add_state("steps", 0)
        self.skipped: int
        self.add_state("skipped", 0)
        self.spike_steps: int
        self.add_state("spike_steps", 0)
        self.spikes: SpikeDetector
        self.add_state("spikes", spikes, key="ema")
        self.usual: UsualBatch
        self.add_state("usual", usual, key="usual_batch")
        self.records: dict[str, dict[str, int]]
        self.add_state("records", dict)
        self.peak_lrs: dict[str, float]
        self.add_state("peak_lrs", dict)

    def record(self, group: str) -> dict[str, int]:
        record = self.records.setdefault(group, dict.fromkeys(RECORD, 0))
        record.setdefault("full_lr", record["measured"])  # a checkpoint from before the count: every step full
        return record


@dataclass
class _Track:
    """One optimizer: its parameters and groups, the step under way, and the host bookkeeping (:attr:`state`,
    what a checkpoint keeps of it)."""

    params: list[torch.nn.Parameter]
    groups: NormGroups
    state: UpdateTrackState
    optimizer: torch.optim.Optimizer | None = None
    handle: RemovableHandle | None = None
    begun: int | None = None  # global step of the step begun at on_before_optimizer_step, not yet taken
    lrs: list[float] = field(default_factory=list)  # the measured step's lr of each group (every owner's factor in)
    before: list[Tensor] | None = None  # θ before a measured step (its copy), then −Δθ
    grad_norms: Tensor | None = None
    grad_scale: Tensor | None = None
    weight: float | None = None  # the measured step's noise weight (this rank's), where its update scales with g
    clip: float | None = None  # the Trainer's norm clipping of this step (NaN: by value)
    last: dict[str, dict[str, float]] = field(default_factory=dict)  # each group's values at the last logged step
    spike: tuple[int, str] | None = None
    said_spike: bool = False  # this fit's first spike went to the console; the later ones are counted
    last_total_ratio: float = math.nan


class UpdateMonitor(TrainvitalsCallback):
    r"""Log the size and direction of each optimizer step, per layer and in total, at the logging cadence.

    Logged (step = ``trainer.global_step`` of the optimizer step; with several optimizers every tag gets
    an ``optimizer_<i>/`` infix after ``update/``):

    ==================================  ========================================================================
    ``update/weight_norm/<group>``      ‖θ‖₂ before the step
    ``update/norm/<group>``             ‖Δθ‖₂, Δθ = θ after the step − θ before
    ``update/ratio/<group>``            ‖Δθ‖/‖θ‖ (the rule of thumb: ~1e-3 per step)
    ``update/total_ratio``              the same over every parameter of the optimizer
    ``update/total_norm``               ‖Δθ‖₂ over every parameter of the optimizer
    ``update/grad_cosine/<group>``      cos(−Δθ, g): 1 for plain SGD, less where momentum or Adam turn the step
    ``update/exp_avg_norm/<group>``     Adam-like optimizers: ‖m‖₂ of the first moment after the step
    ``update/unit_step_norm/<group>``   Adam-like: ‖m̂/(√v̂ + ε)‖₂, the step per unit lr (before weight decay)
    ``update/skipped_steps``            steps begun but not taken (a GradScaler skipping an inf/NaN step)
    ==================================  ========================================================================

    ``<group>`` follows ``grouping`` as in :class:`~trainvitals.GradNormMonitor`. The gradient is the
    step's shared one (:mod:`trainvitals.plumbing.sharing`: no second pass over it for its norms), before
    clipping; the cosine reads ``.grad`` after the step (for LBFGS, its last closure evaluation's), the
    Trainer's clipping by norm undone (it keeps the direction) — with clipping by value it is not logged.
    A ratio over ‖θ‖ = 0, a cosine with a zero step or gradient, are not logged.

    Cost: a step that does not log costs nothing (no copy, no host sync). A logging step's transient
    memory is **at most the bytes of the parameters the optimizer steps** (one copy, turned into −Δθ in
    place, and reused for Adam's step per unit lr), plus ``(P,)`` rows; its numbers reach the host in one
    transfer. Sharded FSDP parameters reduce their norms and dot products over the ranks, as the gradient
    norms do; every rank computes the same values and findings.

    Findings (the summary, the report): groups whose ratio was more than ``ratio_factor`` times above or
    below ``usual_ratio`` in more than half of their logged steps (below: of those at a full lr, :data:`FULL_LR_SHARE`);
    groups that did not move (Δθ = 0 at
    every logged step where their gradient was not zero: lr 0 in their param group, or frozen by the
    optimizer); spikes of the total update norm (``spike_factor`` × its running average over logged steps).

    Args:
        grouping: ``"parameter"``, ``"module"`` or ``"block"``.
        log_every_n_steps: cadence in optimizer steps; ``None`` uses the Trainer's ``log_every_n_steps``.
        usual_ratio: the usual ‖Δθ‖/‖θ‖ per step, > 0.
        ratio_factor: how far from ``usual_ratio`` (either way) a ratio is unusual, > 1.
        spike_factor: an update norm above ``spike_factor`` × its EMA is a spike; > 1.
        ema_beta: decay of that EMA per logged step, in [0, 1).
        spike_warmup_steps: logged steps before spikes are looked for.

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
    """

    provides = (SUMMARY,)
    reads = (GRAD_SQ_NORMS, STEP_BATCHES)

    def __init__(
        self,
        grouping: str = "module",
        log_every_n_steps: int | None = None,
        usual_ratio: float = USUAL_RATIO,
        ratio_factor: float = 100.0,
        spike_factor: float = 5.0,
        ema_beta: float = 0.9,
        spike_warmup_steps: int = 5,
    ) -> None:
        super().__init__()
        self.grouping = check_choice("grouping", grouping, GROUPINGS)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 1, none_ok=True)
        self.usual_ratio = check_float("usual_ratio", usual_ratio, 0.0, low_open=True)
        self.ratio_factor = check_float("ratio_factor", ratio_factor, 1.0, low_open=True)
        self.spike_factor, self.ema_beta, self.spike_warmup_steps = SpikeDetector.check_arguments(
            spike_factor, ema_beta, spike_warmup_steps, names=("spike_factor", "ema_beta", "spike_warmup_steps")
        )
        self.key_state_by(grouping=self.grouping)
        # Tracks are built at an optimizer's first step (they need its parameters); what a checkpoint keeps
        # of them is declared apart, so that a loaded state is kept by a fit that builds no track.
        self._track_states: IndexedStates
        spikes = partial(SpikeDetector, self.spike_factor, self.ema_beta, self.spike_warmup_steps)
        usual = partial(UsualBatch, round(1.0 / (1.0 - self.ema_beta)))  # over the spike EMA's horizon
        self.add_state("_track_states", partial(IndexedStates, partial(UpdateTrackState, spikes, usual)), key="tracks")
        self._tracks: dict[int, _Track]
        self.add_state("_tracks", {}, persistent=False)
        self._trainer: pl.Trainer | None = None
        self._sizes = False  # an optimizer's update scales with its gradient: the micro-batches are sized

    # ------------------------------------------------------------------ hooks
    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._trainer = trainer

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._sizes = any(is_noise_scaled(optimizer) for optimizer in trainer.optimizers)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, i: int) -> None:
        if self._sizes:
            StepBatches.of(self.vitals).start(self, trainer, batch, i)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._sizes:
            StepBatches.of(self.vitals).backward(self, trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        index = optimizer_index(trainer, optimizer)
        track = self._track(index, pl_module, optimizer)
        step = trainer.global_step
        if track.begun == step:
            return  # LBFGS evaluates its closure, and Lightning this hook, several times per step: the first counts
        if track.begun is not None:
            self._skip(trainer, index, track)  # the step before was never taken
        track.begun = step
        if not is_logging_step(track.state.steps, logging_every(trainer, self.log_every_n_steps)):
            return
        track.grad_norms = self.vitals.grad_norms.norms(trainer, optimizer, track.params)
        track.grad_scale = scale_left_in_grads(trainer, optimizer)
        track.clip = trainer_clip(trainer, pl_module)  # NaN by value: the cosine is then not defined from the norms
        track.weight = None
        if self._sizes and is_noise_scaled(optimizer):  # host floats
            sizes = StepBatches.of(self.vitals).backward_sizes(trainer)
            track.weight = relative_noise_weight(sizes, loss_divisor(trainer, pl_module))
        track.lrs = group_lrs(optimizer, track.groups)  # as the step will use them
        track.before = snapshot(track.params)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        # Every step Lightning began in this batch has been taken by now, or skipped (a GradScaler's
        # ``step`` does not call the optimizer's on an inf/NaN gradient, so its post-hook never ran).
        for index, track in self._tracks.items():
            if track.begun is not None:
                self._skip(trainer, index, track)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hooks()
        self._trainer = None

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())
        for finding in self.findings(spikes=False):  # the first spike was said when flagged, the rest are counted
            self.warn(finding)

    # ------------------------------------------------------------------ results
    def findings(self, spikes: bool = True) -> list[str]:
        """What the logged steps say, one sentence each: ratios out of range, groups that do not move and, with
        ``spikes``, the latest update-norm spike (class docstring; the summary and the report list it, the fit's
        end does not say it again)."""
        low, high = self.usual_ratio / self.ratio_factor, self.usual_ratio * self.ratio_factor
        found = []
        states = self._track_states.by_index
        for index, state in sorted(states.items()):
            where = f" (optimizer {index})" if len(states) > 1 else ""
            records = state.records
            still = [n for n, r in records.items() if r["with_grad"] and r["still"] == r["with_grad"]]
            if still:
                found.append(
                    f"layers that do not move{where}: {_listed(still)} — Δθ = 0 at every logged step while "
                    "their gradient is not zero: lr 0 in their param group, or frozen by the optimizer"
                )
            above = [n for n, r in records.items() if r["measured"] and r["above"] * 2 > r["measured"]]
            below = [
                n for n, r in records.items() if n not in still and r["below"] * 2 > r.get("full_lr", r["measured"]) > 0
            ]
            if above:
                found.append(
                    f"update/weight ratio above {high:g} in most logged steps{where}: {_listed(above)} — "
                    "steps this large rewrite the layer each step: lower its lr"
                )
            if below:
                found.append(
                    f"update/weight ratio below {low:g} in most logged steps{where}: {_listed(below)} — "
                    "the layer barely learns: its lr is too small for its weights' scale"
                )
            track = self._tracks.get(index)
            if spikes and track is not None and track.spike is not None:
                found.append(track.spike[1] + where)
        return found

    def summary_line(self) -> str:
        """One line for the end of fit: per optimizer, the steps seen, the last total ratio, skipped steps."""
        parts = [
            f"{'optimizer ' + str(i) + ': ' if len(self._tracks) > 1 else ''}{t.state.steps} steps, last ‖Δθ‖/‖θ‖ "
            f"{t.last_total_ratio:.3g}, skipped {t.state.skipped}, update-norm spikes {t.state.spike_steps}"
            for i, t in sorted(self._tracks.items())
        ]
        return "; ".join(parts) or "no optimizer step was measured."

    def summary_markdown(self) -> str:
        """End-of-run markdown: per group its last ‖θ‖, ‖Δθ‖, ratio and cosine; then the findings."""
        rows = []
        for index, track in sorted(self._tracks.items()):
            for name, last in track.last.items():
                rows.append(
                    (
                        index,
                        name,
                        *(_cell(last.get(k, math.nan)) for k in ("weight_norm", "norm", "ratio", "grad_cosine")),
                    )
                )
        if not rows:
            return "No optimizer step was measured."
        lines = markdown_table(("optimizer", "group", "‖θ‖", "‖Δθ‖", "‖Δθ‖/‖θ‖", "cos(−Δθ, g)"), rows, align="llrrrr")
        found = self.findings()
        return "\n".join([*lines, *(["", *(f"- {f}" for f in found)] if found else [])])

    # ------------------------------------------------------------------ the measured step
    def _after_step(self, index: int, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The optimizer's step post-hook: the step was taken."""
        track = self._tracks.get(index)
        trainer = self._trainer
        if track is None or track.begun is None or trainer is None:
            return  # a step Lightning did not begin (a user's own call of the bare optimizer)
        step, track.begun = track.begun, None
        track.state.steps += 1
        before, track.before = track.before, None
        if before is None:
            return
        try:
            self._measure(trainer, index, track, optimizer, before, step)
        except (RuntimeError, TypeError, ValueError) as err:  # inside the optimizer's step: never end the run
            self.cannot_measure(f"the update of optimizer {index} could not be measured ({type(err).__name__}: {err})")

    def _measure(
        self,
        trainer: "pl.Trainer",
        index: int,
        track: _Track,
        optimizer: torch.optim.Optimizer,
        before: list[Tensor],
        step: int,
    ) -> None:
        weight, update = step_change(before, track.params)
        dots = descent_dots(before, [p.grad for p in track.params])
        if track.grad_scale is not None:
            dots = dots / track.grad_scale.to(dots)
        dots = reduce_shard_sums(trainer, dots)
        if track.clip is not None and track.grad_norms is not None:
            # ``.grad`` is the clipped gradient now: by norm, c·g with c = min(1, clip / (‖g‖ + 1e-6))
            # (torch's clip_grad_norm_), the same direction, so ⟨−Δθ, g⟩ = ⟨−Δθ, c·g⟩ / c; by value, another
            # direction, whose norm is not known here: no cosine.
            coef = (track.clip / (combine_norms(track.grad_norms) + CLIP_EPS)).clamp(max=1.0)
            dots = dots / coef.to(dots)
        rows = [weight, update]
        adam = is_adam_like(optimizer)
        if adam:
            rows.extend(adam_unit_step_norms(optimizer, track.params, before))
        del before
        rows = [grouped_norms(reduce_shard_norms(trainer, row), track.groups) for row in rows]
        grads = track.grad_norms if track.grad_norms is not None else torch.zeros_like(weight)
        rows.append(grouped_norms(grads.to(weight), track.groups))
        rows.append(dots.new_zeros(len(track.groups.names)).index_add_(0, track.groups.index.to(dots.device), dots))
        totals = torch.stack([combine_norms(rows[0]), combine_norms(rows[1])])
        parts, world = [totals, *rows], trainer.world_size
        if track.weight is not None and world > 1:  # the ranks' noise weights summed: every rank judges one batch
            weights = torch.tensor([track.weight], dtype=torch.float64, device=totals.device)
            parts.append(trainer.strategy.reduce(weights, reduce_op="sum"))
        host = torch.cat(parts).tolist()  # one transfer
        batch = math.nan
        if track.weight is not None:
            batch = effective_batch(host.pop() if world > 1 else world * track.weight, world)
        self._record(trainer, index, track, step, adam, host, batch)

    def _record(
        self, trainer: "pl.Trainer", index: int, track: _Track, step: int, adam: bool, host: list[float], batch: float
    ) -> None:
        """Log one measured step's values (host floats) and update the findings' bookkeeping; ``batch``: the step's
        effective batch where its update scales with its gradient (the spike rule's allowance), else NaN."""
        n = len(track.groups.names)
        total_weight, total_update, values = host[0], host[1], host[2:]
        weight, update, *rest = (values[k * n : (k + 1) * n] for k in range(len(values) // n))
        first, unit = rest[:2] if adam else ([], [])
        grad, dots = rest[-2:]
        tag = functools.partial(self._tag, trainer, index=index)
        metrics: dict[str, float] = {tag("skipped_steps"): track.state.skipped, tag("total_norm"): total_update}
        track.last_total_ratio = _ratio(total_update, total_weight)
        metrics[tag("total_ratio")] = track.last_total_ratio
        low, high = self.usual_ratio / self.ratio_factor, self.usual_ratio * self.ratio_factor
        for g, name in enumerate(track.groups.names):
            values_g = {
                "weight_norm": weight[g],
                "norm": update[g],
                "ratio": _ratio(update[g], weight[g]),
                "grad_cosine": _ratio(dots[g], update[g] * grad[g]),
            }
            if adam:
                values_g.update(exp_avg_norm=first[g], unit_step_norm=unit[g])
            metrics.update({tag(f"{key}/{name}"): value for key, value in values_g.items()})
            record = track.state.record(name)
            track.last[name] = values_g
            ratio = values_g["ratio"]
            if math.isfinite(ratio):
                full, track.state.peak_lrs[name] = at_full_lr(track.lrs[g], track.state.peak_lrs.get(name, 0.0))
                record["measured"] += 1
                record["above"] += ratio > high
                record["full_lr"] += full
                record["below"] += full and 0.0 < ratio < low  # 0: not moving at all, a finding of its own
            if grad[g] > 0.0 and math.isfinite(grad[g]):
                record["with_grad"] += 1
                record["still"] += update[g] == 0.0
        track.last_step = step
        log_scalars(trainer, metrics, step, finite_only=True)
        usual = track.state.usual if track.weight is not None else None
        if math.isfinite(total_update) and (found := norm_spike(total_update, batch, track.state.spikes, usual)):
            track.state.spike_steps += 1
            largest = sorted(track.groups.names, key=lambda name: -update[track.groups.names.index(name)])[:3]
            track.spike = (
                step,
                f"update-norm spike at optimizer step {step}: ‖Δθ‖ {found[0]:.1f}× its running average{found[1]}; "
                f"largest layers: {', '.join(largest)}",
            )
            if not track.said_spike:
                track.said_spike = True
                self.info(track.spike[1] + first_spike_note("the fit-end line"))
            log_text(trainer, tag("spikes"), track.spike[1], step)

    def _skip(self, trainer: "pl.Trainer", index: int, track: _Track) -> None:
        """The step begun at ``track.begun`` was not taken: counted (and logged, if it was a measured one)."""
        step, track.begun = track.begun, None
        track.state.steps += 1
        track.state.skipped += 1
        if track.before is not None:
            track.before = None
            log_scalars(trainer, {self._tag(trainer, "skipped_steps", index): track.state.skipped}, step)

    # ------------------------------------------------------------------ helpers
    def _track(self, index: int, pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer) -> _Track:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        track = self._tracks.get(index)
        if track is not None and len(params) == len(track.params) and all(map(operator.is_, params, track.params)):
            return self._hooked(index, track, optimizer)
        # First step, or parameters were added to the optimizer: regroup, keeping the counters.
        names = {p: n for n, p in pl_module.named_parameters()}
        groups = NormGroups.from_names([names.get(p, f"unregistered.{i}") for i, p in enumerate(params)], self.grouping)
        if track is not None:
            track.params, track.groups = params, groups
            return self._hooked(index, track, optimizer)
        track = _Track(params, groups, self._track_states.get(index))
        self._tracks[index] = track
        return self._hooked(index, track, optimizer)

    def _hooked(self, index: int, track: _Track, optimizer: torch.optim.Optimizer) -> _Track:
        """``track`` with this callback's step post-hook on ``optimizer`` (moved there if the Trainer's
        optimizer of that index was replaced)."""
        if track.optimizer is not optimizer or track.handle is None:
            if track.handle is not None:
                track.handle.remove()
            track.optimizer = optimizer
            track.handle = optimizer.register_step_post_hook(functools.partial(self._after_step, index))
        return track

    def _remove_hooks(self) -> None:
        for track in self._tracks.values():
            if track.handle is not None:
                track.handle.remove()
            track.handle = track.optimizer = None

    def _tag(self, trainer: "pl.Trainer", name: str, index: int = 0) -> str:
        if len(trainer.optimizers) > 1:
            return f"update/optimizer_{index}/{name}"
        return f"update/{name}"


def _listed(names: list[str], most: int = 8) -> str:
    """``names`` joined, the first ``most`` of them and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _cell(value: float) -> str:
    """A table cell: 3 significant digits, ``n/a`` for a value not defined (a cosine with a zero step)."""
    return f"{value:.3g}" if math.isfinite(value) else "n/a"


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN (not logged) over 0 or a non-finite value."""
    if denominator == 0.0 or not math.isfinite(denominator) or not math.isfinite(numerator):
        return math.nan
    return numerator / denominator


def group_lrs(optimizer: torch.optim.Optimizer, groups: NormGroups) -> list[float]:
    """Each of ``groups``' lr, the largest of the param groups holding its tensors (``groups`` over the optimizer's
    parameters in param-group order, as :meth:`UpdateMonitor._track` builds them)."""
    lrs = [-math.inf] * len(groups.names)
    per_tensor = (float(group["lr"]) for group in optimizer.param_groups for _ in group["params"])
    for g, lr in zip(groups.index.tolist(), per_tensor, strict=True):
        lrs[g] = max(lrs[g], lr)
    return lrs


def at_full_lr(lr: float, peak: float) -> tuple[bool, float]:
    """Whether a layer's step at ``lr`` is above :data:`FULL_LR_SHARE` of ``peak``, the layer's peak lr in the fit so
    far, by more than rounding (a cut to exactly the share is not full), and the peak it raises; an unknown lr is
    full."""
    if not math.isfinite(lr):
        return True, peak
    peak = max(peak, lr)
    return lr > FULL_LR_SHARE * peak * (1.0 + 1e-9), peak
