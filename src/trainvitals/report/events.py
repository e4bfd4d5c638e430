"""Reading a run's TensorBoard event files for ``trainvitals report``: record by record, checksums checked; and
the walk of LOGDIR that finds every run, those of other loggers' folders too (:mod:`trainvitals.report.readers`).

Every folder under LOGDIR that holds event files is a run (TensorBoard's own notion); loggers with different
prefixes (``TensorBoardLogger(prefix="train")`` logs ``train-grad_norm/total``) that wrote into one folder
are one run each. The event files are read record by record and given to TensorBoard's
``EventAccumulator``: TensorBoard's own reader stops at the first damaged record without a word, so a file
cut short or with one flipped byte would read as a shorter, healthy run. A damaged file is a
:class:`Damage`, naming the file, where the damage starts and the last step read whole before it.

File and folder names that are not UTF-8 are shown with the odd bytes escaped (``run\\xff``).
"""

from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from google.protobuf import message
from tensorboard.backend.event_processing import event_accumulator, io_wrapper
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

from trainvitals.tags import LOGGER_JOIN_CHAR, TEXT_SUFFIX, TRAINVITALS_PREFIXES, mlflow_key, split_prefix


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
        read = (
            f"read whole up to logged optimizer step {self.last_step}"
            if self.last_step is not None
            else "no logged step read before it"
        )
        where = f"at byte {self.first:,} of {self.size:,} ({self.reason}; {read})"
        if self.regions == 1 and self.first + self.lost == self.size:
            return f"{self.file} is damaged {where}: the rest of the file is not in this report."
        return (
            f"{self.file} is damaged {where}: {self.lost:,} bytes in {self.regions} stretch(es) could not be "
            "read, and what was logged in them is not in this report."
        )


@dataclass
class Run:
    """What one run's event files hold: scalars and text panels, each a list of ``(step, value)``.

    ``damage`` lists the event files read only in part; ``prefix`` is the logger's prefix taken off the
    scalar tags (``TensorBoardLogger(prefix="train")``), empty when it had none; ``layout`` whether the files
    hold a custom-scalars layout (TrainvitalsDashboard writes it at fit start, its diagnoses at fit end);
    ``empty`` names its event files of 0 bytes (a writer that has not flushed yet, or a run that died at once);
    ``folder`` is the run's folder when it was read from one (the Trainer's ``log_dir``, where TrainingGuard's
    ``skip_batches.json`` is), ``None`` for a run made at fit end from what it logged; ``side_files`` what was read
    from the files beside the event files, by file name, so that a report reads each once (``skip_batches.json``:
    the guard section, the monitor's findings and the HTML plot all need its events); ``logger`` the kind of logger
    whose files it was read from (``"TensorBoard"``, ``"CSV"``, ``"MLflow"``; ``""`` for a run not read from files):
    runs with the same logs are one fit only where different kinds wrote them (:func:`same_logs`).
    """

    name: str
    scalars: dict[str, list[tuple[int, float]]]
    texts: dict[str, list[tuple[int, str]]]
    damage: list[Damage] = field(default_factory=list)
    prefix: str = ""
    layout: bool = False
    empty: list[str] = field(default_factory=list)
    folder: Path | None = None
    side_files: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    logger: str = ""

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
    def is_empty(self) -> bool:
        """Whether every event file of the run is empty (0 bytes): nothing was written yet, by any tool."""
        return bool(self.empty) and not (self.scalars or self.texts or self.damage or self.layout)

    @property
    def is_trainvitals(self) -> bool:
        """Whether any tag is a trainvitals callback's (else the files are another tool's)."""
        return any(t.startswith(TRAINVITALS_PREFIXES) for t in [*self.scalars, *self.texts])


def same_logs(a: Run, b: Run) -> bool:
    """Whether ``a`` and ``b`` hold the same trainvitals scalars, neither damaged: the same tags, each at the same
    steps with the same values to float32's precision (TensorBoard keeps float32; a CSVLogger writes float64 as
    text) — one fit that a TensorBoardLogger and a CSVLogger both wrote, or a rerun that repeated it exactly (the
    report merges them only where different kinds of logger wrote them, :attr:`Run.logger`: two folders of one kind
    are two fits, whatever their values). The text panels too (the same panels, each with the same texts at the same
    steps: how the fit ended among them). Tags are compared as MLflow keeps them (:func:`~trainvitals.tags.mlflow_key`:
    its copy of ``(outside)`` is ``_outside_``); another tool's tags (TensorBoardLogger's ``hp_metric``) are not
    compared."""
    if a.damage or b.damage or a.prefix != b.prefix or a.layout != b.layout:
        return False
    if {mlflow_key(t): v for t, v in a.texts.items()} != {mlflow_key(t): v for t, v in b.texts.items()}:
        return False
    ours, others = ({mlflow_key(t): t for t in r.scalars if t.startswith(TRAINVITALS_PREFIXES)} for r in (a, b))
    if not ours or ours.keys() != others.keys():
        return False
    for key, tag in ours.items():
        mine, theirs = a.scalars[tag], b.scalars[others[key]]
        if len(mine) != len(theirs):
            return False
        for (step, x), (at, y) in zip(mine, theirs):
            if step != at or not (x == y or abs(x - y) <= FLOAT32_EPS * max(abs(x), abs(y)) or x != x and y != y):
                return False
    return True


FLOAT32_EPS = 2.0**-23
"""float32's relative spacing: how far one value written by two loggers can differ."""


def read_runs(logdir: str | Path, separator: str = LOGGER_JOIN_CHAR) -> list[Run]:
    """Every run under ``logdir``, in name order: one per folder holding event files, and one per logger
    prefix in a folder where loggers with different prefixes wrote (:func:`_by_prefix`); ``separator`` is
    the loggers' ``LOGGER_JOIN_CHAR``, between their prefix and a tag. A folder without event files is read by
    the first of :data:`~trainvitals.report.readers.READERS` that finds a run in it (a CSVLogger's, an MLflow
    run's), and is not walked further.

    Folders are found as TensorBoard's ``GetLogdirSubdirectories`` finds them, but with ``os.walk``, which
    takes any file name (TensorBoard's file layer fails on a name that is not UTF-8). A folder that cannot
    be listed is a run with one :class:`Damage`, so that what it may hold is not missed silently.

    Raises:
        ReportError: when ``logdir`` is missing, not a folder or cannot be listed, or holds no run.
    """
    from trainvitals.report.readers import reader_for  # the readers build Runs of this module: not at its top

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
        reader = None if events else reader_for(files, subfolders)
        if events or reader:
            folders.append((Path(folder), events, reader))
        if reader:  # its metrics and artifacts are its own, not runs
            subfolders.clear()
    if unlisted and os.fspath(unlisted[0].filename) == os.fspath(root):
        raise ReportError(f"{shown} cannot be listed: {unlisted[0].strerror}.")
    runs = []
    for folder, events, reader in sorted(folders, key=lambda found: found[0]):
        read = reader.read(folder, _run_name(root, folder)) if reader else _read_run(root, folder, events)
        read.folder = folder
        runs += _by_prefix(read, separator)
    for err in unlisted:
        name = _run_name(root, Path(os.fsdecode(err.filename)))
        runs.append(
            Run(
                name=name,
                scalars={},
                texts={},
                damage=[
                    Damage(
                        file=name + "/",
                        size=0,
                        lost=0,
                        first=0,
                        regions=1,
                        last_step=None,
                        reason=f"the folder cannot be listed ({err.strerror}): event files in it are not read",
                    )
                ],
            )
        )
    if not runs:
        raise ReportError(
            f"no TensorBoard event files (events.out.tfevents.*), CSVLogger metrics.csv or MLflow run under {shown}."
        )
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
    return Run(
        name=_run_name(root, folder),
        scalars=scalars,
        texts=texts,
        damage=damage,
        layout="custom_scalars" in plugins.values(),
        empty=[_run_name(root, Path(path)) for path in files if _is_empty(path)],
        logger="TensorBoard",
    )


def _is_empty(path: str) -> bool:
    """Whether ``path`` is a regular file of 0 bytes (one that cannot be read is a :class:`Damage`)."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == 0


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
            length |= buf[k : k + n].astype(np.uint64) << np.uint64(8 * k)
        for k in range(4):
            crc |= buf[8 + k : 8 + k + n].astype(np.uint64) << np.uint64(8 * k)
        room = np.maximum(size - base - np.arange(n, dtype=np.int64) - _HEADER.size - _CRC.size, 0).astype(np.uint64)
        for i in np.flatnonzero((length <= room) & ((length != 0) | (crc == zero))):
            if masked_crc32c(buf[i : i + 8].tobytes()) == int(crc[i]):
                return base + int(i)
    return size


def _by_prefix(run: Run, separator: str = LOGGER_JOIN_CHAR) -> list[Run]:
    """``run`` split by the prefix of its trainvitals scalars (:func:`~trainvitals.tags.split_prefix`),
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
        views.append(
            Run(
                name=name,
                scalars=scalars,
                texts=run.texts,
                damage=run.damage,
                prefix=prefix,
                layout=run.layout,
                empty=run.empty,
                folder=run.folder,
                logger=run.logger,
            )
        )
    return views


def _decode_text(proto: Any) -> str:
    try:
        array = tensor_util.make_ndarray(proto)
    except (TypeError, ValueError) as err:  # a checksummed record can still hold a malformed tensor
        return f"(a text panel TensorBoard cannot decode: {err})"
    return "\n".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))
