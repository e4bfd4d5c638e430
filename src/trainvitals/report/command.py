"""``trainvitals report LOGDIR``: a health report per run, read from TensorBoard event files — or from a CSVLogger's
``metrics.csv`` or an MLflow file store's run, with the text panels of TrainvitalsDashboard's fit-end JSON
(:mod:`trainvitals.report.readers`).

Every folder under LOGDIR that holds event files is a run (TensorBoard's own notion); loggers with different
prefixes (``TensorBoardLogger(prefix="train")`` logs ``train-grad_norm/total``) that wrote into one folder
are one run each. The event files are read record by record and given to TensorBoard's
``EventAccumulator``: TensorBoard's own reader stops at the first damaged record without a word, so a file
cut short or with one flipped byte would read as a shorter, healthy run. Each run that holds trainvitals
metrics gets five sections — convergence, noise scale and batch size, integrity, memory, spikes and
non-finite steps — and a list of findings; a damaged event file is one of them, naming the file, where the
damage starts and the last step read whole before it.

Exit status, for CI and requeue scripts — the most severe over the runs, in this order (a run that measured
nothing counts only when no run did):

- 1: a critical finding in some run (:data:`CRITICAL_COUNTERS`), in the part of its files that was read:
  non-finite gradients (outside a GradScaler's calibration) or losses, a loss without ``grad_fn`` or that
  reaches no parameter, an optimizer stepping before the backward of its gradients, a parameter still
  unused in the last check window, a parameter outside every optimizer (unregistered: layers in a Python
  list), a computation graph kept alive across steps (GraphIntegrityCallback's counter, or
  MemoryTopologyProfiler's saved bytes still held after backward and growing), a fit TrainingGuard stopped (an
  abort on a divergence, not a convergence stop) or a non-finite step it only warned about (applied as it was) —
  its skips and rollbacks are a warning, which leaves the status alone;
- 3: a run read only in part, and nothing critical in what was read: an event file cut short (a run killed
  or still writing), with a record that fails its checksum or is no event, or unreadable, or a folder that
  cannot be listed; what was logged in the unread part may hold anything;
- 5: a fit that crashed: TrainvitalsDashboard recorded an exception (an error, or KeyboardInterrupt) instead of
  the end of the fit; the report names it;
- 6: a fit that did not end: TrainvitalsDashboard wrote its layout at fit start, but neither the end of the fit
  nor an exception — killed (SIGKILL, out of memory, preempted), or still running. Without TrainvitalsDashboard
  nothing marks a fit's end, and neither 5 nor 6 can be told;
- 2: nothing to report: LOGDIR missing, no event files under it, event files that are empty (0 bytes: not
  flushed yet, or a run that died at once) or without trainvitals metrics (another tool's, or a run without
  trainvitals callbacks); runs with trainvitals panels but no trainvitals scalar (nothing measured: a run that
  ended before its first step, an empty train dataloader, ``max_steps=0``), when no run under LOGDIR measured
  anything — beside runs that did, such a run is reported and their status is the command's; also a usage error;
- 0: every run read whole, every fit ended (as far as TrainvitalsDashboard tells), no critical finding, at
  least one run measured — or a fit that resumed from a checkpoint written after GradNormEarlyStopping's stop
  and stopped again at its start (a requeued job that was over);
- 4: the report could not be written (``--output`` in a missing folder, a full disk, a closed stdout): one
  line on stderr says why. A reader that quits early (``| head``, ``less``) is no error: the status is then
  the report's own.

On an error (2 without a report, 4) one line on stderr says why; with ``--format json`` stdout also gets
``{"error": ..., "exit_status": ...}`` (for 4, when stdout is not what failed).

File and folder names that are not UTF-8 are shown with the odd bytes escaped (``run\\xff``).
No Lightning import here: the command starts in about two seconds, most of it importing torch.

The reading is :mod:`.events`, the verdicts :mod:`.assess`, the text, markdown and JSON :mod:`.render`
(the HTML page :mod:`.html`); this module is the command, and keeps their public names.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainvitals.report.assess import assess
from trainvitals.report.events import Damage, ReportError, Run, printable, read_runs, same_logs
from trainvitals.report.model import (
    BAND_STOP,
    CRITICAL_COUNTERS,
    EXIT_CRASHED,
    EXIT_CRITICAL,
    EXIT_DAMAGED,
    EXIT_NO_DATA,
    EXIT_OK,
    EXIT_UNFINISHED,
    EXIT_UNWRITTEN,
    LAST_WINDOW,
    SEVERITY,
    Finding,
    Row,
    RunReport,
    exit_status,
)
from trainvitals.report.render import render
from trainvitals.tags import LOGGER_JOIN_CHAR

__all__ = [
    "BAND_STOP",
    "CRITICAL_COUNTERS",
    "DESCRIPTION",
    "EXIT_CRASHED",
    "EXIT_CRITICAL",
    "EXIT_DAMAGED",
    "EXIT_NO_DATA",
    "EXIT_OK",
    "EXIT_UNFINISHED",
    "EXIT_UNWRITTEN",
    "FORMATS",
    "LAST_WINDOW",
    "SEVERITY",
    "Damage",
    "Finding",
    "ReportError",
    "Row",
    "Run",
    "RunReport",
    "add_arguments",
    "assess",
    "exit_status",
    "main",
    "parse",
    "printable",
    "read_runs",
    "render",
    "run",
]

FORMATS = ("text", "markdown", "json", "html")

DESCRIPTION = (
    "Health report of the training runs under LOGDIR, read from their TensorBoard event files, CSVLogger "
    "metrics.csv or MLflow file store (mlruns). "
    "Exit status, the most severe over the runs: 1 a critical finding, 3 an event file read only in part, "
    "5 a fit that crashed (an exception, KeyboardInterrupt included), 6 a fit that did not end (killed, or still "
    "running; 5 and 6 need TrainvitalsDashboard, which records the fit's end), 2 nothing to report (or no run "
    "measured anything) or a usage error, 0 healthy and ended (or stopped again at once after a stop), "
    "4 the report could not be written. With --format json an error is a JSON object on stdout too."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LOGDIR, ``--format`` and ``--separator``, on ``parser`` (the ``trainvitals report`` subcommand's, or
    :func:`main`'s)."""
    parser.add_argument(
        "logdir", metavar="LOGDIR", help="the log folder: TensorBoard's, a CSVLogger's, or an MLflow file store"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="output format (default: text); html is one self-contained page with plots",
    )
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument(
        "--separator",
        default=LOGGER_JOIN_CHAR,
        metavar="SEP",
        help="what a logger with a prefix puts between it and a tag: its LOGGER_JOIN_CHAR "
        f"(default: {LOGGER_JOIN_CHAR!r}, Lightning's)",
    )


def run(args: argparse.Namespace) -> int:
    """Report on ``args.logdir`` in ``args.format``; returns the exit status (see the module docstring).

    On an error (nothing to report, a report that cannot be written) one line on stderr says why; with
    ``--format json`` stdout gets ``{"error": why, "exit_status": status}`` too, so a script reads it as JSON.
    """
    if not args.logdir:  # Path("") is the current folder: a variable left unset, not a choice
        return _fail(
            args, "LOGDIR is empty: give the TensorBoard log folder (the one passed to --logdir).", EXIT_NO_DATA
        )
    try:
        runs = read_runs(args.logdir, args.separator)
    except ReportError as err:
        return _fail(args, str(err), EXIT_NO_DATA)
    # A damaged run is reported even without trainvitals tags: they may be in the part not read.
    ours = [r for r in runs if r.is_trainvitals or r.damage]
    empty = [r.name for r in runs if r.is_empty]
    skipped = [r.name for r in runs if not (r.is_trainvitals or r.damage or r.is_empty)]
    if not ours:
        return _fail(args, _nothing_to_report(printable(args.logdir), empty, skipped), EXIT_NO_DATA)
    kept: list[Run] = []
    kinds: list[list[str]] = []  # each kept entry's kinds of logger
    reports = []
    for r in ours:  # the same logs as a run kept, by another kind of logger: the same fit, named with it
        first = next((i for i, k in enumerate(kept) if r.logger not in kinds[i] and same_logs(k, r)), None)
        if first is None:
            kept.append(r)
            kinds.append([r.logger])
            reports.append(assess(r))
        else:
            kinds[first].append(r.logger)
            reports[first].same_logs.append(r.name)
            reports[first].loggers = kinds[first]
    if args.format == "html":
        from trainvitals.report.html import render_html  # matplotlib: imported for this format only

        text = render_html(list(zip(kept, reports)), skipped, empty)
    else:
        text = render(reports, args.format, skipped=skipped, empty=empty)
    try:
        if args.output:
            Path(args.output).write_text(text, encoding="utf-8")
        else:
            _write(text)
    except BrokenPipeError:
        # The reader quit (head, less): the Python docs' recipe, so that the exit's flush fails quietly too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as err:
        where = printable(args.output) if args.output else "stdout"
        why = f"the report cannot be written to {where}: {err.strerror or err}."
        return _fail(args, why, EXIT_UNWRITTEN, to_stdout=bool(args.output))
    return exit_status(reports)


def _nothing_to_report(logdir: str, empty: list[str], skipped: list[str]) -> str:
    """Why the runs under ``logdir`` give nothing to report: event files that are empty, or another tool's."""
    said = []
    if empty:
        said.append(
            f"the event files of {', '.join(empty)} are empty (0 bytes): the writer had not flushed yet (a "
            "SummaryWriter flushes every 120 s by default) or the run died at once"
        )
    if skipped:
        said.append(
            f"those of {', '.join(skipped)} hold no trainvitals metrics: they come from another tool, or from a run "
            "without trainvitals callbacks"
        )
    return f"nothing to report under {logdir}: " + "; ".join(said) + "."


def _fail(args: argparse.Namespace, why: str, status: int, to_stdout: bool = True, say: bool = True) -> int:
    """``why`` on stderr (``say``), and as JSON on stdout under ``--format json`` (``to_stdout``: stdout can take
    it); returns ``status``."""
    if say:
        print(f"trainvitals report: {why}", file=sys.stderr)
    if getattr(args, "format", None) == "json" and to_stdout:
        try:
            _write(json.dumps({"error": why, "exit_status": status}) + "\n")
        except OSError:  # stdout closed or full: stderr has said why
            pass
    return status


def _write(text: str) -> None:
    """``text`` to stdout, flushed (a full disk fails here, not at exit); characters its encoding lacks (a run
    name under LANG=C) as escapes, not a traceback.

    Raises:
        OSError: when stdout is closed or cannot take the text (BrokenPipeError: the reader quit).
    """
    if sys.stdout is None:  # started with stdout closed (>&-)
        raise OSError(errno.EBADF, "stdout is closed")
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(encoding, "backslashreplace").decode(encoding))
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """``trainvitals report`` on its own command line; returns the exit status, 2 on a usage error."""
    parser = argparse.ArgumentParser(prog="trainvitals report", description=DESCRIPTION)
    add_arguments(parser)
    args = parse(parser, argv)
    return args if isinstance(args, int) else run(args)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)``, or the exit status where argparse exits: 0 after ``--help``/``--version``,
    2 on a usage error — then, under ``--format json``, also ``{"error": ..., "exit_status": 2}`` on stdout."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has written why, to `said`
        sys.stderr.write(said.getvalue())
        status = int(exit_.code or 0)
        words = list(sys.argv[1:] if argv is None else argv)
        if status and ("--format=json" in words or ("--format", "json") in zip(words, words[1:])):
            error = said.getvalue().strip().splitlines()[-1:] or ["usage error"]
            _fail(argparse.Namespace(format="json"), error[0], status, say=False)
        return status
