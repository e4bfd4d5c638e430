"""Which truth the noise estimate follows under random reshuffling (issue #24; docs/science.md, "Under random
reshuffling").

A stopping task of ``stopping_tasks.py`` (Adam at its lr), or ``demo`` (the demo's digits CNN, no BatchNorm, Adam
1e-3, micro-batches of 16), 4 micro-batches a step, GradNormEarlyStopping measuring but never stopping, with
``tests/noise/_truth.py``'s TruthCallback every 10th step, its loader's sampler either a shuffled epoch that records
its permutation (``shuffle``) or ``RandomSampler(replacement=True)`` (``replace``).
Per logged step: the band ratio B·‖G‖²/(margin·tr Σ) of the full-data truth, of the remaining-set truth ‖G_R‖²
(the examples the epoch had not drawn before the step) and of ‖G‖² + 2·G·(G_R − G) (what the estimate is unbiased
for, less a term of mean zero), each with tr Σ of the full data, beside the logged band ratio and its 90 % interval.
Summary over the steps from ``--skip`` on: the share of steps whose interval covers each, and the medians; the
means of the band ratios, the estimate's over the logged steps, the truths' over every step with one (with
``--truth-every 1``: an EMA averages over all the steps of an epoch, and at an epoch's first step the truths agree).

    nice python benchmarks/reshuffle_truth.py "synthetic logistic regression" --steps 400
    nice python benchmarks/reshuffle_truth.py "diabetes MLP (regression)" --steps 400 --sampler replace
    nice python benchmarks/reshuffle_truth.py demo --steps 400 --seed 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import quiet_lightning
from stopping_tasks import TASKS, TaskModule
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

sys.path[:0] = [str(Path(__file__).parents[1] / "tests" / "noise"), str(Path(__file__).parents[1] / "tests")]
from _truth import RecordingSampler, TruthCallback, compare, digits_train  # noqa: E402
from conftest import RecordingLogger, trainer_kwargs  # noqa: E402

from trainvitals import GradNormEarlyStopping  # noqa: E402
from trainvitals.demo.model import DigitsCNN  # noqa: E402


def setup(name: str, every: int) -> tuple[pl.LightningModule, TruthCallback, TensorDataset, int]:
    """The module, its truth every ``every`` steps, the training set and the micro-batch size of run ``name``."""
    if name == "demo":
        data = TensorDataset(*digits_train())
        return DigitsCNN(), TruthCallback(*data.tensors, every_n_steps=every, batch_size=64), data, 16
    task = TASKS[name]
    (xt, yt), _ = task.data()
    kw = {"loss": lambda o, t: F.mse_loss(o, t)} if task.kind == "regression" else {}
    truth = TruthCallback(xt, yt, every_n_steps=every, module=lambda m: m.net, batch_size=task.micro_batch * 4, **kw)
    module = TaskModule(task.net(), task.kind, "adam", task.lr["adam"])
    return module, truth, TensorDataset(xt, yt), task.micro_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=[*sorted(TASKS), "demo"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sampler", choices=("shuffle", "replace"), default="shuffle")
    parser.add_argument("--skip", type=int, default=50, help="first optimizer step of the summary")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and the sampler's order")
    parser.add_argument("--truth-every", type=int, default=10, help="steps between truths (1: the means below)")
    args = parser.parse_args()
    quiet_lightning()
    torch.manual_seed(args.seed)
    model, truth, data, micro = setup(args.task, args.truth_every)
    stop = GradNormEarlyStopping(min_steps=10**6, verbose=False)
    logger = RecordingLogger()
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            callbacks=[stop, truth],
            max_steps=args.steps,
            max_epochs=-1,
            accumulate_grad_batches=4,
            log_every_n_steps=10,
        )
    )
    if args.sampler == "shuffle":
        sampler = RecordingSampler(data, seed=args.seed)
    else:
        sampler = RandomSampler(data, replacement=True, generator=torch.Generator().manual_seed(args.seed))
    trainer.fit(model, DataLoader(data, batch_size=micro, sampler=sampler, drop_last=True))
    rows = [r for r in compare(truth.truths, logger.series, stop.margin) if r.truth.step >= args.skip]
    scale = micro * 4 / stop.margin
    print(f"{args.task}, {args.sampler}, seed {args.seed}: N = {len(data)}, B = {micro * 4}, margin {stop.margin}")
    print("step  n_R  truth(G)  truth(G_R)  truth(cross)  estimate [90 %]   (band ratios)")
    table: dict[str, list[tuple[float, bool, float, bool]]] = {"full": [], "remaining": [], "cross": []}
    for r in rows:
        t, low, high = r.truth, *r.interval("band_ratio")
        g_low, g_high = r.interval("grad_sq_norm")
        truths = {"full": t.grad_sq_norm}
        if t.remaining:
            truths |= {"remaining": t.remaining_grad_sq_norm, "cross": t.cross_grad_sq_norm}
        for k, g in truths.items():
            band = scale * g / t.trace_cov
            table[k].append((band, low <= band <= high, r.logged["grad_sq_norm"] / g, g_low <= g <= g_high))
        cells = "  ".join(f"{scale * truths.get(k, math.nan) / t.trace_cov:10.3f}" for k in table)
        print(f"{t.step:4d} {t.remaining:4d}  {cells}  {r.logged['band_ratio']:.3f} [{low:.3f}, {high:.3f}]")
    median = statistics.median(r.logged["band_ratio"] for r in rows)
    print(f"steps {len(rows)} from step {args.skip}; the estimate's band ratio: median {median:.3f}")
    for k, v in table.items():
        if v:
            band, band_in, ratio, g_in = zip(*v)
            print(
                f"  {k:9s}: band ratio median {statistics.median(band):.3f}, covered {sum(band_in) / len(v):.0%}; "
                f"logged ‖G‖²/truth median {statistics.median(ratio):.2f}, covered {sum(g_in) / len(v):.0%}"
            )

    later = [t for step, t in sorted(truth.truths.items()) if step >= args.skip]
    means = {"full": [t.band_ratio(stop.margin) for t in later]}
    if later[0].remaining:
        means["remaining"] = [scale * t.remaining_grad_sq_norm / t.trace_cov for t in later]
        means["cross"] = [scale * t.cross_grad_sq_norm / t.trace_cov for t in later]
    cells = ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in means.items())
    estimate = statistics.mean(r.logged["band_ratio"] for r in rows)
    print(f"means: estimate {estimate:.3f} over {len(rows)} logged steps; truths over {len(later)} steps: {cells}")


if __name__ == "__main__":
    main()
