"""GradNormMonitor: total and per-layer gradient norms, non-finite gradients, spikes and histograms.

Measured once per optimizer step in ``on_before_optimizer_step``, where Lightning hands over the whole
accumulated gradient, already unscaled by the AMP GradScaler and not yet clipped (docs/science.md §1).
Norms stay on the device; only logging steps move numbers to the host.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from trainvitals.callbacks._amp import grad_scaler, scale_left_in_grads
from trainvitals.callbacks._writers import log_histogram, log_scalars, log_text
from trainvitals.core.noise import BiasCorrectedEMA
from trainvitals.core.norms import GROUPINGS, NormGroups, combine_norms, grouped_norms, per_tensor_norms, validate_norm_type


COUNTERS = ("nonfinite_steps", "amp_skipped_steps", "spike_steps")


@dataclass
class _Track:
    """What the monitor keeps for one optimizer: its parameters, their groups, and device-side counters."""

    params: list[torch.nn.Parameter]
    groups: NormGroups
    ema: BiasCorrectedEMA
    steps: int = 0
    # Steps counted on the device, in the order of COUNTERS.
    counts: Tensor = field(default_factory=lambda: torch.zeros(len(COUNTERS), dtype=torch.long))
    # The group norms of the first non-finite step and of the latest spike, with that spike's step and
    # ratio: kept on the device so that they are reported at the next logging step without a sync now.
    first_nonfinite_norms: Tensor | None = None
    spike_norms: Tensor | None = None
    spike_at: Tensor | None = None
    spike_ratio: Tensor | None = None
    warned_nonfinite: bool = False
    reported_spikes: int = 0
    # The groups of the parameters that currently have a gradient, cached on the gradients' device:
    # rebuilding the index tensor every step would be a host-to-device copy per step.
    present: tuple[int, ...] = ()
    present_groups: NormGroups | None = None
    last_group_norms: Tensor | None = None

    def groups_of_present(self, present: tuple[int, ...], device: torch.device) -> NormGroups:
        if present != self.present or self.present_groups is None or self.present_groups.index.device != device:
            index = self.groups.index[list(present)].to(device)
            self.present, self.present_groups = present, NormGroups(self.groups.names, index)
        return self.present_groups


class GradNormMonitor(Callback):
    r"""Log the gradient norm, per layer and in total, once per optimizer step.

    Logged (step = ``trainer.global_step`` of the optimizer step; with several optimizers every tag
    gets an ``optimizer_<i>/`` infix after ``grad_norm/``):

    - ``grad_norm/total``: ‖g‖_p over every parameter of the optimizer that has a gradient — the
      accumulated, AMP-unscaled gradient, before clipping;
    - ``grad_norm/<group>``: the norm of each group (``grouping``: ``"parameter"``, ``"module"`` or
      ``"block"``, the top-level child); total^p = Σ group^p;
    - ``grad_norm/clipped_total``: the norm after the Trainer's gradient clipping, when it clips;
    - ``grad_norm/nonfinite_steps``: steps whose gradient held inf/NaN (one warning names the layers
      of the first); ``grad_norm/amp_skipped_steps``: such steps under a GradScaler, which skips them
      and lowers its scale — calibration, not divergence;
    - ``grad_norm/spike_steps``: steps with a total above ``spike_factor`` × its running EMA; the
      latest spike (step, ratio, three largest groups) goes to the text panel ``grad_norm/spikes``;
    - every ``histogram_every_n_steps``: histograms ``grad_norm/hist/<group>`` of gradient values and
      ``grad_norm/hist/group_norms`` of the group norms (TensorBoard, global rank zero only).

    Args:
        norm_type: p of the p-norm, > 0 or ``"inf"``.
        grouping: how per-layer norms are grouped: ``"parameter"``, ``"module"`` or ``"block"``.
        log_every_n_steps: logging cadence in optimizer steps; ``None`` uses the Trainer's
            ``log_every_n_steps``. Steps that do not log do no host sync.
        histogram_every_n_steps: histogram cadence in optimizer steps; 0 turns histograms off.
        spike_factor: a total above ``spike_factor`` × EMA(total) is a spike; must be > 1.
        spike_ema_beta: decay of that EMA per optimizer step, in [0, 1).
        spike_warmup_steps: steps before spikes are looked for (the EMA needs history).

    Raises:
        ValueError: on an invalid argument, naming it.
    """

    def __init__(
        self,
        norm_type: float | int | str = 2.0,
        grouping: str = "module",
        log_every_n_steps: int | None = None,
        histogram_every_n_steps: int = 100,
        spike_factor: float = 5.0,
        spike_ema_beta: float = 0.98,
        spike_warmup_steps: int = 20,
    ) -> None:
        self.norm_type = validate_norm_type(norm_type)
        if grouping not in GROUPINGS:
            raise ValueError(f"`grouping` must be one of {GROUPINGS}, got {grouping!r}")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"`log_every_n_steps` must be >= 1 or None, got {log_every_n_steps}")
        if histogram_every_n_steps < 0:
            raise ValueError(f"`histogram_every_n_steps` must be >= 0 (0 = off), got {histogram_every_n_steps}")
        if not spike_factor > 1.0:
            raise ValueError(f"`spike_factor` must be > 1, got {spike_factor}")
        if not 0.0 <= spike_ema_beta < 1.0:
            raise ValueError(f"`spike_ema_beta` must be in [0, 1), got {spike_ema_beta}")
        if spike_warmup_steps < 0:
            raise ValueError(f"`spike_warmup_steps` must be >= 0, got {spike_warmup_steps}")
        self.grouping = grouping
        self.log_every_n_steps = log_every_n_steps
        self.histogram_every_n_steps = histogram_every_n_steps
        self.spike_factor = spike_factor
        self.spike_ema_beta = spike_ema_beta
        self.spike_warmup_steps = spike_warmup_steps
        self._tracks: dict[int, _Track] = {}
        self._restored: dict[int, dict[str, Any]] = {}
        self._clip_pending: tuple[int, int] | None = None  # (optimizer index, step) to measure after clipping
        self.last_total: dict[int, Tensor] = {}
        """The latest total norm per optimizer index (0-d device tensor), for other callbacks to read."""

    @property
    def state_key(self) -> str:
        return self._generate_state_key(norm_type=self.norm_type, grouping=self.grouping)

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A new fit (another fold, another model) starts afresh; a resumed one gets its state from
        # ``load_state_dict``, which Lightning calls before this hook and which fills ``_restored``.
        self._tracks, self.last_total, self._clip_pending = {}, {}, None

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        index = _optimizer_index(trainer, optimizer)
        track = self._track(index, pl_module, optimizer)
        present = tuple(i for i, p in enumerate(track.params) if p.grad is not None)
        if not present:
            return
        norms = per_tensor_norms([track.params[i].grad for i in present], self.norm_type)
        group_norms = grouped_norms(norms, track.groups_of_present(present, norms.device), self.norm_type)
        group_norms = _reduce_if_sharded(trainer, group_norms, self.norm_type)
        scale = scale_left_in_grads(trainer, optimizer)
        if scale is not None:  # a fused optimizer will unscale in its step; report unscaled norms
            group_norms = group_norms / scale.to(group_norms)
        total = combine_norms(group_norms, self.norm_type)
        self.last_total[index] = total
        track.last_group_norms = group_norms

        step = trainer.global_step
        self._count(trainer, track, total, group_norms, step)
        if track.steps % self._log_every(trainer) == 0:
            self._log(trainer, index, track, total, group_norms, step)
            if _clips(trainer, pl_module):
                self._clip_pending = (index, step)
        if self.histogram_every_n_steps and track.steps % self.histogram_every_n_steps == 0 and trainer.is_global_zero:
            self._log_histograms(trainer, index, track, present, group_norms, step)
        track.steps += 1

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._clip_pending is None:
            return
        index, step = self._clip_pending
        self._clip_pending = None
        track = self._tracks[index]
        grads = [p.grad for p in track.params if p.grad is not None]
        group_norms = _reduce_if_sharded(trainer, per_tensor_norms(grads, self.norm_type), self.norm_type)
        clipped = combine_norms(group_norms, self.norm_type)
        log_scalars(trainer, {self._tag(trainer, "clipped_total"): clipped}, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            str(i): {
                "steps": t.steps,
                "ema": t.ema.state_dict(),
                **dict(zip(COUNTERS, t.counts.tolist())),
            }
            for i, t in self._tracks.items()
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Tracks are built lazily (they need the optimizer), so the state waits until then.
        self._restored = {int(k): v for k, v in state_dict.items()}

    def summary_markdown(self) -> str:
        """End-of-run markdown: per optimizer, the last total norm, its largest groups, and the counters."""
        lines = ["| optimizer | steps | last ‖g‖ | largest groups (last step) | non-finite | AMP-skipped | spikes |",
                 "|---|---:|---:|---|---:|---:|---:|"]
        for index, track in self._tracks.items():
            if track.last_group_norms is None:
                continue
            norms = track.last_group_norms.tolist()
            top = sorted(zip(norms, track.groups.names), reverse=True)[:3]
            counts = dict(zip(COUNTERS, track.counts.tolist()))
            lines.append(f"| {index} | {track.steps} | {float(self.last_total[index]):.4g} | "
                         + ", ".join(f"`{n}` {v:.3g}" for v, n in top)
                         + f" | {counts['nonfinite_steps']} | {counts['amp_skipped_steps']} | {counts['spike_steps']} |")
        return "\n".join(lines) if len(lines) > 2 else "No optimizer step was measured."

    # ------------------------------------------------------------------ helpers
    def _track(self, index: int, pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer) -> _Track:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        track = self._tracks.get(index)
        if track is not None and len(params) == len(track.params) and all(map(operator.is_, params, track.params)):
            return track
        # First step, or parameters were added to the optimizer (e.g. a backbone unfrozen by
        # BackboneFinetuning): regroup, keeping the counters and the EMA.
        names = {p: n for n, p in pl_module.named_parameters()}
        param_names = [names.get(p, f"unregistered.{i}") for i, p in enumerate(params)]
        groups = NormGroups.from_names(param_names, self.grouping)
        if track is not None:
            track.params, track.groups, track.present_groups = params, groups, None
            track.first_nonfinite_norms = track.spike_norms = None  # sized for the old groups
            return track
        track = _Track(params, groups, BiasCorrectedEMA(self.spike_ema_beta))
        restored = self._restored.pop(index, None)
        if restored is not None:
            track.steps = int(restored.get("steps", 0))
            track.ema.load_state_dict(restored.get("ema", {}))
            track.counts = torch.tensor([int(restored.get(name, 0)) for name in COUNTERS])
            track.reported_spikes = int(track.counts[COUNTERS.index("spike_steps")])
        self._tracks[index] = track
        return track

    def _log_every(self, trainer: "pl.Trainer") -> int:
        return self.log_every_n_steps or max(1, trainer.log_every_n_steps)

    def _tag(self, trainer: "pl.Trainer", name: str, index: int = 0) -> str:
        if len(trainer.optimizers) > 1:
            return f"grad_norm/optimizer_{index}/{name}"
        return f"grad_norm/{name}"

    def _count(self, trainer: "pl.Trainer", track: _Track, total: Tensor, group_norms: Tensor, step: int) -> None:
        """Non-finite steps, AMP-skipped steps and spikes, counted on the device in a handful of ops."""
        finite = torch.isfinite(total)
        if track.spike_norms is None:
            track.counts = track.counts.to(total.device)
            track.first_nonfinite_norms = track.spike_norms = group_norms
        if track.spike_at is None:
            track.spike_at = track.spike_ratio = torch.zeros_like(total)
        ema = track.ema.value
        spike = finite & (track.ema.count >= max(1, self.spike_warmup_steps)) & (total > self.spike_factor * ema)
        # Under a GradScaler a non-finite step is skipped and the scale lowered: calibration, not divergence.
        scaler = grad_scaler(trainer) is not None
        nonfinite, skipped = (torch.zeros_like(finite), ~finite) if scaler else (~finite, torch.zeros_like(finite))
        first = nonfinite & (track.counts[0] == 0)
        track.first_nonfinite_norms = torch.where(first, group_norms, track.first_nonfinite_norms)
        track.spike_norms = torch.where(spike, group_norms, track.spike_norms)
        # torch.full launches a fill kernel with the step as an argument: no host-to-device copy.
        track.spike_at = torch.where(spike, torch.full_like(total, float(step)), track.spike_at)
        track.spike_ratio = torch.where(spike, total / ema, track.spike_ratio)
        track.counts = track.counts + torch.stack([nonfinite, skipped, spike])
        # A spike enters the EMA clipped to the threshold: one spike barely moves it, while a lasting
        # level shift is followed within ~30 steps instead of being counted as a spike forever.
        track.ema.update(torch.where(spike, self.spike_factor * ema, total), finite)

    def _log(self, trainer: "pl.Trainer", index: int, track: _Track, total: Tensor, group_norms: Tensor, step: int) -> None:
        tag = lambda name: self._tag(trainer, name, index)  # noqa: E731
        metrics: dict[str, Tensor] = {tag("total"): total}
        metrics.update({tag(name): track.counts[i] for i, name in enumerate(COUNTERS)})
        metrics.update({tag(name): group_norms[i] for i, name in enumerate(track.groups.names)})
        values = log_scalars(trainer, metrics, step)
        if values[tag("nonfinite_steps")] > 0 and not track.warned_nonfinite:
            track.warned_nonfinite = True
            finite = torch.isfinite(track.first_nonfinite_norms).tolist()
            names = [n for n, ok in zip(track.groups.names, finite) if not ok]
            rank_zero_warn(
                f"trainvitals: non-finite gradient (inf/NaN) at or before optimizer step {step}; first in: "
                f"{', '.join(names[:5]) or 'unknown'}. Without a GradScaler this is divergence: lower the lr, "
                "check the loss for log(0)/division by zero, or enable gradient clipping."
            )
        spikes = int(values[tag("spike_steps")])
        if spikes > track.reported_spikes:
            track.reported_spikes = spikes
            top = torch.topk(torch.nan_to_num(track.spike_norms, nan=0.0), min(3, len(track.groups.names))).indices
            at, ratio = int(track.spike_at), float(track.spike_ratio)
            layers = ", ".join(track.groups.names[i] for i in top.tolist())
            message = (f"gradient-norm spike at optimizer step {at}: {ratio:.1f}× its running average; "
                       f"largest layers: {layers}")
            rank_zero_info(f"trainvitals: {message}")
            log_text(trainer, tag("spikes"), message, at)

    def _log_histograms(
        self, trainer: "pl.Trainer", index: int, track: _Track, present: tuple[int, ...], group_norms: Tensor, step: int
    ) -> None:
        by_group: dict[int, list[Tensor]] = {}
        for i in present:
            by_group.setdefault(int(track.groups.index[i]), []).append(track.params[i].grad.reshape(-1))
        for g, grads in by_group.items():
            log_histogram(trainer, self._tag(trainer, f"hist/{track.groups.names[g]}", index), torch.cat(grads), step)
        log_histogram(trainer, self._tag(trainer, "hist/group_norms", index), group_norms, step)


def _optimizer_index(trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> int:
    for i, opt in enumerate(trainer.optimizers):
        if opt is optimizer:
            return i
    return 0


def _clips(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
    return pl_module.automatic_optimization and bool(trainer.gradient_clip_val)


def _reduce_if_sharded(trainer: "pl.Trainer", norms: Tensor, norm_type: float) -> Tensor:
    """Under FSDP each rank holds a shard of every gradient: combine the shards' norms across ranks.

    DDP needs nothing: after the all-reduce every rank holds the same full gradient.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if not isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return norms
    if math.isinf(norm_type):
        return trainer.strategy.reduce(norms, reduce_op="max")
    return trainer.strategy.reduce(norms.pow(norm_type), reduce_op="sum").pow(1.0 / norm_type)
