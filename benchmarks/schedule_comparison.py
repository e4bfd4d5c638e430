"""From stop to schedule: BandSchedule against the constant lr, the band stop, a tuned step schedule, cosine,
ReduceLROnPlateau and SASA's stationarity test, at a fixed budget.

The tasks, networks, lrs and splits of ``stopping_tasks.py`` (all but the GRU, the slowest), at half their epoch
budgets; 4 micro-batches per optimizer step (the band's noise source). Per task, optimizer (Adam; SGD with
momentum 0.9) and seed, one fit per method, the budget fixed:

- ``constant``: the task's lr throughout; ``band stop``: GradNormEarlyStopping() shadowed on that fit (its stop
  recorded, the run goes on), the weights at its stop;
- ``band schedule``: BandSchedule() (lr × 0.1 at each band entry, 2 cuts, then its stop recorded and the run
  goes on at the last lr): ``final`` the budget's end, ``at stop`` the weights at its stop;
- ``step (oracle)``: MultiStepLR(gamma 0.1) with milestones at {1/2}, {3/4} or {1/2, 3/4} of the budget, the one
  with the lowest mean final validation loss over the seeds, per task and optimizer (tuned on the validation set:
  an oracle);
- ``cosine``: CosineAnnealingLR to 0 at the budget's end;
- ``plateau``: ReduceLROnPlateau(factor 0.1, patience 5 epochs) on the validation loss;
- ``SASA``: the stationarity test of Lang, Xiao & Zhang (NeurIPS 2019), as microsoft/statopt's ``SASA`` and
  ``LeakyBucket`` compute it, on this optimizer's steps (see :class:`SASACut`), lr × 0.1 at each detection, at
  most 2 cuts.

The metric is accuracy % (100·R² for the regression), from the validation set after each epoch. Beside the
issue's criteria (#25: within 0.5 point or 2 % validation loss of the oracle, not more than 0.5 point below the
constant lr, at or above ReduceLROnPlateau) the same comparisons on the validation loss alone (2 %), and on the
metric with a margin of one validation example where that is more than 0.5 point (breast cancer, wine).

    python benchmarks/schedule_comparison.py --out schedule_comparison.json
    python benchmarks/schedule_comparison.py --quick
    python benchmarks/schedule_comparison.py --summarize schedule_comparison.json  # its tables again, no fit
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import ShadowStops, machine_line, markdown_table, median, quiet_lightning, write_json
from lightning.pytorch.callbacks import Callback
from scipy import stats
from stopping_tasks import TASKS, Task, TaskModule, evaluate, fit_task
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import BandSchedule, GradNormEarlyStopping

FACTOR = 0.1
MAX_CUTS = 2
STEP_GRID = ((0.5,), (0.75,), (0.5, 0.75))
PLATEAU_PATIENCE = 5  # epochs
DEFAULT_TASKS = [name for name in TASKS if "GRU" not in name]
LOSS_TOLERANCE = 0.02
METRIC_TOLERANCE = 0.5


class ScheduledModule(TaskModule):
    """TaskModule with an lr scheduler: ``"cosine"``, ``"plateau"``, ``("step", fractions)`` or None."""

    def __init__(self, *args: Any, scheduler: Any = None, total_steps: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler, self.total_steps = scheduler, total_steps

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if self.scheduler is None:
            return optimizer
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=FACTOR, patience=PLATEAU_PATIENCE)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        if self.scheduler == "cosine":
            sched: Any = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        else:
            milestones = [int(f * self.total_steps) for f in self.scheduler[1]]
            sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=FACTOR)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SASACut(Callback):
    """SASA's test (Lang, Xiao & Zhang 2019, Alg. 1; microsoft/statopt ``sasa.py``, ``bucket.py``), on any optimizer.

    Per step the statistic ⟨x_{k+1}, Δ_k⟩ + ‖Δ_k‖²/2 with Δ_k = x_k − x_{k+1} (statopt's ⟨x(k+1), d(k)⟩ +
    (α/2)‖d(k)‖² times α: zero in expectation at stationarity by Yaida's fluctuation–dissipation relation; it is
    ½(‖x_k‖² − ‖x_{k+1}‖²), the same for any update rule) goes into a leaky bucket keeping the most recent
    1/``leak_ratio`` of the samples; every ``testfreq`` steps, once it holds more than ``min_samples`` and after
    ``warmup`` steps, the batch-means confidence interval (significance 0.05, t quantile) of its mean holding 0 —
    both halves' intervals and same-sign half means for the first cut (the composite test) — cuts the lr by
    ``factor`` and empties the bucket. statopt's defaults (warmup 1000, min 1000 samples, leak ratio 8) outlast
    these budgets (300–1000 steps); here warmup 100 (BandSchedule's min_steps), min 100 samples (statopt's
    least), leak ratio 2 (the paper's "last half"), a test every 10 steps (BandSchedule's check). statopt also
    zeroes the momentum buffer at a cut; this does not.
    """

    def __init__(
        self,
        factor: float = FACTOR,
        max_cuts: int = MAX_CUTS,
        warmup: int = 100,
        min_samples: int = 100,
        leak_ratio: int = 2,
        testfreq: int = 10,
        significance: float = 0.05,
    ) -> None:
        self.factor, self.max_cuts, self.warmup, self.min_samples = factor, max_cuts, warmup, min_samples
        self.leak_ratio, self.testfreq, self.significance = leak_ratio, testfreq, significance
        self.samples: list[float] = []
        self.total = 0
        self.composite = True
        self.cuts: list[int] = []
        self.steps = 0
        self._before: list[Tensor] = []
        self._hooks: list[Any] = []

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for opt in trainer.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._pre))
            self._hooks.append(opt.register_step_post_hook(self._post))

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for hook in self._hooks:
            hook.remove()

    def _params(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def _pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._before = [p.detach().clone() for p in self._params(optimizer)]

    def _post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        after = self._params(optimizer)
        value = 0.0
        for x0, x1 in zip(self._before, after):
            delta = x0 - x1.detach()
            value += float((x1.detach() * delta).sum() + 0.5 * delta.square().sum())
        self._add(value)
        self.steps += 1
        if (
            len(self.cuts) < self.max_cuts
            and len(self.samples) > self.min_samples
            and self.steps % self.testfreq == 0
            and self.steps > self.warmup
            and self._stationary()
        ):
            for group in optimizer.param_groups:
                group["lr"] *= self.factor
            self.cuts.append(self.steps)
            self.composite = False
            self.samples, self.total = [], 0

    def _add(self, value: float) -> None:
        """LeakyBucket.add with ``ratio``: one sample of every ``leak_ratio`` grows the window, the others slide it."""
        self.samples.append(value)
        if self.total % self.leak_ratio != 0:
            self.samples.pop(0)
        self.total += 1

    def _stationary(self) -> bool:
        """LeakyBucket.stats_test with batch-means variance (``var_mode="bm"``)."""
        x = torch.tensor(self.samples, dtype=torch.float64)
        n = len(x)
        mean = float(x.mean())
        b = int(math.floor(math.sqrt(n)))
        means = x[: (n // b) * b].view(-1, b).mean(1)
        std = math.sqrt(b / (len(means) - 1)) * float((means - mean).norm())
        half_width = std * stats.t.ppf(1 - self.significance / 2, b - 1) / math.sqrt(n)
        mean1, mean2 = float(x[: n // 2].mean()), float(x[n // 2 :].mean())
        if self.composite:
            return (
                (mean1 - half_width) * (mean1 + half_width) < 0
                and (mean2 - half_width) * (mean2 + half_width) < 0
                and mean1 * mean2 > 0
            )
        return mean - half_width < 0 < mean + half_width and mean1 * mean2 > 0


@dataclass
class MethodRun:
    """One fit: the per-epoch validation numbers, the recorded stop (None: none), the lr cuts' steps."""

    method: str
    epochs: list[dict[str, float]] = field(default_factory=list)
    stop: dict[str, float] | None = None
    cuts: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final(self) -> dict[str, float]:
        return self.epochs[-1]

    @property
    def best_metric(self) -> float:
        return max(e["metric"] for e in self.epochs)


def fit(task: Task, optimizer: str, seed: int, epochs: int, method: str, scheduler: Any = None) -> MethodRun:
    """One fixed-budget fit of ``method``; a stopper's stop is recorded by ShadowStops and the run goes on."""
    (xt, yt), val = task.data()
    pl.seed_everything(seed, workers=True, verbose=False)
    train = DataLoader(TensorDataset(xt, yt), batch_size=task.micro_batch, shuffle=True, drop_last=True)
    total = epochs * (len(train) // 4)
    model = ScheduledModule(
        task.net(), task.kind, optimizer, task.lr[optimizer], scheduler=scheduler, total_steps=total
    )
    stoppers: dict[str, Callback] = {}
    extra: list[Callback] = []
    if method == "constant":
        stoppers["band stop"] = GradNormEarlyStopping(verbose=False)
    elif method == "band schedule":
        stoppers["band schedule"] = BandSchedule(factor=FACTOR, max_cuts=MAX_CUTS, verbose=False)
    elif method == "SASA":
        extra.append(SASACut(factor=FACTOR))
    shadow = ShadowStops(stoppers, lambda m: evaluate(m, val))
    seconds = fit_task(model, train, val, epochs, [*stoppers.values(), *extra, shadow])
    run = MethodRun(method, shadow.epochs, next(iter(shadow.stops.values()), None), seconds=seconds)
    if method == "band schedule":
        run.cuts = [int(c["step"]) for c in stoppers["band schedule"].cuts]
    elif method == "SASA":
        run.cuts = extra[0].cuts
    return run


@dataclass
class Cell:
    """A task × optimizer × seed: every method's fit."""

    task: str
    optimizer: str
    seed: int
    runs: dict[str, MethodRun] = field(default_factory=dict)


def step_name(fractions: tuple[float, ...]) -> str:
    return "step@" + "+".join(f"{f:g}" for f in fractions)


def run_cell(task: Task, optimizer: str, seed: int, epochs: int) -> Cell:
    cell = Cell(task.name, optimizer, seed)
    for method in ("constant", "band schedule", "SASA"):
        cell.runs[method] = fit(task, optimizer, seed, epochs, method)
    cell.runs["cosine"] = fit(task, optimizer, seed, epochs, "cosine", "cosine")
    cell.runs["plateau"] = fit(task, optimizer, seed, epochs, "plateau", "plateau")
    for fractions in STEP_GRID:
        cell.runs[step_name(fractions)] = fit(task, optimizer, seed, epochs, "step", ("step", fractions))
    return cell


# ---------------------------------------------------------------------- tables
def oracle_of(cells: list[Cell]) -> dict[tuple[str, str], str]:
    """Per task and optimizer, the step schedule with the lowest mean final validation loss over the seeds."""
    out = {}
    for key in dict.fromkeys((c.task, c.optimizer) for c in cells):
        mine = [c for c in cells if (c.task, c.optimizer) == key]
        out[key] = min(
            (step_name(f) for f in STEP_GRID),
            key=lambda name: sum(c.runs[name].final["val_loss"] for c in mine),
        )
    return out


def outcome(cell: Cell, column: str, oracle: str) -> dict[str, float]:
    """The validation numbers a column reports for a cell (a stop's weights where the column is at a stop)."""
    if column == "band stop":
        run = cell.runs["constant"]
        return run.stop or run.final
    if column == "band schedule (stop)":
        run = cell.runs["band schedule"]
        return run.stop or run.final
    name = oracle if column == "step (oracle)" else column
    return cell.runs[name].final


COLUMNS = (
    "constant",
    "band stop",
    "band schedule",
    "band schedule (stop)",
    "step (oracle)",
    "cosine",
    "plateau",
    "SASA",
)


def close_to(result: dict[str, float], reference: dict[str, float]) -> bool:
    """Within 0.5 point of the reference's metric, or its validation loss within 2 %."""
    return (
        result["metric"] >= reference["metric"] - METRIC_TOLERANCE
        or result["val_loss"] <= (1 + LOSS_TOLERANCE) * reference["val_loss"]
    )


def one_example(task: str) -> float:
    """Points of the metric one validation example is worth on ``task`` (0 for the regression: R² is continuous)."""
    spec = TASKS[task]
    return 0.0 if spec.kind == "regression" else 100 / len(spec.data()[1][1])


@dataclass(frozen=True)
class Criteria:
    """How a summary judges a result against a reference, ``(result, reference, task) -> bool``: ``close`` to the
    oracle, ``not_below`` the constant lr, ``at_least`` plateau; ``said`` heads its table."""

    said: str
    close: Callable[[dict[str, float], dict[str, float], str], bool]
    not_below: Callable[[dict[str, float], dict[str, float], str], bool]
    at_least: Callable[[dict[str, float], dict[str, float], str], bool]


def _loss_within(result: dict[str, float], reference: dict[str, float], task: str) -> bool:
    return result["val_loss"] <= (1 + LOSS_TOLERANCE) * reference["val_loss"]


def _example_within(result: dict[str, float], reference: dict[str, float], task: str) -> bool:
    return result["metric"] >= reference["metric"] - max(METRIC_TOLERANCE, one_example(task))


CRITERIA = (
    Criteria(
        f"the issue's: close = within {METRIC_TOLERANCE:g} point or {100 * LOSS_TOLERANCE:g} % val loss of the oracle; "
        f"not below = at most {METRIC_TOLERANCE:g} point below the constant lr's metric; ≥ plateau: its metric or more",
        lambda result, reference, task: close_to(result, reference),
        lambda result, reference, task: result["metric"] >= reference["metric"] - METRIC_TOLERANCE,
        lambda result, reference, task: result["metric"] >= reference["metric"],
    ),
    Criteria(
        f"the validation loss alone: each, a final val loss at most {100 * LOSS_TOLERANCE:g} % above the reference's",
        _loss_within,
        _loss_within,
        _loss_within,
    ),
    Criteria(
        f"the metric, each within one validation example of the reference or {METRIC_TOLERANCE:g} point where that "
        "is more (breast cancer 0.88, wine 2.9 points)",
        _example_within,
        _example_within,
        _example_within,
    ),
)


def summary_table(cells: list[Cell], oracle: dict[tuple[str, str], str], criteria: Criteria) -> str:
    """Per method: the median and worst metric gap to the oracle, and the runs close to the oracle, not below the
    constant lr and at or above plateau, as ``criteria`` judge them."""
    rows = []
    for column in COLUMNS:
        gaps, close, not_below, beats_plateau = [], 0, 0, 0
        for c in cells:
            result = outcome(c, column, oracle[(c.task, c.optimizer)])
            ref = outcome(c, "step (oracle)", oracle[(c.task, c.optimizer)])
            gaps.append(result["metric"] - ref["metric"])
            close += criteria.close(result, ref, c.task)
            not_below += criteria.not_below(result, outcome(c, "constant", ""), c.task)
            beats_plateau += criteria.at_least(result, outcome(c, "plateau", ""), c.task)
        n = len(cells)
        counts = [f"{close}/{n}", f"{not_below}/{n}", f"{beats_plateau}/{n}"]
        rows.append([column, f"{median(gaps):+.2f}", f"{min(gaps):+.1f}", *counts])
    headers = ["method", "median gap to oracle (points)", "worst gap", "close to oracle", "not below constant"]
    return markdown_table([*headers, "≥ plateau"], rows)


def load(path: str) -> tuple[list[Cell], dict[str, Any], str]:
    """The cells, arguments and machine line of a run written with ``--out``."""
    saved = json.loads(Path(path).read_text())
    cells = [
        Cell(c["task"], c["optimizer"], c["seed"], {name: MethodRun(**run) for name, run in c["runs"].items()})
        for c in saved["cells"]
    ]
    return cells, saved["args"], saved["machine"]


def report(cells: list[Cell], seeds: list[int], machine: str) -> dict[tuple[str, str], str]:
    """Print the per-run table and a summary per :data:`CRITERIA`; returns the oracle's step schedule per task and
    optimizer."""
    oracle = oracle_of(cells)
    print(
        f"\n# Band-driven schedule vs schedules ({machine}; seeds {seeds}; half the budgets; cut factor {FACTOR:g})\n"
    )
    print(
        "Cells: final validation metric (accuracy %, regression 100·R²) · best over the epochs; the band stop's and "
        "the schedule's (stop) at their stop, with the step. Oracle: the step schedule of the grid "
        f"{[step_name(f) for f in STEP_GRID]} with the lowest mean final val loss per task and optimizer.\n"
    )
    rows = []
    for c in cells:
        row: list[Any] = [c.task, c.optimizer, c.seed, c.runs["constant"].final["step"]]
        for column in COLUMNS:
            result = outcome(c, column, oracle[(c.task, c.optimizer)])
            if column in ("band stop", "band schedule (stop)"):
                stopped = (c.runs["constant"] if column == "band stop" else c.runs["band schedule"]).stop
                at = f" @{stopped['step']:.0f}" if stopped else " (no stop)"
                row.append(f"{result['metric']:.1f}{at}")
            else:
                run = c.runs[oracle[(c.task, c.optimizer)] if column == "step (oracle)" else column]
                cuts = f" ✂{','.join(map(str, run.cuts))}" if run.cuts else ""
                row.append(f"{result['metric']:.1f} · {run.best_metric:.1f}{cuts}")
        rows.append(row)
    print(markdown_table(["task", "optimizer", "seed", "budget (steps)", *COLUMNS], rows))
    for criteria in CRITERIA:
        print(f"\n## Against the oracle, the constant lr and plateau ({len(cells)} runs; {criteria.said})\n")
        print(summary_table(cells, oracle, criteria))
    seconds = sum(r.seconds for c in cells for r in c.runs.values())
    print(f"\n{seconds:.0f} s of fits.")
    return oracle


def main() -> None:
    global FACTOR
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=DEFAULT_TASKS, metavar="TASK")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--optimizers", nargs="+", choices=("adam", "sgd"), default=["adam", "sgd"])
    parser.add_argument("--factor", type=float, default=FACTOR, help="every method's lr cut factor (gamma)")
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, a quarter of each budget")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--out", help="write every fit as JSON here")
    parser.add_argument("--summarize", metavar="JSON", help="print the tables of a run written with --out; no fit")
    args = parser.parse_args()
    if args.summarize:
        cells, saved, machine = load(args.summarize)
        FACTOR = saved["factor"]
        report(cells, saved["seeds"], machine)
        return
    FACTOR = args.factor
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    if args.quick:
        args.seeds = args.seeds[:1]
    cells = []
    for name in args.tasks:
        task = TASKS[name]
        epochs = max(1, task.max_epochs // (8 if args.quick else 2))
        for seed in args.seeds:
            for optimizer in args.optimizers:
                start = time.perf_counter()
                cells.append(run_cell(task, optimizer, seed, epochs))
                print(f"[{name}, {optimizer}, seed {seed}: {time.perf_counter() - start:.0f} s]", flush=True)
    oracle = report(cells, args.seeds, machine_line())
    write_json(
        args.out,
        {
            "machine": machine_line(),
            "args": vars(args),
            "oracle": {f"{k[0]} / {k[1]}": v for k, v in oracle.items()},
            "cells": [asdict(c) for c in cells],
        },
    )


if __name__ == "__main__":
    main()
