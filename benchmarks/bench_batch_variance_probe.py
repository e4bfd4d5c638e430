"""Training-step overhead of BatchVarianceProbe against a bare run, in one process.

Variants, timed interleaved (bare, every_1, every_10, log_10, bare, ...):

- ``bare``: the module alone;
- ``every_1``: + ``BatchVarianceProbe()``: per-example norms in every backward (targets ≤ 1.15);
- ``every_10``: + ``BatchVarianceProbe(measure_every_n_steps=10)`` (target ≤ 1.03);
- ``log_10``: + ``BatchVarianceProbe(log_every_n_steps=10)`` to a TensorBoardLogger: measured every step,
  logged every 10th (GSNR and the EB criterion from the per-coordinate sums, the estimate's tags).

The first three log at the Trainer's cadence (every 50 steps: GSNR and the EB criterion are computed then)
to no logger; none draws histograms. Models: (a) the 6M-parameter MLP of ``_common`` in 98
tensors, batch 64; (b) the demo CNN on the digits, batch 64. A fit's time per step is the median over
windows of 10 consecutive iterations of their mean (each window holds exactly one measured step of
``every_10``), after ``--warmup`` iterations, in wall-clock and in process CPU time (the steadier one
on a shared machine). Ratios are per repetition against that repetition's bare fit; the table gives
the median over repetitions and the range.

Between fits this machine's speed drifts by ±10–30%, more than a measured step every 10 costs, so the
``every_10`` fits are also read paired, within the fit: the CPU time of its measured steps against
its other steps (median of each), and the thread CPU time of the probe's hooks on the other steps
(what an unmeasured step costs it) against the bare step. Amortised over 10 steps:
1 + (paired − 1)/10 + idle hooks/bare step. The ``log_10`` fits are read the same way: a logging step
(measured) against the fit's other, measured steps — what logging adds to a measured step (target ≤ 1.15).

    python benchmarks/bench_batch_variance_probe.py --repetitions 5 --out batch_variance_probe.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from _common import (
    StepTimer,
    WideMLP,
    fit_once,
    interleaved,
    machine_line,
    markdown_table,
    median,
    quiet_lightning,
    random_regression_loader,
    run_overhead,
    write_json,
)

from trainvitals.demo.data import DigitsDataModule
from trainvitals.demo.model import DigitsCNN
from trainvitals.noise.probe import BatchVarianceProbe

VARIANTS = {"bare": None, "every_1": 1, "every_10": 10, "log_10": 1}
LOGGING = {"log_10": 10}  # the variants that log at their own cadence, to a TensorBoardLogger
WINDOW = 10
# The probe's hooks in a step without accumulation (its tensor hooks run only in measured steps).
PROBE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


def window_mean(seconds: list[float]) -> float:
    """Median over consecutive ``WINDOW``-iteration windows of their mean iteration time."""
    windows = [seconds[i : i + WINDOW] for i in range(0, len(seconds) - WINDOW + 1, WINDOW)]
    return median([sum(w) / WINDOW for w in windows])


def hook_seconds_by_step(callback: pl.Callback, hooks: tuple[str, ...]) -> dict[int, float]:
    """Wrap ``callback``'s ``hooks`` (which take the trainer first): their thread CPU seconds summed per
    ``trainer.global_step``."""
    seconds: dict[int, float] = {}
    for hook in hooks:
        inner = getattr(callback, hook)

        def timed(trainer: pl.Trainer, *args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _inner(trainer, *args, **kwargs)
            finally:
                seconds[trainer.global_step] = seconds.get(trainer.global_step, 0.0) + time.thread_time() - start

        setattr(callback, hook, timed)
    return seconds


def timed_fit(
    every: int | None,
    make_model: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    steps: int,
    warmup: int,
    log_every: int | None = None,
) -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(warmup)
    probe = (
        [BatchVarianceProbe(measure_every_n_steps=every, log_every_n_steps=log_every, histogram_every_n_steps=0)]
        if every
        else []
    )
    hooks = hook_seconds_by_step(probe[0], PROBE_HOOKS) if probe else {}
    with tempfile.TemporaryDirectory() as logdir:
        fit_once(
            make_model(),
            make_data(),
            [timer, *probe],
            warmup + steps + 1,
            logdir=logdir if log_every else None,
            log_every_n_steps=50,
        )
    if probe and int(probe[0].noise.count) == 0:
        raise RuntimeError("the probe measured nothing: the benchmark would time an idle callback")
    result = {"wall_s": window_mean(timer.seconds), "cpu_s": window_mean(timer.cpu_seconds), "n": len(timer.seconds)}
    if log_every:
        logged = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % log_every == 0]
        others = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % log_every]
        result["logging_ratio"] = median(logged) / median(others)
    if every and every > 1:
        measured = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % every == 0]
        others = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % every]
        result["paired_ratio"] = median(measured) / median(others)
        result["idle_hooks_s"] = median([hooks.get(step, 0.0) for step in timer.steps if step % every])
    return result


def bench_model(
    label: str,
    make_model: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    steps: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    variants = {
        name: (
            lambda every=every, name=name: timed_fit(
                every, make_model, make_data, steps, args.warmup, LOGGING.get(name)
            )
        )
        for name, every in VARIANTS.items()
    }
    runs = interleaved(variants, args.repetitions)
    rows = []
    for name in VARIANTS:
        row: dict[str, Any] = {"variant": name, "steps_timed": runs[name][0]["n"]}
        for clock in ("wall", "cpu"):
            ratios = [r[f"{clock}_s"] / b[f"{clock}_s"] for r, b in zip(runs[name], runs["bare"])]
            row[f"{clock}_ms_per_step"] = 1e3 * median([r[f"{clock}_s"] for r in runs[name]])
            row[f"{clock}_ratio"] = median(ratios)
            row[f"{clock}_ratio_range"] = (min(ratios), max(ratios))
        rows.append(row)
    bare_cpu_s = median([b["cpu_s"] for b in runs["bare"]])
    paired = {}
    for name, every in VARIANTS.items():
        if every and every > 1:
            ratios = [r["paired_ratio"] for r in runs[name]]
            idle = median([r["idle_hooks_s"] for r in runs[name]]) / bare_cpu_s
            paired[name] = {
                "measured_step_ratio": median(ratios),
                "range": (min(ratios), max(ratios)),
                "idle_hooks_fraction": idle,
                "amortised": 1 + (median(ratios) - 1) / every + idle,
            }
    logging = {}
    for name in LOGGING:
        ratios = [r["logging_ratio"] for r in runs[name]]
        logging[name] = {"logging_step_ratio": median(ratios), "range": (min(ratios), max(ratios))}
    return {"model": label, "runs": runs, "rows": rows, "paired": paired, "logging": logging}


def format_rows(result: dict[str, Any]) -> str:
    def cells(r: dict[str, Any], clock: str) -> list[str]:
        low, high = r[f"{clock}_ratio_range"]
        return [f"{r[f'{clock}_ms_per_step']:.2f}", f"{r[f'{clock}_ratio']:.3f}", f"{low:.3f}–{high:.3f}"]

    table = markdown_table(
        ["variant", "wall ms/step", "wall ratio", "wall range", "CPU ms/step", "CPU ratio", "CPU range", "steps timed"],
        [[r["variant"], *cells(r, "wall"), *cells(r, "cpu"), r["steps_timed"]] for r in result["rows"]],
    )
    lines = [
        f"\n{name}, paired within each fit: measured step / other steps {p['measured_step_ratio']:.3f} "
        f"[{p['range'][0]:.3f}–{p['range'][1]:.3f}], the probe's hooks on the other steps "
        f"{p['idle_hooks_fraction']:.2%} of a bare step; amortised {p['amortised']:.3f}"
        for name, p in result["paired"].items()
    ]
    lines += [
        f"\n{name}, paired within each fit: a logging step / the other measured steps {p['logging_step_ratio']:.3f} "
        f"[{p['range'][0]:.3f}–{p['range'][1]:.3f}]"
        for name, p in result["logging"].items()
    ]
    return table + "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=5, help="fits per variant (>= 5 for the report)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations of each fit not timed")
    parser.add_argument("--mlp-steps", type=int, default=60, help="timed steps per MLP fit")
    parser.add_argument("--cnn-steps", type=int, default=200, help="timed steps per CNN fit")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (multi-threaded steps are erratic on a shared CPU)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    models = {
        "mlp": (WideMLP, lambda: random_regression_loader(args.warmup + args.mlp_steps + 2), args.mlp_steps),
        "cnn": (lambda: DigitsCNN(lr=1e-3), lambda: DigitsDataModule(batch_size=64), args.cnn_steps),
    }
    print(f"# BatchVarianceProbe overhead ({machine_line()}; {args.repetitions} repetitions, interleaved)")
    results = run_overhead(args, models, bench_model, format_rows)
    write_json(
        args.out,
        {"machine": machine_line(), "repetitions": args.repetitions, "warmup": args.warmup, "results": results},
    )


if __name__ == "__main__":
    main()
