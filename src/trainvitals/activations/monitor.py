"""ActivationMonitor: what the layers put out — scale, extremes, tails, dead units, the first non-finite output.

Every ``measure_every_n_steps`` optimizer steps, forward hooks are put on the chosen modules for the forward of
that step's first (micro-)batch and taken off at its ``on_train_batch_end``: the other steps run no hook
at all. Each hooked output is reduced on its device to one row of moments
(:func:`~trainvitals.activations.stats.output_moments`); the rows of the step are stacked, combined over
ranks, and read back in one transfer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from trainvitals._validation import check_callable, check_float, check_int
from trainvitals.activations.stats import (
    DEAD_TYPES,
    DEAD_WHY,
    INACTIVE_WHY,
    STATS,
    ZERO_GRADIENT_TYPES,
    combine_moments,
    finish,
    output_moments,
    output_tensors,
    units_word,
)
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.extra_forward import in_extra_forward
from trainvitals.plumbing.sharing import SUMMARY
from trainvitals.plumbing.state import reduce_packed
from trainvitals.plumbing.writers import log_scalars
from trainvitals.text.markdown import markdown_table


class ActivationMonitor(TrainvitalsCallback):
    r"""Log statistics of the chosen modules' outputs on one step in ``measure_every_n_steps``.

    Logged (step = ``trainer.global_step`` of the measured step):

    ======================================  ===================================================================
    ``activation/rms/<module>``             √(mean x²) over the output
    ``activation/abs_max/<module>``         max |x|
    ``activation/mean/<module>``            mean x
    ``activation/kurtosis/<module>``        E[(x − μ)⁴]/σ⁴: 3 for a Gaussian, large for heavy-tailed outliers
    ``activation/dead_fraction/<module>``   ReLU and ReLU6 outputs: share of units ≤ 0 for every example of the
                                            batch (dead: no gradient flows through them)
    ``activation/inactive_fraction/<m>``    the same of the other :data:`~trainvitals.activations.stats.DEAD_TYPES`
                                            (GELU, SiLU, ELU, ...): inactive, they pass their negative branch's
                                            small gradient
    ======================================  ===================================================================

    A module whose output is a tuple, list or dict logs each floating tensor in it as ``<module>[i]``.
    Dim 0 of an output is taken to be the batch. A module called several times in a forward is
    measured at its first call. Functional activations (``F.relu`` inside a ``forward``) are not modules
    and are not seen: use ``nn.ReLU`` layers for ``dead_fraction``.

    Cost: none on the other steps (no hook installed). On a measured step each hooked output costs a few
    fused reductions and two float32 temporaries of its size; one host transfer for the step.

    Distributed: the statistics are those of the global batch, identical on every rank: each rank's
    count, mean and central sums are gathered and combined exactly (one all-gather), the dead units'
    masks reduced by their maximum (one more), after a check that every rank hooked the same outputs
    (a small all-gather and a host read); if they did not, each rank keeps its own, with one warning.

    Findings (the summary, the report): units dead above ``dead_share`` at the last measured step;
    activations growing — rms up at each of the last ``growth_steps`` measured steps and by
    ``growth_factor``× or more across them; the first non-finite output (step, and the first module in
    forward order that produced it, warned at once).

    Args:
        measure_every_n_steps: cadence in optimizer steps; ``None`` uses the Trainer's ``log_every_n_steps``.
        modules: ``modules(name, module) -> bool`` chooses the measured modules by qualified name and
            type, e.g. ``lambda name, m: isinstance(m, nn.ReLU)``; ``None``: every leaf module (one without
            children). Under ``ddp_spawn`` it must be picklable (a module-level function).
        dead_share: a dead fraction above this share is a finding, in [0, 1). Dead is per batch (≤ 0 for every
            example of it): a unit that fires rarely looks dead on a small batch, hence 0.9, not 0.5.
        growth_factor: growth across the last ``growth_steps`` measurements that is a finding, > 1.
        growth_steps: consecutive increases that make a growth finding, ≥ 1.

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
    """

    provides = (SUMMARY,)

    def __init__(
        self,
        measure_every_n_steps: int | None = None,
        modules: Callable[[str, nn.Module], bool] | None = None,
        dead_share: float = 0.9,
        growth_factor: float = 4.0,
        growth_steps: int = 3,
    ) -> None:
        super().__init__()
        self.measure_every_n_steps = check_int("measure_every_n_steps", measure_every_n_steps, 1, none_ok=True)
        self.modules = check_callable("modules", modules, none_ok=True)
        self.dead_share = check_float("dead_share", dead_share, 0.0, 1.0, high_open=True)
        self.growth_factor = check_float("growth_factor", growth_factor, 1.0, low_open=True)
        self.growth_steps = check_int("growth_steps", growth_steps, 1)
        self.key_state_by(measure_every_n_steps=self.measure_every_n_steps)
        self.steps: int
        self.add_state("steps", 0)
        self._history: dict[str, list[float]]  # rms of the last growth_steps + 1 measurements, per output
        self.add_state("_history", {}, key="history")
        self._last: dict[str, dict[str, float]]  # the last measured step's statistics, per output
        self.add_state("_last", {}, key="last")
        self._last_step: int | None
        self.add_state("_last_step", None, key="last_step")
        # Per ReLU-family/GELU output: whether ≤ 0 there means no gradient (ReLU) or a small one (GELU, SiLU, ...).
        self.add_state("_zero_gradient", {}, key="zero_gradient")
        self._nonfinite: list[Any] | None  # [step, module] of the first non-finite output
        self.add_state("_nonfinite", None, key="nonfinite")
        self._modules: list[tuple[str, nn.Module]]
        self.add_state("_modules", list, persistent=False)
        self._handles: list[RemovableHandle]
        self.add_state("_handles", list, persistent=False)
        self._rows: dict[str, tuple[Tensor, Tensor | None]]  # this measured step's moments and masks, in forward order
        self.add_state("_rows", dict, persistent=False)
        self._measuring: int | None
        self.add_state("_measuring", None, persistent=False)

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._modules = [(name, module) for name, module in pl_module.named_modules() if self._chosen(name, module)]
        if not self._modules:
            self.cannot_measure("`modules` chose no module of the model: nothing is measured")

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", _: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return  # not the first micro-batch of an optimizer step
        measured = is_logging_step(self.steps, logging_every(trainer, self.measure_every_n_steps))
        self.steps += 1
        if not measured or not self._modules:
            return
        self._measuring, self._rows = trainer.global_step, {}
        self._handles = [
            module.register_forward_hook(functools.partial(self._on_output, name, isinstance(module, DEAD_TYPES)))
            for name, module in self._modules
        ]

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._measuring is None:
            return
        self._remove_hooks()
        step, rows, self._measuring, self._rows = self._measuring, self._rows, None, {}
        if rows or trainer.world_size > 1:  # a rank that hooked nothing still joins the others' collectives
            statistics = self._statistics(trainer, pl_module, list(rows.values()))
            if rows:
                self._record(trainer, step, dict(zip(rows, statistics.tolist())))

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hooks()

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())
        for finding in self.findings(nonfinite=False):  # the non-finite output was said at its step
            self.warn(finding)

    # ------------------------------------------------------------------ results
    def findings(self, nonfinite: bool = True) -> list[str]:
        """Dead units, growing activations and, with ``nonfinite``, the first non-finite output, one sentence each
        (class docstring; the summary and the report list that one, the fit's end does not say it again)."""
        found = []
        if nonfinite and self._nonfinite is not None:
            found.append(_nonfinite_finding(*self._nonfinite))
        dead = {k: v["dead_fraction"] for k, v in self._last.items() if v.get("dead_fraction", 0.0) > self.dead_share}
        zero = {k: v for k, v in dead.items() if self._zero_gradient.get(k, False)}
        if zero:
            found.append(
                f"dead units above {self.dead_share:.0%} at step {self._last_step}: "
                + ", ".join(f"`{k}` {v:.0%}" for k, v in zero.items())
                + f" — {DEAD_WHY}"
            )
        if inactive := {k: v for k, v in dead.items() if k not in zero}:
            found.append(
                f"inactive units above {self.dead_share:.0%} at step {self._last_step}: "
                + ", ".join(f"`{k}` {v:.0%}" for k, v in inactive.items())
                + f" — {INACTIVE_WHY}"
            )
        growing = [k for k, rms in self._history.items() if _growing(rms, self.growth_steps, self.growth_factor)]
        if growing:
            found.append(
                f"activations growing over the last {self.growth_steps} measurements by ≥ {self.growth_factor:g}×: "
                + ", ".join(f"`{k}`" for k in growing)
            )
        return found

    def summary_line(self) -> str:
        """One line for the end of fit: the outputs measured, the largest rms, the findings' count."""
        if not self._last:
            return "no step was measured."
        name, stats = max(self._last.items(), key=lambda kv: _finite_or(kv[1]["rms"], -1.0))
        return (
            f"{len(self._last)} outputs measured at step {self._last_step}; largest rms `{name}` {stats['rms']:.3g}; "
            f"{len(self.findings())} findings"
        )

    def summary_markdown(self) -> str:
        """End-of-run markdown: the last measured step's statistics per output, then the findings."""
        if not self._last:
            return "No step was measured."
        rows = [
            (name, *(f"{stats[k]:.3g}" for k in STATS[:-1]), *self._units_cells(name, stats["dead_fraction"]))
            for name, stats in self._last.items()
        ]
        header = ("output", "rms", "max |x|", "mean", "kurtosis", "dead", "inactive")
        lines = markdown_table(header, rows, align="lrrrrrr")
        found = self.findings()
        return "\n".join([f"Step {self._last_step}:", "", *lines, *(["", *(f"- {f}" for f in found)] if found else [])])

    # ------------------------------------------------------------------ helpers
    def _units_cells(self, key: str, share: float) -> tuple[str, str]:
        """The summary's "dead" and "inactive" cells of output ``key``: its share of units ≤ 0 in the one its
        activation's word names (:func:`units_word`), the other empty; both empty where it is no activation."""
        if math.isnan(share) or key not in self._zero_gradient:
            return "", ""
        cell = f"{share:.3g}"
        return (cell, "") if self._zero_gradient[key] else ("", cell)

    def _chosen(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` (not the root) is measured: ``modules``' choice, by default a leaf."""
        if not name:
            return False
        if self.modules is None:
            return next(module.children(), None) is None
        return bool(self.modules(name, module))

    def _on_output(self, name: str, dead: bool, module: nn.Module, inputs: Any, output: Any) -> None:
        if in_extra_forward():
            return  # trainvitals' own forward (the lr advisor's, in eval mode), not the step's
        for place, tensor in output_tensors(output):
            key = name + place
            if key not in self._rows and tensor.numel():
                self._rows[key] = output_moments(tensor, dead)
                if dead:
                    self._zero_gradient[key] = isinstance(module, ZERO_GRADIENT_TYPES)

    def _statistics(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rows: list[tuple[Tensor, Tensor | None]]
    ) -> Tensor:
        """``(K, 6)``: :data:`STATS` and the non-finite flag of each output, over every rank's batch."""
        device = rows[0][0].device if rows else pl_module.device  # a model over devices: gathered on one
        moments = torch.stack([row.to(device) for row, _ in rows]) if rows else torch.zeros(0, 7, device=device)
        moments = moments.to(torch.float64)
        masks = [mask.to(device) for _, mask in rows if mask is not None]
        if trainer.world_size > 1 and self._ranks_agree(trainer, moments, masks):
            moments = combine_moments(trainer.strategy.all_gather(moments).reshape(-1, *moments.shape))
            if masks:
                masks = reduce_packed(trainer, masks, "max")
        dead = torch.full((len(rows),), math.nan, dtype=torch.float64, device=device)
        where = [i for i, (_, mask) in enumerate(rows) if mask is not None]
        if where:
            dead[where] = 1.0 - torch.stack([mask.double().mean() for mask in masks])
        return torch.cat([finish(moments), dead[:, None], moments[:, -1:]], dim=1)

    def _ranks_agree(self, trainer: "pl.Trainer", moments: Tensor, masks: list[Tensor]) -> bool:
        """Whether every rank hooked as many outputs, with as many units: else their rows cannot be combined."""
        shape = torch.tensor([len(moments), sum(m.numel() for m in masks)], device=moments.device)
        shapes = trainer.strategy.all_gather(shape).reshape(-1, 2).tolist()
        if all(s == shapes[0] for s in shapes):
            return True
        self.cannot_measure("the ranks hooked different outputs this step: each rank logs its own batch's statistics")
        return False

    def _record(self, trainer: "pl.Trainer", step: int, rows: dict[str, list[float]]) -> None:
        metrics = {}
        for key, row in rows.items():
            stats = dict(zip((*STATS, "nonfinite"), row))
            if stats.pop("nonfinite") and self._nonfinite is None:
                self._nonfinite = [step, key]
                self.warn(_nonfinite_finding(step, key))
            units = f"{units_word(self._zero_gradient.get(key, True))}_fraction"  # its activation's word
            metrics.update(
                {
                    f"activation/{units if stat == 'dead_fraction' else stat}/{key}": value
                    for stat, value in stats.items()
                }
            )
            self._last[key] = stats
            history = self._history.setdefault(key, [])
            history.append(stats["rms"])
            del history[: -(self.growth_steps + 1)]
        self._last_step = step
        log_scalars(trainer, metrics, step, finite_only=True)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _nonfinite_finding(step: int, module: str) -> str:
    """The first non-finite output's sentence: warned at its step, listed in the findings."""
    return (
        f"non-finite activations (inf/NaN) at optimizer step {step}, first produced by `{module}` "
        "(the first module in forward order whose output held them)"
    )


def _growing(rms: list[float], steps: int, factor: float) -> bool:
    """Whether ``rms`` (oldest first) rose at each of its last ``steps`` entries and by ``factor`` or more."""
    if len(rms) < steps + 1 or not all(math.isfinite(v) for v in rms):
        return False
    window = rms[-(steps + 1) :]
    return all(b > a for a, b in zip(window, window[1:])) and window[-1] >= factor * window[0] > 0.0


def _finite_or(value: float, default: float) -> float:
    return value if math.isfinite(value) else default
