"""GradNormMonitor: total and per-layer gradient norms, non-finite gradients, spikes and histograms.

Measured once per optimizer step in ``on_before_optimizer_step``, where Lightning hands over the whole
accumulated gradient, already unscaled by the AMP GradScaler and not yet clipped (science.md §1).
Norms stay on the device; only logging steps move numbers to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from trainvitals.callbacks._writers import log_histogram, log_scalars, log_text
from trainvitals.core.noise import BiasCorrectedEMA
from trainvitals.core.norms import GROUPINGS, NormGroups, combine_norms, grouped_norms, per_tensor_norms, validate_norm_type


@dataclass
class _Track:
    """What the monitor keeps for one optimizer: its parameters, their groups, and device-side counters."""

    params: list[torch.nn.Parameter]
    groups: NormGroups
    ema: BiasCorrectedEMA
    steps: int = 0
    nonfinite_steps: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    amp_skipped_steps: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    spike_steps: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    # The first non-finite step's offending groups and the latest spike, recorded on the device so that
    # they can be reported at the next logging step without a sync on the step that saw them.
    first_nonfinite_groups: Tensor | None = None
    last_spike: Tensor | None = None  # (step, ratio, top-3 group indices) as float64
    warned_nonfinite: bool = False
    reported_spikes: int = 0
    # The groups of the parameters that currently have a gradient, cached on the gradients' device:
    # rebuilding the index tensor every step would be a host-to-device copy per step.
    present: tuple[int, ...] = ()
    present_groups: NormGroups | None = None

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
        total = combine_norms(group_norms, self.norm_type)
        self.last_total[index] = total

        step = trainer.global_step
        self._count_nonfinite(trainer, track, total, group_norms)
        self._detect_spike(track, total, group_norms, step)
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
                "nonfinite_steps": int(t.nonfinite_steps),
                "amp_skipped_steps": int(t.amp_skipped_steps),
                "spike_steps": int(t.spike_steps),
            }
            for i, t in self._tracks.items()
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Tracks are built lazily (they need the optimizer), so the state waits until then.
        self._restored = {int(k): v for k, v in state_dict.items()}

    # ------------------------------------------------------------------ helpers
    def _track(self, index: int, pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer) -> _Track:
        track = self._tracks.get(index)
        if track is not None:
            return track
        names = {p: n for n, p in pl_module.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        param_names = [names.get(p, f"unregistered.{i}") for i, p in enumerate(params)]
        track = _Track(params, NormGroups.from_names(param_names, self.grouping), BiasCorrectedEMA(self.spike_ema_beta))
        restored = self._restored.pop(index, None)
        if restored is not None:
            track.steps = int(restored.get("steps", 0))
            track.ema.load_state_dict(restored.get("ema", {}))
            track.nonfinite_steps += int(restored.get("nonfinite_steps", 0))
            track.amp_skipped_steps += int(restored.get("amp_skipped_steps", 0))
            track.spike_steps += int(restored.get("spike_steps", 0))
            track.reported_spikes = int(track.spike_steps)
        self._tracks[index] = track
        return track

    def _log_every(self, trainer: "pl.Trainer") -> int:
        return self.log_every_n_steps or max(1, trainer.log_every_n_steps)

    def _tag(self, trainer: "pl.Trainer", name: str, index: int = 0) -> str:
        if len(trainer.optimizers) > 1:
            return f"grad_norm/optimizer_{index}/{name}"
        return f"grad_norm/{name}"

    def _count_nonfinite(self, trainer: "pl.Trainer", track: _Track, total: Tensor, group_norms: Tensor) -> None:
        bad = ~torch.isfinite(total)
        device = total.device
        for name in ("nonfinite_steps", "amp_skipped_steps", "spike_steps"):
            setattr(track, name, getattr(track, name).to(device))
        if _grad_scaler_enabled(trainer):
            # The scaler skips this step and lowers its scale: calibration, not divergence.
            track.amp_skipped_steps += bad.long()
            return
        first = bad & (track.nonfinite_steps == 0)
        offending = ~torch.isfinite(group_norms)
        if track.first_nonfinite_groups is None:
            track.first_nonfinite_groups = torch.zeros_like(offending)
        track.first_nonfinite_groups = torch.where(first, offending, track.first_nonfinite_groups)
        track.nonfinite_steps += bad.long()

    def _detect_spike(self, track: _Track, total: Tensor, group_norms: Tensor, step: int) -> None:
        finite = torch.isfinite(total)
        spike = finite & (track.ema.count >= max(1, self.spike_warmup_steps)) & (total > self.spike_factor * track.ema.value)
        k = min(3, group_norms.numel())
        top = torch.topk(torch.nan_to_num(group_norms, nan=0.0), k).indices.to(torch.float64)
        # torch.full launches a fill kernel with the step as an argument: no host-to-device copy.
        record = torch.cat([torch.full((1,), float(step), dtype=torch.float64, device=total.device),
                            (total / track.ema.value.clamp_min(1e-300)).reshape(1), top])
        track.last_spike = record if track.last_spike is None else torch.where(spike, record, track.last_spike)
        track.spike_steps += spike.long()
        # A spike would inflate the EMA it is measured against; keep it out.
        track.ema.update(total, finite & ~spike)

    def _log(self, trainer: "pl.Trainer", index: int, track: _Track, total: Tensor, group_norms: Tensor, step: int) -> None:
        tag = lambda name: self._tag(trainer, name, index)  # noqa: E731
        metrics: dict[str, Tensor] = {
            tag("total"): total,
            tag("nonfinite_steps"): track.nonfinite_steps,
            tag("amp_skipped_steps"): track.amp_skipped_steps,
            tag("spike_steps"): track.spike_steps,
        }
        metrics.update({tag(name): group_norms[i] for i, name in enumerate(track.groups.names)})
        values = log_scalars(trainer, metrics, step)
        if values[tag("nonfinite_steps")] > 0 and not track.warned_nonfinite:
            track.warned_nonfinite = True
            mask = track.first_nonfinite_groups
            names = [n for n, bad in zip(track.groups.names, mask.tolist()) if bad] if mask is not None else []
            rank_zero_warn(
                f"trainvitals: non-finite gradient (inf/NaN) at or before optimizer step {step}; first in: "
                f"{', '.join(names[:5]) or 'unknown'}. Without a GradScaler this is divergence: lower the lr, "
                "check the loss for log(0)/division by zero, or enable gradient clipping."
            )
        spikes = int(values[tag("spike_steps")])
        if spikes > track.reported_spikes and track.last_spike is not None:
            track.reported_spikes = spikes
            at, ratio, *top = track.last_spike.tolist()
            layers = ", ".join(track.groups.names[int(i)] for i in top)
            message = (f"gradient-norm spike at optimizer step {int(at)}: {ratio:.1f}× its running average; "
                       f"largest layers: {layers}")
            rank_zero_info(f"trainvitals: {message}")
            log_text(trainer, tag("spikes"), message, int(at))

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


def _grad_scaler_enabled(trainer: "pl.Trainer") -> bool:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None and scaler.is_enabled()


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
