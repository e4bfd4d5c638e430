"""Training-step overhead of GradNormMonitor against a bare run and Lightning's ``grad_norm`` utility.

Variants, timed interleaved in one process (bare, monitor, reference, bare, monitor, ...), every one
with the same TensorBoardLogger setup and ``Trainer(log_every_n_steps=1)``:

- ``bare``: the module alone (it logs ``train/loss`` each step);
- ``monitor``: + ``GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)`` (the norm path);
- ``reference``: + Lightning's documented recipe, ``pl_module.log_dict(grad_norm(pl_module, 2))`` in
  ``on_before_optimizer_step``;
- opt-in: ``monitor_unlogged``, the monitor measuring every step but logging once per fit (its compute
  alone, without the logger's cost per scalar); ``reference_logger``, ``grad_norm`` written straight
  to the loggers, without ``log_dict``; ``monitor_even_steps``, the monitor measuring and logging on
  the even optimizer steps only, read paired within each fit: the CPU time of its even steps against
  its odd ones (medians). Between fits this machine's speed drifts by more than the 2% to resolve;
  within a fit the two kinds of step alternate.

Models: (a) a 6M-parameter MLP in 98 tensors on random data, batch 64; (b) the demo CNN on the digits,
batch 64, no validation. A repetition is one fit per variant; a fit's step time is the median
of its per-iteration times after ``--warmup`` iterations, in wall-clock and in process CPU time (the
steadier one on a shared machine). The ratio is taken per repetition against that repetition's bare
fit; the table gives the median over repetitions and the range. "hook CPU" is the thread CPU time of
the variant's ``on_before_optimizer_step`` alone (for ``reference`` it leaves out the logging that
Lightning does after the hook for ``log_dict``). "micro-batch hooks CPU" is the thread CPU time of the
monitor's hooks that run on every micro-batch, step or not (``on_train_batch_start``: the batch's size on the
host, and on a logging step the producer search's reference to the batch; ``on_before_backward``), summed:
neither the hook column nor the paired reading holds them.

    python benchmarks/bench_grad_norm_monitor.py --repetitions 7 --out grad_norm_monitor.json
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from _common import (
    StepTimer,
    add_timing_arguments,
    apply_timing_arguments,
    fit_once,
    interleaved,
    machine_line,
    markdown_table,
    median,
    overhead_models,
    ratio_cells,
    ratio_row,
    run_overhead,
    time_hook,
    write_json,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.grads import grad_norm
from torch import Tensor
from typing_extensions import override

from trainvitals.norms.monitor import GradNormMonitor

VARIANTS = ("bare", "monitor", "reference", "monitor_unlogged", "reference_logger", "monitor_even_steps")
NEVER = 10**9  # a logging cadence that a benchmark never reaches after step 0
BATCH_HOOKS = ("on_train_batch_start", "on_before_backward")  # GradNormMonitor's hooks of every micro-batch


class GradNormReference(Callback):
    """Lightning's recipe: each parameter's gradient norm and the total, logged every optimizer step.

    Args:
        via_log_dict: log with ``pl_module.log_dict`` (the documented way); otherwise write floats
            straight to ``trainer.loggers``.
    """

    def __init__(self, via_log_dict: bool = True) -> None:
        self.via_log_dict = via_log_dict
        self.last_total: Tensor | None = None

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        norms = grad_norm(pl_module, norm_type=2)
        self.last_total = norms.get("grad_2.0_norm_total")
        if self.via_log_dict:
            pl_module.log_dict(norms)
            return
        values = {k: float(v) for k, v in norms.items()}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)


class EvenStepsMonitor(GradNormMonitor):
    """GradNormMonitor logging every step it measures, on the even optimizer steps only."""

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", *args: Any) -> None:
        if trainer.global_step % 2 == 0:
            super().on_before_optimizer_step(trainer, *args)


def _callback(variant: str) -> Callback | None:
    if variant == "monitor_even_steps":
        return EvenStepsMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    if variant == "monitor":
        return GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    if variant == "monitor_unlogged":
        return GradNormMonitor(log_every_n_steps=NEVER, histogram_every_n_steps=0)
    if variant == "reference":
        return GradNormReference(via_log_dict=True)
    if variant == "reference_logger":
        return GradNormReference(via_log_dict=False)
    return None


def timed_fit(
    variant: str,
    make_model: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    steps: int,
    warmup: int,
    logdir: str,
    last_totals: dict[str, float],
) -> dict[str, float]:
    """One fit of ``warmup + steps`` optimizer steps (plus the epoch-boundary iterations); its step times."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(warmup)
    extra = _callback(variant)
    hook_seconds = time_hook(extra, "on_before_optimizer_step") if extra is not None else []
    batch_hooks = [time_hook(extra, h) for h in BATCH_HOOKS] if isinstance(extra, GradNormMonitor) else []
    callbacks = [timer] + ([extra] if extra is not None else [])
    fit_once(make_model(), make_data(), callbacks, warmup + steps + 1, logdir, name=variant)
    total = getattr(extra, "last_total", None)
    if isinstance(total, dict):  # GradNormMonitor keeps one total per optimizer
        total = total.get(0)
    if total is not None:
        last_totals[variant] = float(total)
    return {
        "wall_median_s": median(timer.seconds),
        "wall_mean_s": sum(timer.seconds) / len(timer.seconds),
        "cpu_median_s": median(timer.cpu_seconds),
        "cpu_mean_s": sum(timer.cpu_seconds) / len(timer.cpu_seconds),
        # the hook runs once per optimizer step, from step 0; EvenStepsMonitor's odd steps do nothing
        "hook_cpu_median_s": median(
            [t for i, t in enumerate(hook_seconds) if i >= warmup and (variant != "monitor_even_steps" or i % 2 == 0)]
        )
        if hook_seconds
        else 0.0,
        # the monitor's hooks of every micro-batch (its size on the host, the backward it runs), this thread
        "batch_hooks_cpu_median_s": sum(median(seconds[warmup:]) for seconds in batch_hooks),
        "n": len(timer.seconds),
        **({"paired_ratio": _even_over_odd(timer)} if variant == "monitor_even_steps" else {}),
    }


def _even_over_odd(timer: StepTimer) -> float:
    even = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % 2 == 0]
    odd = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % 2]
    return median(even) / median(odd)


def bench_model(
    label: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    """All variants on one model, interleaved; returns the per-repetition results and the summary rows."""
    last_totals: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as logdir:
        variants = {
            v: (lambda v=v: timed_fit(v, make_model, make_data, args.steps[label], args.warmup, logdir, last_totals))
            for v in args.variants
        }
        runs = interleaved(variants, args.repetitions)
    rows = [ratio_row(runs, v, key="{clock}_median_s") for v in args.variants]
    for row in rows:
        row["hook_cpu_ms"] = 1e3 * median([r["hook_cpu_median_s"] for r in runs[row["variant"]]])
        row["batch_hooks_cpu_us"] = 1e6 * median([r["batch_hooks_cpu_median_s"] for r in runs[row["variant"]]])
    return {"model": label, "runs": runs, "rows": rows, "last_total_norm": last_totals}


def format_rows(result: dict[str, Any]) -> str:
    table = markdown_table(
        [
            "variant",
            "wall ms/step",
            "wall ratio",
            "wall ratio range",
            "CPU ms/step",
            "CPU ratio",
            "CPU ratio range",
            "hook CPU ms/step",
            "micro-batch hooks CPU µs/micro-batch",
            "steps timed/fit",
        ],
        [
            [
                r["variant"],
                *ratio_cells(r, "wall"),
                *ratio_cells(r, "cpu"),
                f"{r['hook_cpu_ms']:.3f}",
                f"{r['batch_hooks_cpu_us']:.1f}",
                r["steps_timed"],
            ]
            for r in result["rows"]
        ],
    )
    paired = [r["paired_ratio"] for r in result["runs"].get("monitor_even_steps", [])]
    if paired:
        table += (
            f"\nmonitor_even_steps, paired within each fit: measured-and-logged step / other step "
            f"{median(paired):.3f} [{min(paired):.3f}–{max(paired):.3f}]"
        )
    return table


def print_norm_agreement(result: dict[str, Any]) -> None:
    """The monitor's last total norm against Lightning's ``grad_norm`` on the same step."""
    totals = result["last_total_norm"]
    if "monitor" in totals and "reference" in totals:
        rel = abs(totals["monitor"] - totals["reference"]) / max(abs(totals["reference"]), 1e-30)
        print(
            f"\nlast-step total norm: monitor {totals['monitor']:.6g}, grad_norm {totals['reference']:.6g} "
            f"(relative difference {rel:.1e})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timing_arguments(parser)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["bare", "monitor", "reference"])
    args = parser.parse_args()
    if "bare" not in args.variants:
        args.variants = ["bare"] + args.variants
    apply_timing_arguments(args)
    models = overhead_models(args)
    print(f"# GradNormMonitor overhead ({machine_line()}; {args.repetitions} repetitions, interleaved)")
    results = run_overhead(args, models, bench_model, format_rows, after=print_norm_agreement)
    write_json(
        args.out,
        {"machine": machine_line(), "repetitions": args.repetitions, "warmup": args.warmup, "results": results},
    )


if __name__ == "__main__":
    main()
