"""The options of ``trainvitals demo``, kept free of heavy imports so that ``trainvitals --help`` is quick."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logdir", default="runs", help="TensorBoard log folder")
    parser.add_argument("--max-epochs", type=int, default=60, help="upper bound; the noise band stops earlier")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per micro-batch (DataLoader batch)")
    parser.add_argument(
        "--accumulate", type=int, default=4, help="accumulate_grad_batches (effective batch = batch-size × accumulate)"
    )
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Adam, or SGD with momentum 0.9")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--min-steps", type=int, default=100, help="no stop before this many optimizer steps")
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="cut the lr 10× at each noise-band entry (BandSchedule) instead of stopping there; stop after 2 cuts",
    )
    parser.add_argument("--log-every-n-steps", type=int, default=5, help="logging cadence, in optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling (the split is fixed)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; the digits CNN is too small to gain from more, and on a busy "
        "machine several threads spin on each other's cores (see docs/benchmarks.md)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar, model summary or diagnosis tables")
