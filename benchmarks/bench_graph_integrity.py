"""Training-step overhead of GraphIntegrityCallback against a bare run, and the cost of one graph walk.

Variants, timed interleaved in one process (bare, control, default, every_step, bare, ...), each with
the same TensorBoardLogger and ``Trainer(log_every_n_steps=1)``:

- ``bare``: the module alone; ``control``: the same again (an A/A run: the spread of its ratio is the
  noise floor of the machine);
- ``default``: + ``GraphIntegrityCallback()`` (a window every 50 optimizer steps: one graph walk, then
  3 steps of gradient checks; the cheap loss checks every step);
- ``every_step``: + ``GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1)``, the worst
  case: a walk, a gradient check and a window close (one host sync, a logger write) every step.

Models: (a) a 6M-parameter MLP in 98 tensors on random data, batch 64; (b) the demo CNN on the digits,
batch 64, no validation.

The default's cost sits in the window steps, so what counts is the *mean* step over whole 50-step
cycles (the timed steps cover whole cycles). On a shared machine wall time mostly measures the
neighbours, so the step time is the training thread's CPU time (``time.thread_time`` from the end of
the warm-up to the end of the fit, over the batches; with one torch thread and no DataLoader workers
every step's work runs on it). Columns: the ratio of the minimum over repetitions (the least
disturbed fit of each variant); the median over repetitions of the per-repetition ratio to that
repetition's bare fit, and its range (the ``control`` row shows how far it moves with no change at
all); the same median for wall time; and the wall time spent inside the callback's own hooks per step
(``perf_counter`` around each call; an upper bound on its work, since freeing the step's graph, which
the callback holds until the batch ends, is paid there instead of in Lightning's loop).

The walk alone is timed on one loss of each model: microseconds per walk and per graph node.

    python benchmarks/bench_graph_integrity.py --repetitions 7 --out graph_integrity.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
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
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from trainvitals.demo.data import DigitsDataModule, load_digits_tensors
from trainvitals.demo.model import DigitsCNN
from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.integrity.graph import walk_graph

VARIANTS = ("bare", "control", "default", "every_step")


class ThreadClock(Callback):
    """CPU time of the training thread from the start of batch ``warmup`` to the end of training.

    Attributes:
        seconds: that CPU time; ``batches``: the batches it covers.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.seconds = 0.0
        self.batches = 0
        self._start: float | None = None

    @override
    def on_train_batch_start(self, *_: Any) -> None:
        if self.batches == self.warmup:
            self._start = time.thread_time()
        self.batches += 1

    @override
    def on_train_end(self, *_: Any) -> None:
        assert self._start is not None, "the fit ended within the warm-up"
        self.seconds = time.thread_time() - self._start
        self.batches -= self.warmup


HOOKS = (
    "on_train_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_end",
)


def time_hooks(callback: Callback) -> dict[str, float]:
    """Wrap the callback's hooks (on the instance) so that the seconds spent in each add up in the result."""
    spent = dict.fromkeys(HOOKS, 0.0)

    def timed(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    for name in HOOKS:
        setattr(callback, name, timed(name, getattr(callback, name)))
    return spent


def _callback(variant: str) -> GraphIntegrityCallback | None:
    if variant == "default":
        return GraphIntegrityCallback()
    if variant == "every_step":
        return GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1)
    return None  # bare, control


def timed_fit(
    variant: str,
    make_model: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    steps: int,
    warmup: int,
    logdir: str,
) -> dict[str, float]:
    """One fit of ``warmup + steps`` optimizer steps (plus the epoch-boundary iterations); its step times."""
    pl.seed_everything(0, verbose=False)
    timer, clock = StepTimer(warmup), ThreadClock(warmup)
    extra = _callback(variant)
    spent = time_hooks(extra) if extra is not None else {}
    callbacks = [timer, clock] + ([extra] if extra is not None else [])
    fit_once(make_model(), make_data(), callbacks, warmup + steps + 1, logdir, name=variant)
    if extra is not None and extra.findings:
        raise RuntimeError(f"the benchmark models must be clean, got {extra.summary_markdown()}")
    return {
        "cpu_s": clock.seconds / clock.batches,
        "mean_s": sum(timer.seconds) / len(timer.seconds),
        "n": clock.batches,
        "hook_s": sum(spent.values()) / (clock.batches + warmup),
        "hooks": spent,
    }


def bench_model(
    label: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    """All variants on one model, interleaved; the per-repetition results and the summary rows."""
    with tempfile.TemporaryDirectory() as logdir:
        variants = {
            v: (lambda v=v: timed_fit(v, make_model, make_data, args.steps[label], args.warmup, logdir))
            for v in args.variants
        }
        runs = interleaved(variants, args.repetitions)
    rows = []
    for v in args.variants:
        ratios = {k: [r[k] / b[k] for r, b in zip(runs[v], runs["bare"])] for k in ("cpu_s", "mean_s")}
        rows.append(
            {
                "variant": v,
                "cpu_ms_per_step_min": 1e3 * min(r["cpu_s"] for r in runs[v]),
                "ratio_cpu_min": min(r["cpu_s"] for r in runs[v]) / min(r["cpu_s"] for r in runs["bare"]),
                "ratio_cpu": median(ratios["cpu_s"]),
                "ratio_cpu_range": (min(ratios["cpu_s"]), max(ratios["cpu_s"])),
                "ratio_wall_mean_step": median(ratios["mean_s"]),
                "hook_us_per_step_min": 1e6 * min(r["hook_s"] for r in runs[v]),
                "steps_timed": runs[v][0]["n"],
            }
        )
    return {"model": label, "runs": runs, "rows": rows}


def walk_cost(
    label: str, model: pl.LightningModule, batch: tuple[torch.Tensor, torch.Tensor], calls: int
) -> dict[str, Any]:
    """Microseconds per :func:`walk_graph` of one training loss, median of ``calls`` walks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # training_step's self.log outside a Trainer
        loss = model.training_step(batch, 0)
    walk = walk_graph(loss, before=0)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        walk_graph(loss, before=0)
        times.append(time.perf_counter() - start)
    us = 1e6 * median(times)
    return {
        "model": label,
        "nodes": len(walk.nodes),
        "leaves": len(walk.leaves),
        "us_per_walk": us,
        "us_per_node": us / len(walk.nodes),
    }


def format_rows(result: dict[str, Any]) -> str:
    return markdown_table(
        [
            "variant",
            "CPU ms/step (min)",
            "ratio of min CPU",
            "CPU ratio (median)",
            "range",
            "wall ratio (median)",
            "µs/step in hooks (min)",
            "steps timed/fit",
        ],
        [
            [
                r["variant"],
                f"{r['cpu_ms_per_step_min']:.2f}",
                f"{r['ratio_cpu_min']:.3f}",
                f"{r['ratio_cpu']:.3f}",
                f"{r['ratio_cpu_range'][0]:.3f}–{r['ratio_cpu_range'][1]:.3f}",
                f"{r['ratio_wall_mean_step']:.3f}",
                f"{r['hook_us_per_step_min']:.0f}",
                r["steps_timed"],
            ]
            for r in result["rows"]
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=5, help="fits per variant (>= 5 for the report)")
    parser.add_argument("--warmup", type=int, default=10, help="iterations of each fit not timed")
    parser.add_argument("--mlp-steps", type=int, default=100, help="timed steps per MLP fit (whole 50-step cycles)")
    parser.add_argument("--cnn-steps", type=int, default=200, help="timed steps per CNN fit (whole 50-step cycles)")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--walk-calls", type=int, default=200, help="walks timed per model")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (erratic on a shared CPU)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if "bare" not in args.variants:
        args.variants = ["bare"] + args.variants
    if args.threads:
        torch.set_num_threads(args.threads)
    args.steps = {"mlp": args.mlp_steps, "cnn": args.cnn_steps}
    quiet_lightning()

    models = {
        "mlp": (lambda: WideMLP(), lambda: random_regression_loader(args.warmup + args.mlp_steps + 2)),
        "cnn": (lambda: DigitsCNN(lr=1e-3), lambda: DigitsDataModule(batch_size=64)),
    }
    images, labels = load_digits_tensors()
    batches = {"mlp": next(iter(random_regression_loader(1))), "cnn": (images[:64], labels[:64])}
    print(f"# GraphIntegrityCallback overhead ({machine_line()}; {args.repetitions} repetitions, interleaved)")
    walks = [walk_cost(label, models[label][0](), batches[label], args.walk_calls) for label in args.models]
    print("\n## one graph walk (median)\n")
    print(
        markdown_table(
            ["model", "nodes", "leaves", "µs/walk", "µs/node"],
            [
                [w["model"], w["nodes"], w["leaves"], f"{w['us_per_walk']:.1f}", f"{w['us_per_node']:.3f}"]
                for w in walks
            ],
        )
    )
    results = run_overhead(args, models, bench_model, format_rows)
    write_json(
        args.out,
        {
            "machine": machine_line(),
            "repetitions": args.repetitions,
            "warmup": args.warmup,
            "walks": walks,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
