"""Training-step overhead of MemoryTopologyProfiler: a profiled step, and the default schedule.

Variants, timed interleaved in one process (bare, every, default, bare, ...), all with the same
TensorBoardLogger and ``Trainer(log_every_n_steps=1)``:

- ``bare``: the module alone;
- ``alternate``: ``MemoryTopologyProfiler(measure_every_n_steps=2, first_steps=0)``: every other step profiled
  (hooks on every module and saved tensor, model-state walk, ranked remedies, 10-100 scalars to
  TensorBoard);
- ``default``: ``MemoryTopologyProfiler()``: every 50 steps plus the first 3.

Targets (issue 6): a profiled step ≤ 1.5 × a bare step; amortised at the default schedule ≤ 1.03 ×.
The profiled ratio r is paired within each ``alternate`` fit (median profiled step / median other
step), so a loaded machine slows both sides alike; the other steps against ``bare`` give the cost of
an unprofiled step, but across fits, where a shared CPU adds noise of several percent; so the hooks
of an unprofiled step are also timed alone (a million calls). Amortised: ``default`` / ``bare`` on
the mean step (it holds the rare profiled steps), and derived as 1 + (r − 1)/50 + idle hooks / bare
step, which that noise does not blur.

Models: (a) the 6M-parameter MLP of ``_common`` (97 modules, batch 64); (b) the demo CNN on the
digits (batch 64), repeated so that a fit is one epoch (StepTimer drops the intervals that cross an
epoch, which would break the step parity of ``alternate``). A repetition is one fit per variant;
ratios are per repetition, summarised by the median over repetitions and the range.

    python benchmarks/bench_memory_topology_profiler.py --repetitions 5 --out memory_topology_profiler.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace
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
    write_json,
)
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.demo.data import load_digits_tensors
from trainvitals.demo.model import DigitsCNN
from trainvitals.memory.profiler import MemoryTopologyProfiler

PROFILERS: dict[str, Callable[[], list[pl.Callback]]] = {
    "bare": lambda: [],
    "alternate": lambda: [MemoryTopologyProfiler(measure_every_n_steps=2, first_steps=0)],
    "default": lambda: [MemoryTopologyProfiler()],
}
DEFAULT_EVERY_N = 50


def digits_loader(batches: int, batch_size: int = 64) -> DataLoader:
    """``batches`` batches of the digits in a fixed order, the data repeated as often as needed."""
    images, labels = load_digits_tensors()
    repeats = -(-batches * batch_size // len(labels))
    data = TensorDataset(images.repeat(repeats, 1, 1, 1), labels.repeat(repeats))
    return DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True)


def step_times(
    variant: str, model: pl.LightningModule, data: DataLoader, steps: int, warmup: int, logdir: str
) -> list[float]:
    """Per-iteration seconds of one fit of ``warmup + steps`` optimizer steps with ``variant``'s callbacks."""
    timer = StepTimer(warmup)
    fit_once(model, data, [timer, *PROFILERS[variant]()], warmup + steps + 1, logdir, name=variant)
    return timer.seconds


def idle_hook_seconds(calls: int = 1_000_000) -> float:
    """Seconds per step of the profiler's hooks on a step that is not profiled."""
    profiler = MemoryTopologyProfiler()
    profiler._profiled_steps = profiler.first_steps  # past the first steps
    trainer = SimpleNamespace(global_step=1)
    start = time.perf_counter()
    for _ in range(calls):
        profiler.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        profiler.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / calls


def summarise(runs: dict[str, list[list[float]]], warmup: int, idle_s: float) -> dict[str, Any]:
    """Per-repetition ratios, summarised as the median over repetitions (and the range)."""
    mean = lambda seconds: sum(seconds) / len(seconds)  # noqa: E731
    # StepTimer's interval j is optimizer step warmup + j; `alternate` profiles the even steps.
    profiled = [[t for j, t in enumerate(s) if (warmup + j) % 2 == 0] for s in runs["alternate"]]
    others = [[t for j, t in enumerate(s) if (warmup + j) % 2 == 1] for s in runs["alternate"]]
    ratios = {
        "profiled_step": [median(p) / median(o) for p, o in zip(profiled, others)],
        "unprofiled_step": [median(o) / median(b) for o, b in zip(others, runs["bare"])],
        "default_mean_step": [mean(d) / mean(b) for d, b in zip(runs["default"], runs["bare"])],
    }
    summary: dict[str, Any] = {k: {"median": median(v), "range": (min(v), max(v))} for k, v in ratios.items()}
    summary["ms_per_step"] = {v: 1e3 * median([median(s) for s in runs[v]]) for v in runs}
    r, bare_s = summary["profiled_step"]["median"], median([median(b) for b in runs["bare"]])
    summary["idle_hooks_fraction"] = idle_s / bare_s
    summary["amortised_derived"] = 1 + (r - 1) / DEFAULT_EVERY_N + idle_s / bare_s
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=5, help="fits per variant")
    parser.add_argument("--warmup", type=int, default=10, help="iterations of each fit not timed")
    parser.add_argument("--mlp-steps", type=int, default=100, help="timed steps per MLP fit")
    parser.add_argument("--cnn-steps", type=int, default=200, help="timed steps per CNN fit")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*`validation_step` but have no `val_dataloader`.*")  # the CNN's
    models = {
        "mlp": (WideMLP, lambda: random_regression_loader(args.warmup + args.mlp_steps + 2), args.mlp_steps),
        "cnn": (lambda: DigitsCNN(lr=1e-3), lambda: digits_loader(args.warmup + args.cnn_steps + 2), args.cnn_steps),
    }
    print(f"# MemoryTopologyProfiler overhead ({machine_line()}; {args.repetitions} repetitions, interleaved)")
    idle_s = idle_hook_seconds()
    print(f"\nhooks of an unprofiled step: {1e6 * idle_s:.2f} µs")
    results = []
    for label in args.models:
        make_model, make_data, steps = models[label]
        with tempfile.TemporaryDirectory() as logdir:
            runs = interleaved(
                {
                    v: (lambda v=v: step_times(v, make_model(), make_data(), steps, args.warmup, logdir))
                    for v in PROFILERS
                },
                args.repetitions,
            )
        summary = summarise(runs, args.warmup, idle_s)
        results.append({"model": label, "summary": summary, "runs": runs})
        print(
            f"\n## {label}: ms per step (median) "
            + ", ".join(f"{v} {ms:.2f}" for v, ms in summary["ms_per_step"].items())
            + "\n"
        )
        print(
            markdown_table(
                ["ratio", "median over repetitions", "range", "target"],
                [
                    [name, f"{summary[key]['median']:.3f}", "–".join(f"{x:.3f}" for x in summary[key]["range"]), target]
                    for name, key, target in (
                        ("profiled / unprofiled step (paired)", "profiled_step", "≤ 1.5"),
                        ("unprofiled step / bare", "unprofiled_step", "≈ 1"),
                        ("default schedule / bare (mean step)", "default_mean_step", "≤ 1.03"),
                    )
                ],
            )
        )
        print(
            f"\nidle hooks: {100 * summary['idle_hooks_fraction']:.4f}% of a bare step; amortised at every "
            f"{DEFAULT_EVERY_N} steps, derived: {summary['amortised_derived']:.4f} (≤ 1.03)"
        )
    write_json(
        args.out,
        {"machine": machine_line(), "repetitions": args.repetitions, "warmup": args.warmup, "results": results},
    )


if __name__ == "__main__":
    main()
