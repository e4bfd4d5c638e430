"""``trainvitals report LOGDIR``: a health report per run, read from TensorBoard event files.

Every folder under LOGDIR that holds event files is a run (TensorBoard's own notion); loggers with different
prefixes (``TensorBoardLogger(prefix="train")`` logs ``train-grad_norm/total``) that wrote into one folder
are one run each. The event files are read record by record and given to TensorBoard's
``EventAccumulator``: TensorBoard's own reader stops at the first damaged record without a word, so a file
cut short or with one flipped byte would read as a shorter, healthy run. Each run that holds trainvitals
metrics gets five sections — convergence, noise scale and batch size, integrity, memory, spikes and
non-finite steps — and a list of findings; a damaged event file is one of them, naming the file, where the
damage starts and the last step read whole before it.

Exit status, for CI — the most severe over the runs, in this order:

- 1: a critical finding in some run (:data:`CRITICAL_COUNTERS`), in the part of its files that was read:
  non-finite gradients (outside a GradScaler's calibration) or losses, a loss without ``grad_fn`` or that
  reaches no parameter, an optimizer stepping before the backward of its gradients, a parameter still
  unused in the last check window, a parameter outside every optimizer (unregistered: layers in a Python
  list), a computation graph kept alive across steps (GraphIntegrityCallback's counter, or
  MemoryTopologyProfiler's saved bytes still held after backward and growing);
- 3: a run read only in part, and nothing critical in what was read: an event file cut short (a run killed
  or still writing), with a record that fails its checksum or is no event, or unreadable, or a folder that
  cannot be listed; what was logged in the unread part may hold anything;
- 2: nothing to report: LOGDIR missing, no event files under it, or event files without trainvitals
  metrics (another tool's, or a run without trainvitals callbacks); a run with trainvitals panels but no
  trainvitals scalar (nothing measured: an empty train dataloader, ``max_steps=0``); also a usage error;
- 0: every run read whole and measured, no critical finding;
- 4: the report could not be written (``--output`` in a missing folder, a full disk, a closed stdout): one
  line on stderr says why. A reader that quits early (``| head``, ``less``) is no error: the status is then
  the report's own.

File and folder names that are not UTF-8 are shown with the odd bytes escaped (``run\\xff``).
No Lightning import here: the command starts in about two seconds, most of it importing torch.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import stat
import struct
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from google.protobuf import message
from tensorboard.backend.event_processing import event_accumulator, io_wrapper
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

from trainvitals._markdown import markdown_table
from trainvitals.core.estimate import DEFAULT_MAX_REL_ERR, DEFAULT_MIN_COVERAGE, MAX_UNMEASURED_TRACE, SOURCES_CHECK
from trainvitals.core.findings import INTEGRITY, critical_counters, last_window_counters
from trainvitals.core.memory import format_bytes
from trainvitals.dashboard.tags import (
    DIAGNOSIS_PREFIXES,
    LOGGER_JOIN_CHAR,
    MEMORY_BYTES,
    TEXT_SUFFIX,
    TRAINVITALS_PREFIXES,
    TRAINVITALS_ROOTS,
    grad_norm,
    split_prefix,
)
from trainvitals.dashboard.terminal import format_table, markdown_to_text

EXIT_OK, EXIT_CRITICAL, EXIT_NO_DATA, EXIT_DAMAGED, EXIT_UNWRITTEN = 0, 1, 2, 3, 4
SEVERITY = (EXIT_OK, EXIT_NO_DATA, EXIT_DAMAGED, EXIT_CRITICAL)
"""Exit statuses from the least to the most severe: the command exits with its runs' most severe."""
FORMATS = ("text", "markdown", "json", "html")

BAND_WINDOW = 10
"""Logged steps over which the fraction in the noise band is taken: one step is in it about half the
time from noise alone at a stationary point (docs/science.md §3), so a single flag says little."""

BAND_STOP = "gradient norm in its noise band"
"""How GradNormEarlyStopping's stop panel names a stop on the noise band (its ``StopReason.NOISE_BAND``)."""

SPIKES, EVENT_FILES = "spikes and non-finite steps", "event files"

CRITICAL_COUNTERS = (
    (SPIKES, grad_norm("nonfinite_steps"), "non-finite (inf/NaN) gradients on {n} optimizer step(s), outside any GradScaler"),
    *critical_counters(),
)
"""(section, tag regex, message): a counter is critical when its largest value (summed over optimizers) is > 0.

The integrity rows come from the finding kinds' table (:class:`~trainvitals.core.findings.FindingKind`).
The largest, not the last: GraphIntegrityCallback's counts are per check window, and a problem seen in
any window is a problem — except those read in the last window only (:data:`LAST_WINDOW`)."""

LAST_WINDOW = last_window_counters()
"""Counters read in the last check window only (unused parameters: a branch taken only on some batches goes
unused in one window and trains in the next)."""


class ReportError(Exception):
    """Nothing to report: the message says why, for a person (exit status 2)."""


@dataclass
class Damage:
    """An event file read only in part: where the damage starts, how much could not be read, and why.

    ``file`` is the file's path under LOGDIR (``/`` at the end: a folder that could not be listed);
    ``first`` the offset of the first damaged byte, ``lost`` the bytes not read as events over ``regions``
    damaged stretches; ``last_step`` the last step of a scalar read before the first one (the report's "last
    logged optimizer step"; text panels carry the fit's end step), ``reason`` what was wrong there.
    """

    file: str
    size: int
    lost: int
    first: int
    regions: int
    last_step: int | None
    reason: str

    def add(self, offset: int, lost: int, reason: str) -> None:
        """One more damaged stretch: ``lost`` bytes from ``offset``."""
        if not self.regions:
            self.first, self.reason = offset, reason
        self.regions += 1
        self.lost += lost

    def describe(self) -> str:
        """One sentence for a person: which file, how far it was read, what is missing."""
        if self.file.endswith("/"):
            return f"{self.file}: {self.reason}."
        if not self.size:  # never opened
            return f"{self.file}: {self.reason}, so nothing of it is in this report."
        read = (f"read whole up to logged optimizer step {self.last_step}" if self.last_step is not None
                else "no logged step read before it")
        where = f"at byte {self.first:,} of {self.size:,} ({self.reason}; {read})"
        if self.regions == 1 and self.first + self.lost == self.size:
            return f"{self.file} is damaged {where}: the rest of the file is not in this report."
        return (f"{self.file} is damaged {where}: {self.lost:,} bytes in {self.regions} stretch(es) could not be "
                "read, and what was logged in them is not in this report.")


@dataclass
class Run:
    """What one run's event files hold: scalars and text panels, each a list of ``(step, value)``.

    ``damage`` lists the event files read only in part; ``prefix`` is the logger's prefix taken off the
    scalar tags (``TensorBoardLogger(prefix="train")``), empty when it had none; ``layout`` whether the files
    hold a custom-scalars layout (TrainvitalsDashboard writes it at fit start, its diagnoses at fit end).
    """

    name: str
    scalars: dict[str, list[tuple[int, float]]]
    texts: dict[str, list[tuple[int, str]]]
    damage: list[Damage] = field(default_factory=list)
    prefix: str = ""
    layout: bool = False

    def matching(self, pattern: str) -> dict[str, list[tuple[int, float]]]:
        """The scalar series whose tag matches ``pattern`` (``re.match``, as TensorBoard matches)."""
        regex = re.compile(pattern)
        return {tag: series for tag, series in self.scalars.items() if regex.match(tag)}

    def last(self, pattern: str) -> float | None:
        """Last value of the first matching series (tags sorted), or None."""
        series = self.matching(pattern)
        return series[min(series)][-1][1] if series else None

    def text(self, tag: str) -> str | None:
        """Latest text of the panel ``tag``, or None."""
        entries = self.texts.get(tag)
        return entries[-1][1] if entries else None

    @property
    def is_trainvitals(self) -> bool:
        """Whether any tag is a trainvitals callback's (else the files are another tool's)."""
        return any(t.startswith(TRAINVITALS_PREFIXES) for t in [*self.scalars, *self.texts])


@dataclass
class Row:
    """One line of a section: a label, a value and its unit (``bytes``, ``examples``, ``steps`` or empty)."""

    label: str
    value: float | str | None
    unit: str = ""


@dataclass
class Finding:
    """A conclusion: ``critical`` fails CI, ``warning`` deserves a look, ``note`` is information."""

    severity: str
    section: str
    message: str


@dataclass
class RunReport:
    """The health report of one run."""

    run: str
    last_step: int | None
    sections: dict[str, list[Row]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    panels: dict[str, str] = field(default_factory=dict)
    """The callbacks' own end-of-run markdown (lr advice, integrity findings, memory table), by title."""
    read_in_part: bool = False
    """An event file of the run is damaged: what was logged in the part not read is not in the report."""
    measured: bool = True
    """Whether the run holds any trainvitals scalar, i.e. whether any optimizer step was measured."""

    @property
    def critical(self) -> bool:
        """Whether any finding is critical: the report's exit status is then 1."""
        return any(f.severity == "critical" for f in self.findings)

    @property
    def status(self) -> str:
        """``CRITICAL``, ``read in part``, ``nothing measured`` or ``ok``: the first that holds."""
        if self.critical:
            return "CRITICAL"
        return "read in part" if self.read_in_part else "ok" if self.measured else "nothing measured"

    @property
    def exit_status(self) -> int:
        """This run's exit status (module docstring); the command exits with the most severe of its runs."""
        return {"CRITICAL": EXIT_CRITICAL, "read in part": EXIT_DAMAGED, "nothing measured": EXIT_NO_DATA}.get(
            self.status, EXIT_OK)


# --------------------------------------------------------------------------------------------- reading
def read_runs(logdir: str | Path, separator: str = LOGGER_JOIN_CHAR) -> list[Run]:
    """Every run under ``logdir``, in name order: one per folder holding event files, and one per logger
    prefix in a folder where loggers with different prefixes wrote (:func:`_by_prefix`); ``separator`` is
    the loggers' ``LOGGER_JOIN_CHAR``, between their prefix and a tag.

    Folders are found as TensorBoard's ``GetLogdirSubdirectories`` finds them, but with ``os.walk``, which
    takes any file name (TensorBoard's file layer fails on a name that is not UTF-8). A folder that cannot
    be listed is a run with one :class:`Damage`, so that what it may hold is not missed silently.

    Raises:
        ReportError: when ``logdir`` is missing, not a folder or cannot be listed, or holds no event files.
    """
    root = Path(logdir)
    shown = printable(os.fspath(root))
    if not root.exists():
        raise ReportError(f"{shown} does not exist.")
    if not root.is_dir():
        raise ReportError(f"{shown} is not a folder: give the TensorBoard log folder (the one passed to --logdir).")
    unlisted: list[OSError] = []
    folders, seen = [], set()
    for folder, subfolders, files in os.walk(root, onerror=unlisted.append, followlinks=True):
        try:
            info = os.stat(folder)
        except OSError as err:
            unlisted.append(err)
            continue
        if (info.st_dev, info.st_ino) in seen:  # a link back up the tree
            subfolders.clear()
            continue
        seen.add((info.st_dev, info.st_ino))
        events = sorted(os.path.join(folder, name) for name in files if io_wrapper.IsSummaryEventsFile(name))
        if events:
            folders.append((Path(folder), events))
    if unlisted and os.fspath(unlisted[0].filename) == os.fspath(root):
        raise ReportError(f"{shown} cannot be listed: {unlisted[0].strerror}.")
    runs = [view for folder, events in sorted(folders) for view in _by_prefix(_read_run(root, folder, events), separator)]
    for err in unlisted:
        name = _run_name(root, Path(os.fsdecode(err.filename)))
        runs.append(Run(name=name, scalars={}, texts={}, damage=[Damage(
            file=name + "/", size=0, lost=0, first=0, regions=1, last_step=None,
            reason=f"the folder cannot be listed ({err.strerror}): event files in it are not read")]))
    if not runs:
        raise ReportError(f"no TensorBoard event files (events.out.tfevents.*) under {shown}.")
    return runs


def _read_run(root: Path, folder: Path, files: list[str]) -> Run:
    """The run in ``folder``: its event ``files`` (paths), read in name order as TensorBoard's
    ``DirectoryWatcher`` reads them, by one accumulator (a resumed run's restart purges what it orphaned)."""
    # 0 keeps every event: a report needs the whole history, not TensorBoard's sampled reservoir.
    acc = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    damage = [d for path in files if (d := _read_events(path, _run_name(root, Path(path)), acc))]
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags[event_accumulator.SCALARS]}
    texts = {}
    plugins = {tag: acc.SummaryMetadata(tag).plugin_data.plugin_name for tag in tags[event_accumulator.TENSORS]}
    for tag, plugin in plugins.items():
        if plugin != "text":
            continue
        name = tag[: -len(TEXT_SUFFIX)] if tag.endswith(TEXT_SUFFIX) else tag
        texts[name] = [(e.step, _decode_text(e.tensor_proto)) for e in acc.Tensors(tag)]
    return Run(name=_run_name(root, folder), scalars=scalars, texts=texts, damage=damage,
               layout="custom_scalars" in plugins.values())


def _run_name(root: Path, path: Path) -> str:
    # A LOGDIR that is itself the run folder is named after that folder, not ".".
    return printable(path.relative_to(root).as_posix() if path != root else root.resolve().name)


def printable(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (``os.fsdecode``'s surrogates) written as ``\\xff``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_CUT = "the file ends inside a record: cut short, or still being written"


def _read_events(path: str, name: str, acc: event_accumulator.EventAccumulator) -> Damage | None:
    """Feed the events of the file ``path`` to ``acc``; the damage found, or None when it read whole.

    An event file is a sequence of TFRecords: length (u64), masked crc32c of the length, data, masked
    crc32c of the data. TensorBoard's reader stops at the first record that fails a check and says
    nothing (``RawEventFileLoader.Load`` swallows ``DataLossError``). Here a record whose data fails its
    checksum, or is no event, is skipped (its length was checked); after a length that fails its
    checksum, reading goes on at the next offset where a length passes its own.
    """
    found = Damage(file=name, size=0, lost=0, first=-1, regions=0, last_step=None, reason="")
    offset = 0
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the report until someone writes
            found.add(0, 0, "not a regular file")
            return found
        with open(path, "rb") as f:
            size = found.size = os.fstat(f.fileno()).st_size
            while offset < size:
                header = f.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    found.add(offset, size - offset, _CUT)
                    break
                length, crc = _HEADER.unpack(header)
                if masked_crc32c(header[:8]) != crc:
                    resume = _next_record(f, offset + 1, size)
                    found.add(offset, resume - offset, "a record's length fails its checksum")
                    offset = resume
                    f.seek(offset)
                    continue
                end = offset + _HEADER.size + length + _CRC.size
                if end > size:
                    found.add(offset, size - offset, _CUT)
                    break
                data, crc = f.read(length), f.read(_CRC.size)
                if len(crc) < _CRC.size:  # the file shrank while being read
                    found.add(offset, size - offset, _CUT)
                    break
                if masked_crc32c(data) != _CRC.unpack(crc)[0]:
                    problem = "a record's data fails its checksum"
                else:
                    problem = _feed(acc, data, found)
                if problem:
                    found.add(offset, end - offset, problem)
                offset = end
    except OSError as err:
        found.add(offset, found.size - offset, f"the file cannot be read ({err.strerror or err})")
    return found if found.regions else None


def _feed(acc: event_accumulator.EventAccumulator, data: bytes, found: Damage) -> str | None:
    """Give one record to ``acc``; what is wrong with it, or None."""
    try:
        event = event_pb2.Event.FromString(data)
    except message.DecodeError:
        return "a record that is no TensorBoard event"
    try:
        # The accumulator's entry point for one event: its Reload() reads files through TensorBoard's
        # own reader, which would stop silently at the first damaged record.
        acc._ProcessEvent(event)
    except Exception as err:  # a checksummed record can still hold values TensorBoard rejects
        return f"an event TensorBoard cannot take ({type(err).__name__})"
    if found.regions == 0 and any(v.HasField("simple_value") for v in event.summary.value):
        found.last_step = event.step
    return None


def _next_record(f: BinaryIO, start: int, size: int) -> int:
    """The first offset from ``start`` where 12 bytes are a length that fits in the rest of the file and its
    valid checksum; ``size`` if none.

    Only offsets whose length fits (and, for a length of 0, whose checksum is that of 0) are checksummed, the
    test done on whole chunks at once: zeros or junk after a crash are skipped at the speed of reading them.
    """
    chunk = 1 << 20
    zero = masked_crc32c(bytes(8))
    for base in range(start, size, chunk):
        f.seek(base)
        buf = np.frombuffer(f.read(chunk + _HEADER.size - 1), dtype=np.uint8)
        n = len(buf) - _HEADER.size + 1
        if n <= 0:
            break
        length, crc = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        for k in range(8):
            length |= buf[k:k + n].astype(np.uint64) << np.uint64(8 * k)
        for k in range(4):
            crc |= buf[8 + k:8 + k + n].astype(np.uint64) << np.uint64(8 * k)
        room = np.maximum(size - base - np.arange(n, dtype=np.int64) - _HEADER.size - _CRC.size, 0).astype(np.uint64)
        for i in np.flatnonzero((length <= room) & ((length != 0) | (crc == zero))):
            if masked_crc32c(buf[i:i + 8].tobytes()) == int(crc[i]):
                return base + int(i)
    return size


def _by_prefix(run: Run, separator: str = LOGGER_JOIN_CHAR) -> list[Run]:
    """``run`` split by the prefix of its trainvitals scalars (:func:`~trainvitals.dashboard.tags.split_prefix`),
    the prefix taken off: one run per logger when loggers with different prefixes write to one folder.

    Every trainvitals callback writes to every logger, so the loggers' series are copies that must not be
    summed. Text panels carry no prefix: each run gets them all.
    """
    split = {tag: split_prefix(tag, separator) for tag in run.scalars}
    prefixes = sorted({prefix for prefix, key in split.values() if key.startswith(TRAINVITALS_PREFIXES)})
    if prefixes in ([], [""]):
        return [run]

    def owner(tag: str) -> str | None:
        """The prefix whose run holds ``tag``: its own, else the longest that starts it (``train-epoch``)."""
        prefix, key = split[tag]
        if key.startswith(TRAINVITALS_PREFIXES):
            return prefix
        starts = [p for p in prefixes if p and tag.startswith(p + separator)]
        return max(starts, key=len) if starts else ("" if "" in prefixes else None)

    views = []
    for prefix in prefixes:
        cut = len(prefix) + len(separator) if prefix else 0
        scalars = {tag[cut:]: series for tag, series in run.scalars.items() if owner(tag) == prefix}
        name = f"{run.name} (prefix {prefix})" if prefix else f"{run.name} (no prefix)"
        views.append(Run(name=name, scalars=scalars, texts=run.texts, damage=run.damage, prefix=prefix,
                         layout=run.layout))
    return views


def _decode_text(proto: Any) -> str:
    try:
        array = tensor_util.make_ndarray(proto)
    except (TypeError, ValueError) as err:  # a checksummed record can still hold a malformed tensor
        return f"(a text panel TensorBoard cannot decode: {err})"
    return "\n".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))


# ------------------------------------------------------------------------------------------- assessing
def assess(run: Run) -> RunReport:
    """The health report of ``run``: one section per vital sign, and the findings that follow."""
    steps = [s for series in run.scalars.values() for s, _ in series]
    report = RunReport(run=run.name, last_step=max(steps) if steps else None, read_in_part=bool(run.damage),
                       measured=any(tag.startswith(TRAINVITALS_PREFIXES) for tag in run.scalars))
    report.findings += [Finding("warning", EVENT_FILES, d.describe()) for d in run.damage]
    if not report.measured:
        report.findings.append(Finding(
            "warning", EVENT_FILES, "nothing measured: no trainvitals scalar" + (" in the part read" if run.damage else "")
            + ", so no optimizer step was logged — an empty train dataloader (limit_train_batches=0), max_steps=0, "
            "or step logging off (log_every_n_steps=0). Nothing here says whether the run trained or is healthy."
            + _separator_hint(run)))
    if report.measured and run.layout and not any(tag.startswith(DIAGNOSIS_PREFIXES) for tag in run.texts):
        report.findings.append(Finding(
            "warning", EVENT_FILES, "no end-of-fit diagnosis: TrainvitalsDashboard wrote its layout at fit start but "
            "no diagnosis panel at fit end, so the fit is still running, was killed or crashed, or an event file "
            "was cut at a record's end (which its format cannot tell); whatever came after is not in this report."))
    for section in (_convergence, _noise_scale, _integrity, _memory, _spikes):
        section(run, report)
    for title, pattern, message in CRITICAL_COUNTERS:
        n = _counter(run, pattern, last=pattern in LAST_WINDOW)
        if n > 0:
            report.findings.append(Finding("critical", title, message.format(n=f"{n:g}")))
    if (since := _uncounted_since(run)) is not None:
        report.findings.append(Finding(
            "critical", SPIKES, f"GradNormEarlyStopping counted none of the optimizer steps after step {since}: "
            "each had non-finite (inf/NaN) gradients (or a GradScaler skipped it), the run diverged"))
    return report


_OTHER_SEPARATOR = re.compile(rf"^.*?\w(\W+)(?:{'|'.join(TRAINVITALS_ROOTS)})/")


def _separator_hint(run: Run) -> str:
    """When scalars look like a prefixed logger's trainvitals tags under another separator, which one."""
    for tag in sorted(run.scalars):
        if match := _OTHER_SEPARATOR.match(tag):
            return (f" But scalars such as `{tag}` look like a logger's prefixed ones: give its separator with "
                    f"--separator {match.group(1)!r}.")
    return ""


def _panel(run: Run, report: RunReport, title: str, tag: str) -> None:
    """Pass a callback's end-of-run markdown (the text panel ``tag``) through to the report, if logged."""
    text = run.text(tag)
    if text:
        report.panels[title] = text


def _counter(run: Run, pattern: str, last: bool = False) -> float:
    """A counter's largest (``last``: last) finite value, summed over the series that match (one per optimizer)."""
    values = [[v for _, v in series if math.isfinite(v)] for series in run.matching(pattern).values()]
    return sum((v[-1] if last else max(v)) for v in values if v)


def _diverged(run: Run) -> bool:
    """Whether the run ended diverged. With GradNormMonitor's series: (nearly) every step after its last
    finite norm was non-finite — counted as non-finite, or under a GradScaler as skipped (at least two:
    one skip is calibration). A NaN the run trained on from is not the end. A non-finite loss makes the
    gradient non-finite too, so the loss counter decides only without the monitor: GraphIntegrityCallback
    logs it when a check window closes, which says nothing of when the loss was non-finite. Without both,
    GradNormEarlyStopping's streak standing still at the end (:func:`_uncounted_since`): its band flag is then
    the last one of before, and says nothing either."""
    finite = [step for series in run.matching(grad_norm("total")).values() for step, v in series if math.isfinite(v)]
    counters = {1: run.matching(grad_norm("nonfinite_steps")), 2: run.matching(grad_norm("amp_skipped_steps"))}
    if not (finite or counters[1] or counters[2]):
        return _counter(run, r"graph/nonfinite_losses$") > 0 or _uncounted_since(run) is not None
    since = max(finite, default=-1)
    return any(_rose_every_step(series, since, least) for least, matching in counters.items()
               for series in matching.values())


def _uncounted_since(run: Run) -> int | None:
    """The logged step after which GradNormEarlyStopping counted no step, when that holds for (at least
    two) steps at the end and neither GradNormMonitor nor GraphIntegrityCallback tells non-finite steps.

    A step it counts adds one to its streak or resets it to 0: a streak ``n > 0`` logged again as ``n``
    at most ``n`` steps later means no step in between was counted — each had a non-finite gradient (or
    was skipped by a GradScaler), and the band flag and noise estimates logged meanwhile are from before.
    """
    if run.matching(grad_norm("total")) or run.matching(grad_norm("nonfinite_steps")) or \
            _counter(run, r"graph/nonfinite_losses$") > 0:
        return None
    for series in run.matching(grad_norm("band_streak")).values():
        last, n = series[-1]
        since = last
        for step, count in reversed(series[:-1]):
            if count != n or since - step > n:
                break
            since = step
        if n > 0 and last - since >= 2:
            return since
    return None


def _rose_every_step(series: list[tuple[int, float]], since: int, least: int) -> bool:
    """A step counter rose by at least ``least`` and by (nearly) every step logged after ``since``, or by
    every step of its last logged interval after ``since``: a NaN that began between two logging steps
    leaves the first interval after the last finite norm only partly non-finite."""
    before = max((count for step, count in series if step <= since), default=0.0)
    step, count = series[-1]
    if step <= since:
        return False
    if count - before >= max(least, step - since - 1):
        return True
    if len(series) < 2:
        return False
    previous, then = series[-2]
    return previous >= since and count - then >= max(least, step - previous)


def _convergence(run: Run, report: RunReport) -> None:
    title = "convergence"
    # Like with like: a partly measured model's floor is set against the norm of the measured parameters.
    total = run.last(grad_norm("measured_total"))
    total = run.last(grad_norm("total")) if total is None else total
    floor = run.last(grad_norm("noise_floor"))  # the run's one floor (core/estimate.py)
    floor_se = run.last(grad_norm("noise_floor_se"))
    partial = _partial(run)
    band = run.matching(grad_norm("in_noise_band"))
    recent = [v for _, v in band[min(band)][-BAND_WINDOW:]] if band else []
    in_band = sum(recent) / len(recent) if recent else None
    stop = run.text("grad_norm/stop_reason")
    report.sections[title] = [
        Row("gradient norm, last", total),
        Row("noise floor sqrt(tr Σ/B), last", floor),
        Row("noise floor standard error", floor_se),
        Row("norm / noise floor", total / floor if total is not None and floor else None),
        Row(f"fraction in the noise band, last {len(recent)} logged steps", in_band),
        Row("stop", stop),
    ]
    if stop:
        report.findings.append(Finding("note", title, stop))
    caveat = run.text("grad_noise/caveat")
    if caveat:
        report.findings.append(Finding("note", title, caveat.removeprefix("trainvitals GradNormEarlyStopping: ")))
    error = (f" (noise floor ± {100 * floor_se / floor:.2g}%)" if floor and floor_se is not None and math.isfinite(floor_se)
             else "")
    if _diverged(run):
        report.findings.append(Finding(
            "note", title, "the run diverged (non-finite gradients or losses): the last finite gradient norm and "
            "the noise estimates come from before, so they say nothing of convergence."))
    elif partial:
        report.findings.append(Finding("note", title, f"{partial}: no noise-band verdict on the whole model."))
    elif in_band is None:
        if total is not None and floor:
            report.findings.append(Finding(
                "note", title, f"the last gradient norm is {total / floor:.2f}× its noise floor{error}; GradNormEarlyStopping "
                "would log whether the run is in its noise band."))
        elif total is not None:
            report.findings.append(Finding(
                "note", title, "no noise estimate, so no noise band: it needs accumulate_grad_batches >= 2, "
                ">= 2 devices, or a BatchVarianceProbe; a fixed norm threshold is no substitute."))
    elif stop and BAND_STOP in stop:  # every step of its patience was in the band; the logged flags sample a few
        report.findings.append(Finding(
            "note", title, f"in its noise band: GradNormEarlyStopping stopped the run on it{error}; the band flags "
            f"logged meanwhile ({in_band:.0%} of the last {len(recent)}) sample single steps."))
    elif in_band >= 0.5:
        report.findings.append(Finding(
            "note", title, f"in its noise band ({in_band:.0%} of the last {len(recent)} logged steps){error}: "
            "the gradient norm sits at its noise floor, further steps mostly move within noise."))
    else:
        ratio = total / floor if total is not None and floor else None
        said = f" (the last norm is {ratio:.2f}× the noise floor)" if ratio is not None else ""
        why = ("the band is decided on the smoothed estimates, not on one norm" if ratio is not None and ratio <= 1
               else "the true gradient still stands out of the noise")
        report.findings.append(Finding(
            "note", title, f"not in its noise band yet: {in_band:.0%} of the last {len(recent)} logged steps were in it{said}{error}; "
            f"{why}."))


def _partial(run: Run) -> str:
    """"partial: …" when the run's noise estimate covered too little of ‖ḡ‖² to decide; else ""."""
    coverage = run.last(r"grad_noise/coverage$")
    unmeasured = run.last(r"grad_noise/unmeasured_trace_share$")
    if coverage is not None and coverage < DEFAULT_MIN_COVERAGE:
        return f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖² (a decision needs {DEFAULT_MIN_COVERAGE:.0%})"
    if coverage is not None and unmeasured is not None and not unmeasured <= MAX_UNMEASURED_TRACE:
        return (f"partial: the noise estimate covers {coverage:.0%} of ‖ḡ‖², but the unmeasured parameters may hold up "
                f"to {unmeasured:.2g}× the measured tr Σ (a decision needs ≤ {MAX_UNMEASURED_TRACE:g})")
    return ""


def _noise_scale(run: Run, report: RunReport) -> None:
    title = "noise scale and batch size"
    b_simple = run.last(r"grad_noise/b_simple$")  # the run's one B_simple (core/estimate.py)
    rel_err = run.last(r"grad_noise/b_simple_rel_err$")
    unreliable = run.last(r"grad_noise/b_simple_unreliable$")
    coverage = run.last(r"grad_noise/coverage$")
    batch = run.last(r"lr_scaling/effective_batch$")
    rows = [Row("B_simple = tr Σ / ‖G‖²", b_simple, "examples"), Row("B_simple relative error", rel_err),
            Row("share of ‖ḡ‖² measured", coverage), Row("effective batch B", batch, "examples")]
    rows += [Row(tag.removeprefix("lr_scaling/"), series[-1][1]) for tag, series in sorted(run.matching(
        r"lr_scaling/(?!effective_batch$).+").items())]
    report.sections[title] = rows
    checked = run.text(SOURCES_CHECK)
    if checked:  # said once by the callbacks: a noise source dropped, or two that disagree
        report.findings.append(Finding("warning", title, f"noise sources: {checked}."))
    partial = _partial(run)
    if b_simple is not None and partial:
        report.findings.append(Finding("note", title, f"{partial}: no batch-size verdict, and no noise-aware lr advice."))
    elif b_simple is not None and (unreliable == 1 or rel_err is not None and not rel_err <= DEFAULT_MAX_REL_ERR):
        what = f"relative error {rel_err:.2g}" if rel_err is not None and math.isfinite(rel_err) else (
            "no finite error bar: too few measurements, or ‖G‖² not resolved from zero")
        report.findings.append(Finding(
            "note", title, f"B_simple = {b_simple:.3g} is unreliable ({what}): no batch-size verdict; the lr advice "
            "follows the classic rules."))
    elif b_simple is not None and batch and math.isfinite(b_simple):
        spread = f" (± {100 * rel_err:.2g}%)" if rel_err is not None else " (its error was not logged)"
        if batch < b_simple:
            message = (f"B = {batch:g} < B_simple = {b_simple:.3g}{spread}: each step is noise-dominated; a batch near "
                       "B_simple balances steps against examples.")
        else:
            message = (f"B = {batch:g} >= B_simple = {b_simple:.3g}{spread}: beyond the noise scale a larger batch buys "
                       "few steps for its examples.")
        report.findings.append(Finding("note", title, message))
    if _diverged(run) and run.matching(r"lr_scaling/"):
        report.findings.append(Finding(
            "note", title, "the run diverged: find the cause (or lower the lr) before following any lr-scaling advice."))
    _panel(run, report, "lr scaling advice", "lr_scaling/advice")


def _integrity(run: Run, report: RunReport) -> None:
    title = INTEGRITY
    # The per-kind finding counts (graph/findings_<kind>) are left to the findings panel.
    report.sections[title] = [Row(tag.removeprefix("graph/"), series[-1][1])
                              for tag, series in sorted(run.matching(r"graph/(?!findings_).+").items())]
    _panel(run, report, "integrity findings", "graph/findings")


def _memory(run: Run, report: RunReport) -> None:
    title = "memory"
    categories = sorted(((series[-1][1], tag.removeprefix("memory/").removesuffix("_bytes"))
                         for tag, series in run.matching(MEMORY_BYTES).items()), reverse=True)
    rows = [Row(category.replace("_", " "), value, "bytes") for value, category in categories]
    per_module = sorted(((series[-1][1], tag.removeprefix("memory/activations/"))
                         for tag, series in run.matching(r"memory/activations/.+").items()), reverse=True)
    rows += [Row(f"saved by {module}", value, "bytes") for value, module in per_module[:5]]
    report.sections[title] = rows
    _panel(run, report, "memory table", "memory/report")
    held = [v for _, v in run.scalars.get("memory/held_saved_bytes", [])]
    if len(held) >= 2 and held[-1] > held[-2] > 0:
        report.findings.append(Finding(
            "critical", title, f"a computation graph outlives its step: {format_bytes(held[-1])} of saved tensors "
            f"still held after backward, up from {format_bytes(held[-2])} at the previous profiled step "
            "(total += loss, a hidden state not detached, retain_graph=True)"))


def _spikes(run: Run, report: RunReport) -> None:
    title = SPIKES
    names = [n for n in ("nonfinite_steps", "amp_skipped_steps", "spike_steps") if run.matching(grad_norm(n))]
    counters = {name: _counter(run, grad_norm(name)) for name in names}
    report.sections[title] = [Row(name.replace("_", " "), value, "steps") for name, value in counters.items()]
    if counters.get("amp_skipped_steps", 0) > 0:
        report.findings.append(Finding(
            "note", title, f"the GradScaler skipped {counters['amp_skipped_steps']:g} step(s) with inf/NaN "
            "gradients and lowered its scale: loss-scale calibration, not divergence."))
    if counters.get("spike_steps", 0) > 0:
        latest = next((run.text(t) for t in sorted(run.texts) if re.match(grad_norm("spikes"), t)), None)
        report.findings.append(Finding(
            "warning", title, f"{counters['spike_steps']:g} gradient-norm spike(s)" + (f"; latest: {latest}" if latest else "")))


# ------------------------------------------------------------------------------------------- rendering
def render(reports: Sequence[RunReport], fmt: str, skipped: Sequence[str] = ()) -> str:
    """The reports as ``text``, ``markdown`` or ``json``; ``skipped`` names runs without trainvitals data.

    ``html`` needs the runs' series for its plots: :func:`trainvitals.dashboard.html.render_html`."""
    if fmt == "json":
        return json.dumps(_json_safe({
            "critical": any(r.critical for r in reports),
            "runs": [{**asdict(r), "critical": r.critical, "status": r.status} for r in reports],
            "skipped_runs": list(skipped),
        }), indent=2, allow_nan=False) + "\n"
    render_run = _markdown_run if fmt == "markdown" else _text_run
    out = [line for r in reports for line in render_run(r)]
    if skipped:
        out.append(f"runs without trainvitals metrics, not reported: {', '.join(skipped)}")
    return "\n".join(out).rstrip() + "\n"


def _status(r: RunReport) -> str:
    step = f", last logged optimizer step {r.last_step}" if r.last_step is not None else ""
    return r.status + step


def _markdown_run(r: RunReport) -> list[str]:
    """One run in markdown: the findings first, a table per section, the callbacks' panels as they wrote them."""
    out = [f"## run `{r.run}`: {_status(r)}"]
    if r.findings:
        out += ["", "### findings", ""] + [f"- **{f.severity}** ({f.section}): {f.message}" for f in r.findings]
    for title, rows in r.sections.items():
        if rows:
            out += ["", f"### {title}", "", *markdown_table(("measure", "value"), [(row.label, _fmt(row)) for row in rows])]
    for title, text in r.panels.items():
        out += ["", f"### {title}", "", text]
    return out + [""]


def _text_run(r: RunReport) -> list[str]:
    """One run for a terminal: the findings first, then aligned sections, then the panels as plain text."""
    out = [f"run {r.run}: {_status(r)}"]
    if r.findings:
        out += ["", "  findings"] + [f"    [{f.severity}] {f.section}: {f.message}" for f in r.findings]
    for title, rows in r.sections.items():
        if rows:
            out += ["", f"  {title}"] + format_table([[row.label, _fmt(row)] for row in rows], indent="    ")
    for title, text in r.panels.items():
        out += ["", f"  {title}", textwrap.indent(markdown_to_text(text), "    ")]
    return out + [""]


def _json_safe(obj: Any) -> Any:
    """``inf``/``nan`` (B_simple when ‖G‖² ≤ 0) as the strings ``"inf"``/``"nan"``: JSON has no such numbers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt(row: Row) -> str:
    v = row.value
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if row.unit == "bytes":
        return format_bytes(v)
    text = f"{v:.4g}"
    return f"{text} {row.unit}" if row.unit else text


# ---------------------------------------------------------------------------------------------- command
DESCRIPTION = ("Health report of the training runs under LOGDIR, read from their TensorBoard event files. "
               "Exit status: 0 healthy, 1 a critical finding, 3 an event file read only in part, "
               "2 nothing to report (or nothing measured) or a usage error, 4 the report could not be written.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LOGDIR, ``--format`` and ``--separator``, on ``parser`` (the ``trainvitals report`` subcommand's, or
    :func:`main`'s)."""
    parser.add_argument("logdir", metavar="LOGDIR", help="the TensorBoard log folder")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="output format (default: text); html is one self-contained page with plots")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--separator", default=LOGGER_JOIN_CHAR, metavar="SEP",
                        help="what a logger with a prefix puts between it and a tag: its LOGGER_JOIN_CHAR "
                             f"(default: {LOGGER_JOIN_CHAR!r}, Lightning's)")


def run(args: argparse.Namespace) -> int:
    """Report on ``args.logdir`` in ``args.format``; returns the exit status (see the module docstring)."""
    if not args.logdir:  # Path("") is the current folder: a variable left unset, not a choice
        print("trainvitals report: LOGDIR is empty: give the TensorBoard log folder (the one passed to --logdir).",
              file=sys.stderr)
        return EXIT_NO_DATA
    try:
        runs = read_runs(args.logdir, args.separator)
    except ReportError as err:
        print(f"trainvitals report: {err}", file=sys.stderr)
        return EXIT_NO_DATA
    # A damaged run is reported even without trainvitals tags: they may be in the part not read.
    ours = [r for r in runs if r.is_trainvitals or r.damage]
    skipped = [r.name for r in runs if not (r.is_trainvitals or r.damage)]
    if not ours:
        print(f"trainvitals report: the event files under {printable(args.logdir)} ({len(runs)} run(s)) hold no "
              "trainvitals metrics: they come from another tool, or from a run without trainvitals callbacks.",
              file=sys.stderr)
        return EXIT_NO_DATA
    reports = [assess(r) for r in ours]
    if args.format == "html":
        from trainvitals.dashboard.html import render_html  # matplotlib: imported for this format only

        text = render_html(list(zip(ours, reports)), skipped)
    else:
        text = render(reports, args.format, skipped=skipped)
    status = max((r.exit_status for r in reports), key=SEVERITY.index)
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
        print(f"trainvitals report: the report cannot be written to {where}: {err.strerror or err}.", file=sys.stderr)
        return EXIT_UNWRITTEN
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2): argparse has printed why
        return int(exit_.code or 0)
    return run(args)
