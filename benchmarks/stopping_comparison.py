"""When to stop: GradNormEarlyStopping against a threshold, Lightning's EarlyStopping and a fixed budget.

On the digits demo (DigitsCNN, effective batch 64 = 4 micro-batches of 16), per seed and optimizer:

- (a) ``noise_band``: GradNormEarlyStopping at its default margin and patience (no validation data);
- (b) ``threshold``: GradNormEarlyStopping(mode="threshold", threshold=1e-3);
- (c) ``val_loss``: Lightning's EarlyStopping on ``val/loss``, patience 5 epochs;
- (d) ``fixed``: ``--max-epochs`` (60) epochs; validation accuracy after every epoch is recorded, so
  (d) is also the reference: its best epoch and its final epoch.

Reported per run: optimizer steps at the stop and the validation accuracy of the weights at the stop.

One fit per seed and optimizer serves all four (the default, "shadow" mode): the stoppers are attached
to the fixed-budget run and a guard placed after them records each one's first stop (optimizer step,
validation accuracy of the weights at that moment) and then clears ``trainer.should_stop``. None of
them changes the training, and the validation accuracy is computed from the validation tensors
without a DataLoader (whose iterator would draw from the global RNG and change the shuffling), so
each stop is the one a run with that stopper alone would make. ``--real`` checks that claim: it
also runs (a)-(c) as ordinary fits that really stop, and prints both.

The stoppers decide every optimizer step (``check_every_n_steps=1``); by default they look every 10
steps, which can land a stop up to 9 steps later. The table in the README was measured with
``--min-steps 0``; margin 0.2 gives the same stops with the default ``min_steps=100``.

    python benchmarks/stopping_comparison.py --seeds 0 1 2 --out stopping.json
    python benchmarks/stopping_comparison.py --seeds 0 1 --margins 0.1 0.2 0.5 1.0 --patiences 10 30 50
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import ShadowStops, machine_line, markdown_table, median, quiet_lightning, quiet_trainer, write_json
from lightning.pytorch.callbacks import Callback, EarlyStopping

from trainvitals.demo.data import DigitsDataModule
from trainvitals.demo.model import DigitsCNN
from trainvitals.noise.stopper import DEFAULT_MARGIN, DEFAULT_PATIENCE, GradNormEarlyStopping

METHODS = ("noise_band", "threshold", "val_loss", "fixed")


@dataclass
class Stop:
    """Where one stopper stopped (or would have): optimizer steps run, and val accuracy of those weights."""

    steps: int
    val_acc: float
    epoch: int


@dataclass
class Run:
    """One fixed-budget fit: the reference curve and the stops of the stoppers it carried."""

    optimizer: str
    seed: int
    epoch_steps: list[int] = field(default_factory=list)  # optimizer steps after each epoch
    epoch_val_acc: list[float] = field(default_factory=list)
    epoch_val_loss: list[float] = field(default_factory=list)  # full-batch cross-entropy
    stops: dict[str, Stop | None] = field(default_factory=dict)  # None: never stopped
    real_stops: dict[str, Stop] = field(default_factory=dict)  # from --real
    seconds: float = 0.0


def val_accuracy(model: pl.LightningModule, val: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Accuracy on the whole validation set in one batch; draws nothing from the RNG."""
    return evaluate(model, val)["val_acc"]


def evaluate(model: pl.LightningModule, val: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the whole validation set in one batch; draws nothing from the RNG."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(val[0])
        result = {
            "val_acc": (logits.argmax(-1) == val[1]).double().mean().item(),
            "val_loss": F.cross_entropy(logits, val[1]).item(),
        }
    model.train(was_training)
    return result


def make_stoppers(args: argparse.Namespace, band_grid: list[tuple[float, int]]) -> dict[str, Callback]:
    """(a) for each (margin, patience) in ``band_grid``, (b) and (c), keyed by name."""
    common = {"min_steps": args.min_steps, "check_every_n_steps": 1, "verbose": False}
    stoppers: dict[str, Callback] = {
        band_name(m, p): GradNormEarlyStopping(mode="noise_band", margin=m, patience=p, **common) for m, p in band_grid
    }
    stoppers["threshold"] = GradNormEarlyStopping(mode="threshold", threshold=args.threshold, **common)
    # Checked after each validation (once per epoch) rather than in on_train_epoch_end, the same decision
    # at the same step: Lightning calls EarlyStopping's on_train_epoch_end after every other callback's,
    # where the ShadowStops guard could not see it.
    stoppers["val_loss"] = EarlyStopping(
        monitor="val/loss", mode="min", patience=args.es_patience, check_on_train_epoch_end=False
    )
    return stoppers


def band_name(margin: float, patience: int) -> str:
    return f"noise_band(margin={margin:g}, patience={patience})"


def fit(
    args: argparse.Namespace, optimizer: str, seed: int, callbacks: list[Callback]
) -> tuple[pl.Trainer, DigitsCNN, DigitsDataModule]:
    pl.seed_everything(seed, workers=True, verbose=False)
    data = DigitsDataModule(batch_size=args.batch_size)
    model = DigitsCNN(lr=args.lr[optimizer], optimizer=optimizer)
    trainer = quiet_trainer(
        max_epochs=args.max_epochs, accumulate_grad_batches=args.accumulate, callbacks=callbacks, deterministic=True
    )
    trainer.fit(model, datamodule=data)
    return trainer, model, data


def validation_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    data = DigitsDataModule()
    data.setup("fit")
    return data.val_set.tensors  # type: ignore[return-value]


def run_one(args: argparse.Namespace, optimizer: str, seed: int, band_grid: list[tuple[float, int]]) -> Run:
    run = Run(optimizer, seed)
    val = validation_tensors()
    stoppers = make_stoppers(args, band_grid)
    shadow = ShadowStops(stoppers, lambda model: evaluate(model, val))
    start = time.perf_counter()
    fit(args, optimizer, seed, [*stoppers.values(), shadow])
    run.seconds = time.perf_counter() - start
    run.epoch_steps = [e["step"] for e in shadow.epochs]
    run.epoch_val_acc = [e["val_acc"] for e in shadow.epochs]
    run.epoch_val_loss = [e["val_loss"] for e in shadow.epochs]
    run.stops = {name: Stop(s["step"], s["val_acc"], s["epoch"]) for name, s in shadow.stops.items()}
    if len(run.epoch_val_acc) != args.max_epochs:
        raise RuntimeError(f"the fixed run ended after {len(run.epoch_val_acc)} epochs: a stop escaped ShadowStops")
    for name in stoppers:
        run.stops.setdefault(name, None)
    if args.real:
        for name, cb in make_stoppers(args, [(args.margin, args.patience)]).items():
            trainer, model, _ = fit(args, optimizer, seed, [cb])
            run.real_stops[name] = Stop(trainer.global_step, val_accuracy(model, val), trainer.current_epoch)
    return run


# ---------------------------------------------------------------------- tables
def default_band(args: argparse.Namespace) -> str:
    return band_name(args.margin, args.patience)


def outcome(run: Run, method: str, args: argparse.Namespace) -> tuple[int, float]:
    """(optimizer steps, val acc at the stop) of a method; a stopper that never fired ran the budget."""
    if method == "fixed":
        return run.epoch_steps[-1], run.epoch_val_acc[-1]
    stop = run.stops[default_band(args) if method == "noise_band" else method]
    return (stop.steps, stop.val_acc) if stop else (run.epoch_steps[-1], run.epoch_val_acc[-1])


def comparison_rows(runs: list[Run], args: argparse.Namespace) -> list[list[Any]]:
    rows = []
    for run in runs:
        best = max(run.epoch_val_acc)
        best_epoch = run.epoch_val_acc.index(best)
        full = run.epoch_steps[-1]
        for method in METHODS:
            steps, acc = outcome(run, method, args)
            name = default_band(args) if method == "noise_band" else method
            fired = method == "fixed" or run.stops.get(name) is not None
            rows.append(
                [
                    run.optimizer,
                    run.seed,
                    method if fired else f"{method} (never stopped)",
                    steps,
                    f"{1 - steps / full:+.0%}",
                    f"{100 * acc:.2f}",
                    f"{100 * (acc - best):+.2f}",
                    f"{100 * best:.2f} @ {run.epoch_steps[best_epoch]}",
                ]
            )
    return rows


def summary_rows(runs: list[Run], args: argparse.Namespace) -> list[list[Any]]:
    rows = []
    for optimizer in args.optimizers:
        mine = [r for r in runs if r.optimizer == optimizer]
        for method in METHODS:
            results = [outcome(r, method, args) for r in mine]
            saved = [1 - s / r.epoch_steps[-1] for (s, _), r in zip(results, mine)]
            gaps = [100 * (a - max(r.epoch_val_acc)) for (_, a), r in zip(results, mine)]
            rows.append(
                [
                    optimizer,
                    method,
                    f"{median([s for s, _ in results]):.0f}",
                    f"{median(saved):+.0%}",
                    f"{statistics.mean(100 * a for _, a in results):.2f}",
                    f"{statistics.mean(gaps):+.2f}",
                    f"{min(gaps):+.2f}",
                ]
            )
    return rows


def target_line(runs: list[Run], args: argparse.Namespace) -> str:
    """The issue's target for (a): within 1 point of (d)'s best accuracy with >= 30 % fewer steps."""
    met = 0
    for run in runs:
        steps, acc = outcome(run, "noise_band", args)
        met += (max(run.epoch_val_acc) - acc <= 0.01) and (steps <= 0.7 * run.epoch_steps[-1])
    return (
        f"target (noise_band within 1 point of the fixed run's best val acc with >= 30% fewer steps): "
        f"met in {met} of {len(runs)} runs"
    )


def sweep_rows(runs: list[Run], band_grid: list[tuple[float, int]], args: argparse.Namespace) -> list[list[Any]]:
    rows = []
    for margin, patience in band_grid:
        row: list[Any] = [f"{margin:g}", patience]
        for optimizer in args.optimizers:
            mine = [r for r in runs if r.optimizer == optimizer]
            stops = [r.stops[band_name(margin, patience)] for r in mine]
            fired = [(s, r) for s, r in zip(stops, mine) if s is not None]
            steps = [s.steps if s else r.epoch_steps[-1] for s, r in zip(stops, mine)]
            gaps = [
                100 * ((s.val_acc if s else r.epoch_val_acc[-1]) - max(r.epoch_val_acc)) for s, r in zip(stops, mine)
            ]
            ok = sum(g >= -1.0 and n <= 0.7 * r.epoch_steps[-1] for g, n, r in zip(gaps, steps, mine))
            row += [
                f"{len(fired)}/{len(mine)}",
                " ".join(str(n) for n in steps),
                f"{statistics.mean(gaps):+.2f} (worst {min(gaps):+.2f})",
                f"{ok}/{len(mine)}",
            ]
        rows.append(row)
    return rows


def real_rows(runs: list[Run], args: argparse.Namespace) -> list[list[Any]]:
    rows = []
    for run in runs:
        for name, real in run.real_stops.items():
            shadow = run.stops.get(name)
            shadow_txt = f"{shadow.steps} / {100 * shadow.val_acc:.2f}" if shadow else "never stopped"
            rows.append([run.optimizer, run.seed, name, shadow_txt, f"{real.steps} / {100 * real.val_acc:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", choices=("adam", "sgd"), default=["adam", "sgd"])
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--sgd-lr", type=float, default=0.05, help="SGD with momentum 0.9")
    parser.add_argument("--max-epochs", type=int, default=60, help="the fixed budget (d)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per micro-batch")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="noise band margin of (a)")
    parser.add_argument(
        "--patience", type=int, default=DEFAULT_PATIENCE, help="noise band patience of (a), optimizer steps"
    )
    parser.add_argument("--min-steps", type=int, default=0, help="min_steps of (a) and (b)")
    parser.add_argument("--threshold", type=float, default=1e-3, help="gradient norm threshold of (b)")
    parser.add_argument("--es-patience", type=int, default=5, help="EarlyStopping patience of (c), epochs")
    parser.add_argument("--margins", nargs="+", type=float, help="sweep: noise band margins")
    parser.add_argument("--patiences", nargs="+", type=int, help="sweep: noise band patiences")
    parser.add_argument("--real", action="store_true", help="also run (a)-(c) as fits that really stop, as a check")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--out", help="write every run (curves and stops) as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.lr = {"adam": args.adam_lr, "sgd": args.sgd_lr}
    quiet_lightning()

    band_grid = [(args.margin, args.patience)]
    if args.margins or args.patiences:
        sweep = list(itertools.product(args.margins or [args.margin], args.patiences or [args.patience]))
        band_grid += [mp for mp in sweep if mp != band_grid[0]]
    runs = []
    for seed in args.seeds:
        for optimizer in args.optimizers:
            runs.append(run_one(args, optimizer, seed, band_grid))
            print(f"[{optimizer} seed {seed}: {runs[-1].seconds:.0f} s]", flush=True)

    effective = args.batch_size * args.accumulate
    print(
        f"\n# Stopping on the digits demo ({machine_line()}; effective batch {effective} = "
        f"{args.accumulate}×{args.batch_size}; adam lr {args.adam_lr:g}, sgd lr {args.sgd_lr:g} momentum 0.9; "
        f"seeds {args.seeds}; budget {args.max_epochs} epochs)"
    )
    print(
        f"\n(a) = {default_band(args)}, min_steps {args.min_steps}; (b) threshold {args.threshold:g}; "
        f"(c) EarlyStopping(val/loss, patience {args.es_patience}); steps = optimizer steps.\n"
    )
    print(
        markdown_table(
            [
                "optimizer",
                "seed",
                "method",
                "steps",
                "saved vs fixed",
                "val acc at stop %",
                "Δ vs best of fixed",
                "fixed: best @ step",
            ],
            comparison_rows(runs, args),
        )
    )
    print(
        f"\n## Summary over {len(args.seeds)} seeds (steps: median; accuracies: mean; Δ: points vs the fixed run's best)\n"
    )
    print(
        markdown_table(
            ["optimizer", "method", "steps", "saved", "val acc %", "mean Δ", "worst Δ"], summary_rows(runs, args)
        )
    )
    print("\n" + target_line(runs, args))
    if len(band_grid) > 1:
        headers = ["margin", "patience"]
        for optimizer in args.optimizers:
            headers += [
                f"{optimizer}: stopped",
                f"{optimizer}: steps per seed",
                f"{optimizer}: Δ acc (points)",
                f"{optimizer}: target met",
            ]
        print(f"\n## Noise-band sweep (seeds {args.seeds}; a run that never stopped counts the full budget)\n")
        print(markdown_table(headers, sweep_rows(runs, sorted(band_grid), args)))
    if args.real:
        print("\n## Shadow stops vs real stopping fits (steps / val acc %)\n")
        print(markdown_table(["optimizer", "seed", "stopper", "shadow", "real"], real_rows(runs, args)))
    write_json(
        args.out,
        {"machine": machine_line(), "args": {k: v for k, v in vars(args).items()}, "runs": [asdict(r) for r in runs]},
    )


if __name__ == "__main__":
    main()
