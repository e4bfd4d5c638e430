"""When to stop, beyond the digits CNN: GradNormEarlyStopping at its defaults against Lightning's EarlyStopping.

Tasks that need no download (scikit-learn's bundled data sets, Python's own source text, synthetic
problems) and other architectures than the digits CNN: MLPs, a linear model, a GRU, a 1-D CNN. Per
task, optimizer (Adam; SGD with momentum 0.9) and seed, one fit of ``max_epochs`` carries

- ``noise_band``: ``GradNormEarlyStopping()`` at its defaults (margin, patience, ``min_steps``,
  ``check_every_n_steps``), its noise from the micro-batches of ``accumulate_grad_batches=4``;
- ``val_loss``: Lightning's ``EarlyStopping(monitor="val_loss", patience=5)`` (epochs);

and serves as the reference: the validation loss and metric after every epoch give the best epoch
(lowest validation loss). As in ``stopping_comparison.py``, a guard after the stoppers records each
one's first stop (optimizer step; validation loss and metric of the weights at that step, computed
on the validation tensors in one batch) and lets the run go on, so each stop is the one a fit with
that stopper alone would make. A stopper that never fires counts the full budget and its last weights.

A stop is *within tolerance* when its validation loss is at most 2% above the best epoch's, or its
metric at most 1 point below the best epoch's metric of the run (accuracy %, or 100·R² for
regression). It *saves steps* when it stops before the budget ends.

    python benchmarks/stopping_tasks.py --out stopping_tasks.json
    python benchmarks/stopping_tasks.py --quick
    python benchmarks/stopping_tasks.py --margins 0.1 0.2 0.5 --patiences 10 30 100
"""

from __future__ import annotations

import argparse
import itertools
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import ShadowStops, machine_line, markdown_table, median, quiet_lightning, quiet_trainer, write_json
from lightning.pytorch.callbacks import Callback, EarlyStopping
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormEarlyStopping

SPLIT_SEED = 0  # every split and synthetic data set is fixed; --seeds change initialisation and shuffling
VAL_FRACTION = 0.2
LOSS_TOLERANCE = 0.02  # relative, against the best epoch's validation loss
METRIC_TOLERANCE = 1.0  # points of accuracy % or 100·R²
ES_PATIENCE = 5  # epochs

Split = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Task:
    """A data set, a network and the budget to train it in.

    ``kind`` is ``"classification"`` (logits ``(..., classes)``, integer targets; the metric is
    accuracy %, per token for a sequence) or ``"regression"`` (MSE; the metric is 100·R²).
    ``micro_batch`` examples per micro-batch, 4 micro-batches per optimizer step.
    """

    name: str
    kind: str
    data: Callable[[], Split]
    net: Callable[[], nn.Module]
    lr: dict[str, float]
    max_epochs: int
    micro_batch: int = 16


# ---------------------------------------------------------------------- data
def _split(x: Tensor, y: Tensor) -> Split:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = int(len(y) * VAL_FRACTION)
    return (x[order[n_val:]], y[order[n_val:]]), (x[order[:n_val]], y[order[:n_val]])


def _standardize(split: Split, targets: bool = False) -> Split:
    """Features (and regression targets) scaled by the training set's mean and standard deviation.

    A feature constant on the training set (a digit's border pixel) is only centred.
    """
    (xt, yt), (xv, yv) = split
    mean, std = xt.mean(0), xt.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    xt, xv = (xt - mean) / std, (xv - mean) / std
    if targets:
        mean, std = yt.mean(), yt.std()
        yt, yv = ((yt - mean) / std).unsqueeze(-1), ((yv - mean) / std).unsqueeze(-1)
    return (xt, yt), (xv, yv)


def sklearn_data(loader: str, regression: bool = False) -> Split:
    """One of scikit-learn's bundled data sets (``load_breast_cancer``, ``load_wine``, ...), split and standardized."""
    from sklearn import datasets

    bunch = getattr(datasets, loader)()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.float32 if regression else torch.long)
    return _standardize(_split(x, y), targets=regression)


def logistic_data(n: int = 4000, features: int = 20) -> Split:
    """Labels drawn from a logistic model of Gaussian features: the Bayes error is well above zero."""
    g = torch.Generator().manual_seed(SPLIT_SEED)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, generator=g) * 0.5
    y = torch.bernoulli(torch.sigmoid(x @ w), generator=g).long()
    return _split(x, y)


def pulse_data(n: int = 2000, length: int = 64) -> Split:
    """Noisy 1-D signals ``(n, 1, length)`` holding a square pulse (class 1), a triangle (class 2) or neither
    (class 0) at a random place."""
    g = torch.Generator().manual_seed(SPLIT_SEED)
    x = torch.randn(n, 1, length, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    start = torch.randint(0, length - 8, (n,), generator=g)
    shapes = {1: torch.ones(8), 2: torch.tensor([0.25, 0.5, 0.75, 1.0, 1.0, 0.75, 0.5, 0.25])}
    for i in range(n):
        if int(y[i]) in shapes:
            x[i, 0, start[i] : start[i] + 8] += 2.0 * shapes[int(y[i])]
    return _split(x, y)


STDLIB_TEXT = ("textwrap.py", "fractions.py")
CONTEXT = 32


def char_data() -> Split:
    """Windows of 33 characters of two standard-library modules (48 kB): inputs the first 32, targets the next.

    The last fifth of the text is the validation set (no window straddles the split).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text(encoding="utf-8") for name in STDLIB_TEXT)
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([vocab[c] for c in text], dtype=torch.long)

    def windows(part: Tensor) -> tuple[Tensor, Tensor]:
        n = (len(part) - 1) // CONTEXT
        return part[: n * CONTEXT].view(n, CONTEXT), part[1 : n * CONTEXT + 1].view(n, CONTEXT)

    cut = int((1 - VAL_FRACTION) * len(ids))
    return windows(ids[:cut]), windows(ids[cut:])


# ---------------------------------------------------------------------- networks
def mlp(features: int, hidden: int, out: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out)
    )


class CharGRU(nn.Module):
    """Embedding(vocab → 32) → GRU(32 → 96) → Linear(96 → vocab), logits ``(B, T, vocab)``."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.gru = nn.GRU(32, 96, batch_first=True)
        self.head = nn.Linear(96, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gru(self.embed(x))[0])


def pulse_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(1, 16, 5, padding=2),
        nn.ReLU(),
        nn.Conv1d(16, 16, 5, padding=2),
        nn.ReLU(),
        nn.AdaptiveMaxPool1d(1),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _vocab_size() -> int:
    (xt, _), (xv, _) = char_data()
    return int(max(xt.max(), xv.max())) + 1


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task(
            "breast_cancer MLP",
            "classification",
            lambda: sklearn_data("load_breast_cancer"),
            lambda: mlp(30, 64, 2),
            {"adam": 1e-3, "sgd": 0.01},
            max_epochs=100,
        ),
        Task(
            "wine MLP",
            "classification",
            lambda: sklearn_data("load_wine"),
            lambda: mlp(13, 32, 3),
            {"adam": 1e-3, "sgd": 0.01},
            max_epochs=150,
            micro_batch=8,
        ),
        Task(
            "diabetes MLP (regression)",
            "regression",
            lambda: sklearn_data("load_diabetes", regression=True),
            lambda: mlp(10, 64, 1),
            {"adam": 1e-3, "sgd": 0.005},
            max_epochs=150,
        ),
        Task(
            "digits MLP",
            "classification",
            lambda: sklearn_data("load_digits"),
            lambda: mlp(64, 128, 10),
            {"adam": 1e-3, "sgd": 0.02},
            max_epochs=40,
        ),
        Task(
            "synthetic logistic regression",
            "classification",
            logistic_data,
            lambda: nn.Linear(20, 2),
            {"adam": 1e-2, "sgd": 0.05},
            max_epochs=20,
        ),
        Task(
            "synthetic pulses 1-D CNN",
            "classification",
            pulse_data,
            pulse_cnn,
            {"adam": 3e-3, "sgd": 0.02},
            max_epochs=30,
        ),
        Task(
            "stdlib chars GRU",
            "classification",
            char_data,
            lambda: CharGRU(_vocab_size()),
            {"adam": 3e-3, "sgd": 0.5},
            max_epochs=40,
        ),
    ]
}


# ---------------------------------------------------------------------- training
class TaskModule(pl.LightningModule):
    """A network, its loss, and Adam or SGD (momentum 0.9); logs ``val_loss`` for EarlyStopping."""

    def __init__(self, net: nn.Module, kind: str, optimizer: str, lr: float) -> None:
        super().__init__()
        self.net, self.kind, self.optimizer_name, self.lr = net, kind, optimizer, lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        if self.kind == "regression":
            return F.mse_loss(out, y)
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def evaluate(model: TaskModule, val: tuple[Tensor, Tensor]) -> dict[str, float]:
    """Validation loss and metric (accuracy %, or 100·R²) of the current weights, in one batch, without the RNG."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(val[0])
        loss = model.loss(out, val[1]).item()
        if model.kind == "regression":
            metric = 100 * (1 - loss / val[1].var(unbiased=False).item())
        else:
            metric = 100 * (out.argmax(-1) == val[1]).double().mean().item()
    model.train(was_training)
    return {"val_loss": loss, "metric": metric}


@dataclass
class TaskRun:
    """One full-budget fit: the per-epoch curve and the stops of the stoppers it carried (None: never stopped)."""

    task: str
    optimizer: str
    seed: int
    epochs: list[dict[str, float]] = field(default_factory=list)
    stops: dict[str, dict[str, float] | None] = field(default_factory=dict)
    seconds: float = 0.0
    estimate: dict[str, float] = field(default_factory=dict)  # EstimateShares: what the default stopper's estimate said

    @property
    def best(self) -> dict[str, float]:
        """The epoch with the lowest validation loss."""
        return min(self.epochs, key=lambda e: e["val_loss"])

    def outcome(self, name: str) -> dict[str, float]:
        """A stopper's stop; one that never fired ran the budget and ends with the last weights."""
        return self.stops.get(name) or self.epochs[-1]

    def within_tolerance(self, name: str) -> bool:
        stop, best = self.outcome(name), self.best
        return (
            stop["val_loss"] <= (1 + LOSS_TOLERANCE) * best["val_loss"]
            or stop["metric"] >= best["metric"] - METRIC_TOLERANCE
        )

    def saves_steps(self, name: str) -> bool:
        return self.outcome(name)["step"] < self.epochs[-1]["step"]


def band_name(margin: float, patience: int) -> str:
    return f"noise_band(margin={margin:g}, patience={patience})"


def make_stoppers(band_grid: list[tuple[float, int]]) -> dict[str, Callback]:
    """``noise_band`` at the defaults, one stopper per other (margin, patience) of a sweep, and ``val_loss``."""
    stoppers: dict[str, Callback] = {"noise_band": GradNormEarlyStopping(verbose=False)}
    for margin, patience in band_grid:
        stoppers[band_name(margin, patience)] = GradNormEarlyStopping(margin=margin, patience=patience, verbose=False)
    stoppers["val_loss"] = EarlyStopping(
        monitor="val_loss", mode="min", patience=ES_PATIENCE, check_on_train_epoch_end=False
    )
    return stoppers


class EstimateShares(Callback):
    """Every 10th optimizer step after the first tenth of the budget: whether the default stopper's noise estimate
    has a B_simple lower bound > 0 (90 %) and a reliable point estimate (docs/benchmarks.md, issue #24)."""

    def __init__(self, stopper: GradNormEarlyStopping, budget: int) -> None:
        self.stopper, self.budget, self.seen = stopper, budget, []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        step = trainer.global_step
        if step % 10 or step < self.budget / 10 or (self.seen and self.seen[-1][0] == step):
            return
        h = self.stopper.gradient_noise.host_summary()
        if h["count"]:
            self.seen.append((step, h.get("b_simple_low", _fieller_low(h)) > 0, h["reliable"]))

    def shares(self) -> dict[str, float]:
        n = max(len(self.seen), 1)
        return {
            "checks": len(self.seen),
            "lower_bound": sum(s[1] for s in self.seen) / n,
            "reliable": sum(s[2] for s in self.seen) / n,
        }


def _fieller_low(h: dict[str, Any]) -> float:
    """B_simple's 90 % lower end from a summary without one (an estimate before its intervals; covariance 0)."""
    z = 1.6448536269514722
    a = h["grad_sq_norm"] ** 2 - (z * h["grad_sq_norm_se"]) ** 2
    b = h["trace_cov"] * h["grad_sq_norm"]
    q = h["trace_cov"] ** 2 - (z * h["trace_cov_se"]) ** 2
    upper = b + max(b * b - a * q, 0.0) ** 0.5
    return q / upper if q > 0 and upper > 0 else 0.0


def fit_task(
    model: pl.LightningModule,
    train: DataLoader,
    val: tuple[Tensor, Tensor],
    max_epochs: int,
    callbacks: list[Callback],
) -> float:
    """Fit ``model`` for ``max_epochs`` epochs of ``train``'s micro-batches, 4 to an optimizer step,
    validating on ``val`` in one batch after each epoch, deterministically; the fit's wall seconds."""
    trainer = quiet_trainer(max_epochs=max_epochs, accumulate_grad_batches=4, callbacks=callbacks, deterministic=True)
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=train, val_dataloaders=DataLoader(TensorDataset(*val), batch_size=len(val[1])))
    return time.perf_counter() - start


def run_one(task: Task, optimizer: str, seed: int, max_epochs: int, band_grid: list[tuple[float, int]]) -> TaskRun:
    run = TaskRun(task.name, optimizer, seed)
    (xt, yt), val = task.data()
    pl.seed_everything(seed, workers=True, verbose=False)
    model = TaskModule(task.net(), task.kind, optimizer, task.lr[optimizer])
    train = DataLoader(TensorDataset(xt, yt), batch_size=task.micro_batch, shuffle=True, drop_last=True)
    stoppers = make_stoppers(band_grid)
    shadow = ShadowStops(stoppers, lambda m: evaluate(m, val))
    shares = EstimateShares(stoppers["noise_band"], max_epochs * (len(xt) // task.micro_batch // 4))
    run.seconds = fit_task(model, train, val, max_epochs, [*stoppers.values(), shares, shadow])
    if len(shadow.epochs) != max_epochs:
        raise RuntimeError(f"the fixed run ended after {len(shadow.epochs)} epochs: a stop escaped ShadowStops")
    run.epochs = shadow.epochs
    run.stops = {name: shadow.stops.get(name) for name in stoppers}
    run.estimate = shares.shares()
    return run


# ---------------------------------------------------------------------- tables
METHODS = ("noise_band", "val_loss")


def _cell(run: TaskRun, name: str) -> str:
    """``step (saved %) · Δ val loss % · Δ metric``, ``—`` for the step of a stopper that never fired; ✗ out of tolerance."""
    stop, best = run.outcome(name), run.best
    at = "—" if run.stops.get(name) is None else f"{stop['step']:.0f} ({1 - stop['step'] / run.epochs[-1]['step']:.0%})"
    change = f"{100 * (stop['val_loss'] / best['val_loss'] - 1):+.1f}% · {stop['metric'] - best['metric']:+.1f}"
    return f"{at} · {change}{'' if run.within_tolerance(name) else ' ✗'}"


def run_rows(runs: list[TaskRun]) -> list[list[Any]]:
    rows = []
    for run in runs:
        best = run.best
        rows.append(
            [
                run.task,
                run.optimizer,
                run.seed,
                run.epochs[-1]["step"],
                f"{best['step']:.0f} · {best['val_loss']:.4g} · {best['metric']:.1f}",
                *(_cell(run, m) for m in METHODS),
            ]
        )
    return rows


def _counts(runs: list[TaskRun], name: str) -> list[str]:
    """Of ``runs``: within tolerance (by the loss, by the metric), saving steps, both; median fraction saved."""

    def n(test: Callable[[TaskRun], bool]) -> int:
        return sum(test(r) for r in runs)

    by_loss = n(lambda r: r.outcome(name)["val_loss"] <= (1 + LOSS_TOLERANCE) * r.best["val_loss"])
    by_metric = n(lambda r: r.outcome(name)["metric"] >= r.best["metric"] - METRIC_TOLERANCE)
    saved = median([1 - r.outcome(name)["step"] / r.epochs[-1]["step"] for r in runs])
    return [
        f"{n(lambda r: r.within_tolerance(name))}/{len(runs)} ({by_loss}, {by_metric})",
        f"{n(lambda r: r.saves_steps(name))}/{len(runs)}",
        f"{n(lambda r: r.within_tolerance(name) and r.saves_steps(name))}/{len(runs)}",
        f"{saved:.0%}",
    ]


COUNT_HEADERS = ["within tol. (loss, metric)", "saves steps", "tol. and saves", "median saved"]


def groups(runs: list[TaskRun], per_task: bool = True) -> list[tuple[str, list[TaskRun]]]:
    """Each task's runs (``per_task``), each optimizer's over all tasks, and all runs, labelled."""
    tasks, optimizers = dict.fromkeys(r.task for r in runs), dict.fromkeys(r.optimizer for r in runs)
    out = [(task, [r for r in runs if r.task == task]) for task in tasks] if per_task else []
    out += [(f"all tasks, {o}", [r for r in runs if r.optimizer == o]) for o in optimizers]
    return [*out, ("**all**", runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), metavar="TASK", help=f"any of {list(TASKS)}"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--optimizers", nargs="+", choices=("adam", "sgd"), default=["adam", "sgd"])
    parser.add_argument(
        "--margins",
        nargs="+",
        type=float,
        help="sweep: noise band margins (at the default patience unless --patiences)",
    )
    parser.add_argument("--patiences", nargs="+", type=int, help="sweep: noise band patiences")
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, a quarter of each budget")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--out", help="write every run (curves and stops) as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_lightning()
    if args.quick:
        args.seeds = args.seeds[:1]
    default = GradNormEarlyStopping(verbose=False)
    band_grid = []
    if args.margins or args.patiences:
        grid = itertools.product(args.margins or [default.margin], args.patiences or [default.patience])
        band_grid = [mp for mp in grid if mp != (default.margin, default.patience)]

    runs = []
    for name in args.tasks:
        task = TASKS[name]
        epochs = max(1, task.max_epochs // 4) if args.quick else task.max_epochs
        for seed in args.seeds:
            for optimizer in args.optimizers:
                runs.append(run_one(task, optimizer, seed, epochs, band_grid))
                print(f"[{name}, {optimizer}, seed {seed}: {runs[-1].seconds:.0f} s]", flush=True)

    print(f"\n# Stopping beyond the digits CNN ({machine_line()}; 4 micro-batches per step; seeds {args.seeds})")
    print(
        f"\nnoise_band = GradNormEarlyStopping() at its defaults (margin {default.margin:g}, patience "
        f"{default.patience}, min_steps {default.min_steps}, check_every_n_steps {default.check_every_n_steps}); "
        f"val_loss = EarlyStopping(monitor='val_loss', patience={ES_PATIENCE}). Cells: stop step (steps saved) · "
        f"val loss vs the best epoch's · metric (accuracy %, regression 100·R²) minus the best epoch's; "
        f"— never stopped (last weights); ✗ outside tolerance (val loss > {100 * LOSS_TOLERANCE:g}% above "
        f"and metric > {METRIC_TOLERANCE:g} point below the best epoch's).\n"
    )
    print(
        markdown_table(
            [
                "task",
                "optimizer",
                "seed",
                "budget (steps)",
                "best epoch: step · val loss · metric",
                "noise_band",
                "val_loss",
            ],
            run_rows(runs),
        )
    )
    print(
        f"\n## Summary over {len(args.optimizers)} optimizers × seeds {args.seeds} (loss, metric: "
        f"runs within tolerance by each test)\n"
    )
    headers = ["runs", *(f"{m}: {h}" for m in METHODS for h in COUNT_HEADERS)]
    print(markdown_table(headers, [[g, *(c for m in METHODS for c in _counts(mine, m))] for g, mine in groups(runs)]))
    print("\n## The default stopper's noise estimate, every 10th step after the first tenth of the budget\n")
    print(
        markdown_table(
            ["runs", "checks", "B_simple lower bound > 0 (90 %)", "reliable point estimate"],
            [
                [
                    g,
                    sum(r.estimate["checks"] for r in mine),
                    f"{median([r.estimate['lower_bound'] for r in mine]):.0%} (median), "
                    f"{min(r.estimate['lower_bound'] for r in mine):.0%} (least)",
                    f"{median([r.estimate['reliable'] for r in mine]):.0%} (median)",
                ]
                for g, mine in groups(runs)
            ],
        )
    )
    if band_grid:
        names = {
            "noise_band (defaults)": "noise_band",
            **{band_name(m, p): band_name(m, p) for m, p in band_grid},
            f"EarlyStopping(val_loss, patience {ES_PATIENCE})": "val_loss",
        }
        print("\n## Noise-band sweep\n")
        print(
            markdown_table(
                ["runs", "stopper", *COUNT_HEADERS],
                [
                    [g, label, *_counts(mine, name)]
                    for g, mine in groups(runs, per_task=False)
                    for label, name in names.items()
                ],
            )
        )
    write_json(args.out, {"machine": machine_line(), "args": vars(args), "runs": [asdict(r) for r in runs]})


if __name__ == "__main__":
    main()
