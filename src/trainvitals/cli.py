"""The ``trainvitals`` command: ``trainvitals demo`` and ``trainvitals report LOGDIR``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from trainvitals import __version__
    from trainvitals.demo.options import add_arguments as add_demo_arguments
    from trainvitals.report import command as report

    parser = argparse.ArgumentParser(prog="trainvitals", description="Vital signs of a training run.")
    parser.add_argument("--version", action="version", version=f"trainvitals {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a CNN on the bundled digits with trainvitals attached",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_demo_arguments(demo)
    report.add_arguments(sub.add_parser("report", help="health report of logged runs", description=report.DESCRIPTION))
    args = report.parse(parser, argv)  # the exit status where argparse exits (--help, --version, a usage error)
    if isinstance(args, int):
        return args
    if args.command == "report":
        return report.run(args)
    from trainvitals.demo import run as demo_run

    return demo_run.main(args)


if __name__ == "__main__":
    sys.exit(main())
