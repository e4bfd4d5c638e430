"""The ``trainvitals`` command: ``trainvitals demo`` and ``trainvitals report LOGDIR``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainvitals", description="Vital signs of a training run.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a CNN on the bundled digits with trainvitals attached")
    from trainvitals.demo import run as demo_run

    demo_run.add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo_run.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
