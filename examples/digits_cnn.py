"""The digits CNN of ``trainvitals demo`` with every trainvitals callback and the dashboard attached.

Real data without a download: scikit-learn's bundled 8×8 handwritten digits. Trains for a few epochs
(well under two minutes on two CPU cores), then prints ``trainvitals report`` on the run.

    python examples/digits_cnn.py --logdir runs/examples
    tensorboard --logdir runs/examples      # the "Custom Scalars" tab is the trainvitals dashboard
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from _common import fit_example, run_example

from trainvitals.demo.data import DigitsDataModule
from trainvitals.demo.model import DigitsCNN


def train(
    logdir: str, max_epochs: int = 8, batch_size: int = 16, accumulate: int = 4, seed: int = 0, quiet: bool = True
) -> str:
    """Train the digits CNN with trainvitals attached; returns the run's log folder.

    ``accumulate`` micro-batches of ``batch_size`` make one optimizer step: the micro-batches are the
    free second batch size that the noise estimate (and so the noise band) needs.
    """
    pl.seed_everything(seed, workers=True, verbose=False)
    return fit_example(
        DigitsCNN(),
        DigitsDataModule(batch_size=batch_size),
        logdir,
        "digits_cnn",
        every_n_steps=20,
        min_steps=100,
        quiet=quiet,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=2,
        deterministic=True,
    )


def main(argv: list[str] | None = None) -> int:
    return run_example(__doc__, argv, train, "--max-epochs", 8)


if __name__ == "__main__":
    sys.exit(main())
