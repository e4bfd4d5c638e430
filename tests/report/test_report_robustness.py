"""``trainvitals report`` on logs as a long run leaves them: damaged event files, odd file names, logger
prefixes and folders, a run that trained nothing, one that went NaN with only the stopper attached.

Damaged files are checked against TensorBoard's own reader, which stops silently at the first damaged
record: what it yields is what the report must say it read whole.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from test_report import HEALTHY, STEPS, report, report_json, write_run
from torch.utils.tensorboard import SummaryWriter

from trainvitals.report.command import (
    EXIT_CRITICAL,
    EXIT_DAMAGED,
    EXIT_NO_DATA,
    EXIT_OK,
    EXIT_UNFINISHED,
    EXIT_UNWRITTEN,
    main,
    read_runs,
)
from trainvitals.tags import DIAGNOSIS_TAG, grad_norm, split_prefix, with_prefix

# A run that went NaN for good at step 85: critical (non-finite gradients), whatever else.
DIVERGED = {
    **HEALTHY,
    "grad_norm/total": HEALTHY["grad_norm/total"][:-3] + [math.nan] * 3,
    "grad_norm/nonfinite_steps": [0.0] * (len(STEPS) - 3) + [5.0, 10.0, 15.0],
}


def event_file(folder: Path) -> Path:
    (path,) = folder.glob("events.out.tfevents.*")
    return path


def records(data: bytes) -> list[tuple[int, int]]:
    """(offset, end) of each TFRecord of an intact file, from the lengths alone."""
    spans, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        spans.append((offset, offset + 12 + length + 4))
        offset += 12 + length + 4
    assert offset == len(data)
    return spans


def tensorboard_last_step(path: Path) -> int | None:
    """The last step of a scalar TensorBoard's own loader yields before it stops."""
    steps = [
        e.step
        for e in LegacyEventFileLoader(str(path)).Load()
        if any(v.HasField("simple_value") for v in e.summary.value)
    ]
    return steps[-1] if steps else None


def framed(data: bytes) -> bytes:
    """``data`` as one valid TFRecord."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def damage_findings(run: dict) -> list[str]:
    return [f["message"] for f in run["findings"] if f["section"] == "event files"]


@pytest.fixture(scope="module")
def diverged_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    folder = tmp_path_factory.mktemp("diverged") / "run"
    write_run(folder, DIVERGED)
    return event_file(folder).read_bytes()


# ------------------------------------------------------------------------------------------ damaged files
def test_a_flipped_byte_skips_one_record_and_reads_on(tmp_path: Path, capsys, diverged_file: bytes) -> None:
    """The record's length passed its checksum, so the record is skipped and the NaN after it still found."""
    spans = records(diverged_file)
    start, end = spans[len(spans) // 3]
    damaged = bytearray(diverged_file)
    damaged[start + 14] ^= 0x40  # in the record's data
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "events.out.tfevents.1.host"
    path.write_bytes(bytes(damaged))
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL  # the non-finite steps after the damage are read
    (run,) = doc["runs"]
    assert run["status"] == "CRITICAL" and run["read_in_part"] is True and run["last_step"] == STEPS[-1]
    (message,) = damage_findings(run)
    assert message.startswith(
        f"run/{path.name} is damaged at byte {start:,} of {len(damaged):,} "
        f"(a record's data fails its checksum; read whole up to logged optimizer step {tensorboard_last_step(path)})"
    )
    assert f"{end - start:,} bytes in 1 stretch(es) could not be read" in message


def test_a_flipped_length_reads_on_at_the_next_record(tmp_path: Path, capsys, diverged_file: bytes) -> None:
    spans = records(diverged_file)
    start, end = spans[len(spans) // 2]
    damaged = bytearray(diverged_file)
    damaged[start + 2] ^= 0x01  # in the record's length
    path = tmp_path / "events.out.tfevents.1.host"
    path.write_bytes(bytes(damaged))
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    (message,) = damage_findings(doc["runs"][0])
    assert f"at byte {start:,} of {len(damaged):,} (a record's length fails its checksum;" in message
    assert f"{end - start:,} bytes in 1 stretch(es)" in message


def test_a_truncated_file_is_read_in_part_never_ok(tmp_path: Path, capsys, diverged_file: bytes) -> None:
    """Cut in the middle of a record before the NaN: nothing critical is left, and the report says why."""
    spans = records(diverged_file)
    start, end = spans[len(spans) // 2]
    path = tmp_path / "run" / "events.out.tfevents.1.host"
    path.parent.mkdir()
    path.write_bytes(diverged_file[: (start + end) // 2])
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_DAMAGED
    last = tensorboard_last_step(path)
    assert last is not None and last < STEPS[-1]
    assert text.startswith(f"run run: read in part, last logged optimizer step {last}\n")
    assert (
        f"[warning] event files: run/{path.name} is damaged at byte {start:,} of {(start + end) // 2:,} "
        f"(the file ends inside a record: cut short, or still being written; read whole up to logged optimizer step {last}): "
        "the rest of the file is not in this report."
    ) in text


def test_a_damaged_run_is_reported_even_without_trainvitals_tags(tmp_path: Path, capsys) -> None:
    """A file that is no TFRecord at all: whatever it held may have been trainvitals', so it is not skipped."""
    (tmp_path / "events.out.tfevents.123.host").write_bytes(b"not a TFRecord at all" * 50)
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_DAMAGED
    assert "events.out.tfevents.123.host is damaged at byte 0 of 1,050 (" in text
    assert "no logged step read before it" in text and "nothing measured" in text


def test_a_resumed_run_reads_the_files_after_a_damaged_one(tmp_path: Path, capsys, diverged_file: bytes) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "events.out.tfevents.1.host").write_bytes(diverged_file[: len(diverged_file) // 3])
    writer = SummaryWriter(str(folder), filename_suffix=".resumed")
    writer.add_scalar("grad_norm/nonfinite_steps", 20.0, 100)
    writer.close()
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL and doc["runs"][0]["last_step"] == 100
    assert len(damage_findings(doc["runs"][0])) == 1


def test_critical_beats_damaged_beats_nothing_measured(tmp_path: Path, capsys, diverged_file: bytes) -> None:
    write_run(tmp_path / "a_healthy", HEALTHY)
    write_run(tmp_path / "b_empty", {}, {"diagnosis/GradNormMonitor": "No optimizer step was measured."})
    assert report(capsys, str(tmp_path))[0] == EXIT_OK  # nothing measured counts only when no run measured
    write_run(tmp_path / "c_cut", HEALTHY)
    cut = event_file(tmp_path / "c_cut")
    cut.write_bytes(cut.read_bytes()[:-3])
    assert report(capsys, str(tmp_path))[0] == EXIT_DAMAGED
    write_run(tmp_path / "d_nan", DIVERGED)
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    assert [r["status"] for r in doc["runs"]] == ["ok", "nothing measured", "read in part", "CRITICAL"]


def _mutations() -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
        st.tuples(st.just("record"), st.floats(0, 1), st.binary(max_size=64)),
        st.tuples(st.just("bytes"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    )


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_fuzz_damaged_event_files_never_read_as_healthy(mutation: tuple, diverged_file: bytes) -> None:
    """Truncations, flipped bytes, random records and random bytes: never a traceback, and every change
    TensorBoard's format can tell is named; only a cut at a record's end leaves a shorter, valid file."""
    kind, where, *args = mutation
    data, spans = bytearray(diverged_file), records(diverged_file)
    at = int(where * (len(data) - 1))
    boundary = min((end for _, end in spans if end >= at), default=len(data))
    if kind == "truncate":
        data = data[:at]
        visible = at not in {0, *(end for _, end in spans)}
    elif kind == "flip":
        data[at] ^= args[0]
        visible = True
    elif kind == "record":
        data[boundary:boundary] = framed(args[0])
        visible = None  # a checksummed record of random bytes may well decode as an event
    else:
        data[boundary:boundary] = args[0]
        visible = True
    with tempfile.TemporaryDirectory() as logdir:
        Path(logdir, "events.out.tfevents.1.host").write_bytes(bytes(data))
        out, err = io.StringIO(), io.StringIO()
        stdout, stderr, sys.stdout, sys.stderr = sys.stdout, sys.stderr, out, err
        try:
            status = main([logdir, "--format", "json"])
        finally:
            sys.stdout, sys.stderr = stdout, stderr
    assert "Traceback" not in err.getvalue()
    doc = json.loads(out.getvalue())
    if "error" in doc:  # a valid shorter file without a trainvitals tag (or empty): nothing to report
        assert status == doc["exit_status"] == EXIT_NO_DATA and visible is not True
        return
    (run,) = doc["runs"]
    if visible is not None:
        assert bool(damage_findings(run)) is visible and run["read_in_part"] is visible
    if run["read_in_part"]:
        assert status in (EXIT_CRITICAL, EXIT_DAMAGED) and run["status"] != "ok"
    if visible is False:  # a valid shorter file: what it holds, critical or not
        assert status in (EXIT_OK, EXIT_CRITICAL, EXIT_NO_DATA)


def test_a_pipe_or_a_dangling_link_named_like_an_event_file_is_named(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "run", HEALTHY)
    os.mkfifo(tmp_path / "run" / "events.out.tfevents.9.fifo")
    (tmp_path / "run" / "events.out.tfevents.8.link").symlink_to(tmp_path / "gone")
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_DAMAGED
    assert damage_findings(doc["runs"][0]) == [
        "run/events.out.tfevents.8.link: the file cannot be read (No such file or directory), so nothing of it is "
        "in this report.",
        "run/events.out.tfevents.9.fifo: not a regular file, so nothing of it is in this report.",
    ]


@pytest.mark.parametrize("denied", ["b", ""])
def test_a_folder_that_cannot_be_listed_is_named(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, denied: str
) -> None:
    """A subfolder: a run read in part (what it may hold is unknown); LOGDIR itself: nothing to report."""
    write_run(tmp_path / "a", HEALTHY)
    (tmp_path / "b").mkdir()
    walk = os.walk

    def refusing(top, onerror=None, followlinks=False):  # root reads any folder: refuse one the way os.walk does
        refused = os.path.join(top, denied) if denied else os.fspath(top)
        for entry in walk(top, onerror=onerror, followlinks=followlinks):
            if entry[0].rstrip("/") == refused.rstrip("/"):
                onerror(PermissionError(13, "Permission denied", refused))
                continue
            yield entry

    monkeypatch.setattr(os, "walk", refusing)
    status, out, err = report(capsys, str(tmp_path))
    if denied:
        assert status == EXIT_DAMAGED and err == ""
        assert "run b: read in part\n" in out
        assert (
            "[warning] event files: b/: the folder cannot be listed (Permission denied): event files in it are not read."
            in out
        )
    else:
        assert status == EXIT_NO_DATA and out == "" and err.endswith("cannot be listed: Permission denied.\n")


# ---------------------------------------------------------------------------------------- non-UTF-8 names
def test_names_that_are_not_utf8_are_reported_escaped(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "run", DIVERGED)  # TensorBoard's writer takes UTF-8 names only
    path = event_file(tmp_path / "run")
    os.rename(path, os.fsencode(path) + b".\xfe")
    folder = os.fsencode(tmp_path) + b"/run\xff"
    os.rename(tmp_path / "run", folder)
    status, text, err = report(capsys, str(tmp_path))
    assert status == EXIT_CRITICAL and err == ""
    assert text.startswith("run run\\xff: CRITICAL, last logged optimizer step 95")
    status, doc = report_json(capsys, tmp_path)
    assert doc["runs"][0]["run"] == "run\\xff"
    # The LOGDIR itself, a damaged file in it, and a terminal that takes ASCII only.
    Path(os.fsdecode(folder), "events.out.tfevents.2.h\xe9").write_bytes(b"\x00" * 5)
    stdout, sys.stdout = sys.stdout, io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    try:
        status = main([os.fsdecode(folder)])
        sys.stdout.seek(0)
        text = sys.stdout.read()
    finally:
        sys.stdout = stdout
    assert status == EXIT_CRITICAL
    assert (
        text.startswith("run run\\xff: CRITICAL") and "events.out.tfevents.2.h\\xe9 is damaged at byte 0 of 5" in text
    )


def test_a_missing_logdir_that_is_not_utf8_is_named(tmp_path: Path, capsys) -> None:
    status, out, err = report(capsys, os.fsdecode(os.fsencode(tmp_path) + b"/gone\xff"))
    assert status == EXIT_NO_DATA and out == "" and err.endswith("gone\\xff does not exist.\n")


# ------------------------------------------------------------------------------------------ logger prefixes
def test_prefix_helpers() -> None:
    assert split_prefix("train-grad_norm/optimizer_1/total") == ("train", "grad_norm/optimizer_1/total")
    assert split_prefix("a-b-graph/unused_params") == ("a-b", "graph/unused_params")
    assert split_prefix("fold/1-memory/parameters_bytes") == ("fold/1", "memory/parameters_bytes")
    assert split_prefix("grad_norm/enc-grad_norm/x") == ("", "grad_norm/enc-grad_norm/x")  # a layer's name
    assert split_prefix("train-lr-SGD") == ("", "train-lr-SGD")  # not a trainvitals tag
    assert split_prefix("train.grad_norm/total", separator=".") == ("train", "grad_norm/total")
    import re

    pattern = with_prefix(grad_norm("total"), "tr.in")
    assert re.match(pattern, "tr.in-grad_norm/optimizer_0/total") and not re.match(pattern, "trXin-grad_norm/total")
    assert not re.match(pattern, "grad_norm/total") and with_prefix(grad_norm("total")) == grad_norm("total")


def test_a_prefixed_nan_run_is_critical(tmp_path: Path, capsys) -> None:
    write_run(
        tmp_path / "run",
        {f"train-{tag}": v for tag, v in DIVERGED.items()} | {"train-epoch": 0.0},
        {"grad_norm/stop_reason": "not stopped"},
    )
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    (run,) = doc["runs"]
    assert run["run"] == "run (prefix train)"
    assert any(f["message"].startswith("non-finite (inf/NaN) gradients on 15") for f in run["findings"])
    assert run["sections"]["convergence"][-1]["value"] == "not stopped"  # unprefixed text panels too


def test_two_prefixes_in_one_folder_are_two_runs_not_summed(tmp_path: Path, capsys) -> None:
    both = {f"a-{tag}": v for tag, v in DIVERGED.items()} | {f"b-{tag}": v for tag, v in DIVERGED.items()}
    write_run(tmp_path / "run", both | {"grad_norm/total": 1.0})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    assert [r["run"] for r in doc["runs"]] == ["run (no prefix)", "run (prefix a)", "run (prefix b)"]
    for run in doc["runs"][1:]:
        assert any(f["message"].startswith("non-finite (inf/NaN) gradients on 15 ") for f in run["findings"])
    assert not doc["runs"][0]["critical"]


def test_a_logger_with_its_own_separator(tmp_path: Path, capsys) -> None:
    """A Logger subclass may set another LOGGER_JOIN_CHAR; ``--separator`` names it."""
    write_run(tmp_path / "run", {f"train::{tag}": v for tag, v in DIVERGED.items()})
    assert report(capsys, str(tmp_path))[0] == EXIT_NO_DATA  # no trainvitals tag with the default "-"
    status, out, _ = report(capsys, str(tmp_path), "--separator", "::")
    assert status == EXIT_CRITICAL and out.startswith("run run (prefix train): CRITICAL")


def _fit(
    loggers,
    inf_at_step: int | None,
    n: int = 64,
    callbacks=None,
    max_steps: int = 12,
    log_every_n_steps: int = 2,
    **trainer,
) -> None:
    import lightning.pytorch as pl
    from _models import Regressor, regression_data
    from torch.utils.data import DataLoader

    from trainvitals.norms.monitor import GradNormMonitor

    fit = pl.Trainer(
        max_steps=max_steps,
        logger=loggers,
        callbacks=callbacks or [GradNormMonitor()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=log_every_n_steps,
        accelerator="cpu",
        **trainer,
    )
    fit.fit(Regressor(inf_at_step=inf_at_step), DataLoader(regression_data(n), batch_size=4))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_loggers_with_prefix_sub_dir_and_versions(tmp_path: Path, capsys) -> None:
    """A NaN run through two TensorBoardLoggers into one folder (prefixes train and tb, a custom version, a
    sub_dir) and a third in a folder of its own: every one of them reported critical."""
    from lightning.pytorch.loggers import TensorBoardLogger

    loggers = [
        TensorBoardLogger(tmp_path, name="exp", version="my run", sub_dir="fold/0", prefix="train"),
        TensorBoardLogger(tmp_path, name="exp", version="my run", sub_dir="fold/0", prefix="tb"),
        TensorBoardLogger(tmp_path, name="", version="v2", prefix="x-y"),
    ]
    _fit(loggers, inf_at_step=4)
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    assert [(r["run"], r["critical"]) for r in doc["runs"]] == [
        ("exp/my run/fold/0 (prefix tb)", True),
        ("exp/my run/fold/0 (prefix train)", True),
        ("v2 (prefix x-y)", True),
    ]


# -------------------------------------------------------------------------------- nothing measured, diverged
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_empty_train_dataloader_is_nothing_measured(tmp_path: Path, capsys) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.norms.monitor import GradNormMonitor
    from trainvitals.tensorboard.dashboard import TrainvitalsDashboard

    _fit(TensorBoardLogger(tmp_path), inf_at_step=None, n=0, callbacks=[GradNormMonitor(), TrainvitalsDashboard()])
    (run,) = read_runs(tmp_path)
    assert run.texts and not run.scalars  # the end-of-fit panels, and no step
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_NO_DATA
    assert text.startswith("run lightning_logs/version_0: nothing measured\n")
    assert "[warning] event files: nothing measured: no trainvitals scalar, so no optimizer step was logged" in text


@pytest.mark.parametrize(
    ("streak", "diverged"),
    [
        ([0, 5, 10, 15, 20, 22, 22, 22], True),  # every step from 25 on uncounted: NaN, the flag stale
        ([0, 5, 10, 15, 20, 25, 30, 35], False),  # in the band and counting
        ([0, 0, 0, 0, 0, 0, 0, 0], False),  # out of the band: a reset and a frozen 0 look the same
        ([0, 1, 2, 3, 3, 3, 3, 3], False),  # 3 at steps 15 and 20 can be a reset and 3 new steps
    ],
)
def test_a_stopper_alone_tells_divergence_by_its_frozen_streak(
    tmp_path: Path, capsys, streak: list[int], diverged: bool
) -> None:
    """Without GradNormMonitor and GraphIntegrityCallback the stopper's in-band flag after NaN is its last
    one from before; its streak, which a counted step moves, tells."""
    steps = STEPS[::-1][: len(streak)][::-1]
    writer = SummaryWriter(str(tmp_path / "run"))
    for step, count in zip(steps, streak):
        writer.add_scalar("grad_norm/band_streak", count, step)
        writer.add_scalar("grad_norm/in_noise_band", 1.0, step)
        writer.add_scalar("grad_norm/noise_floor", 0.1, step)
    writer.close()
    status, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "convergence"]
    assert any(m.startswith("the run diverged") for m in notes) is diverged
    assert any(m.startswith("in its noise band") for m in notes) is not diverged
    assert (status == EXIT_CRITICAL) is diverged
    if diverged:
        assert doc["runs"][0]["findings"][-1]["message"].startswith(
            "GradNormEarlyStopping counted none of the optimizer steps after step 85: each had non-finite"
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_nan_run_with_the_stopper_alone_is_critical(tmp_path: Path, capsys) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.noise.stopper import GradNormEarlyStopping

    # A wide band: in it from the first steps on, so that the last flag before NaN is 1.
    stopper = GradNormEarlyStopping(min_steps=0, patience=1000, margin=50.0, verbose=False)
    _fit(
        TensorBoardLogger(tmp_path), inf_at_step=9, n=128, callbacks=[stopper], accumulate_grad_batches=2, max_steps=16
    )
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    messages = [f["message"] for f in doc["runs"][0]["findings"]]
    assert not any(m.startswith("in its noise band") for m in messages)
    # The stopper counts the non-finite steps (from 9 on) under the monitor's tag.
    assert any(m.startswith("non-finite (inf/NaN) gradients on ") for m in messages)
    assert any(m.startswith("the run diverged") for m in messages)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_nan_between_logging_steps_gets_no_band_verdict(tmp_path: Path, capsys) -> None:
    """NaN from step 28, logged every 5 steps: the first interval after the last finite norm (25) is only
    partly non-finite; the stopper's band flag after it (decisive from its 20th measurement on) is its last
    one from before."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.noise.stopper import GradNormEarlyStopping
    from trainvitals.norms.monitor import GradNormMonitor

    stopper = GradNormEarlyStopping(min_steps=0, patience=1000, margin=50.0, verbose=False)
    _fit(
        TensorBoardLogger(tmp_path),
        inf_at_step=28,
        n=128,
        callbacks=[GradNormMonitor(), stopper],
        accumulate_grad_batches=2,
        max_steps=36,
        log_every_n_steps=5,
    )
    (run,) = read_runs(tmp_path)
    assert run.scalars["grad_norm/in_noise_band"][-1][1] == 1.0  # what the old report took as the verdict
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "convergence"]
    assert any(m.startswith("the run diverged (") for m in notes)
    assert not any("noise band" in m for m in notes)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fit_that_did_not_end_is_named(tmp_path: Path, capsys) -> None:
    """A file cut exactly at a record's end is a valid, shorter file; the missing end-of-fit diagnosis tells."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.compat.proto import event_pb2

    from trainvitals.norms.monitor import GradNormMonitor
    from trainvitals.tensorboard.dashboard import TrainvitalsDashboard

    _fit(TensorBoardLogger(tmp_path), inf_at_step=None, callbacks=[GradNormMonitor(), TrainvitalsDashboard()])
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_OK and "end-of-fit" not in text
    path = event_file(tmp_path / "lightning_logs" / "version_0")
    data = path.read_bytes()
    cut = next(
        start
        for start, end in records(data)
        if any(
            v.tag.startswith(f"{DIAGNOSIS_TAG}/")
            for v in event_pb2.Event.FromString(data[start + 12 : end - 4]).summary.value
        )
    )
    path.write_bytes(data[:cut])
    # Nothing in the format says the file was cut: the layout without the fit's end reads as a fit that did not end.
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_UNFINISHED
    (run,) = doc["runs"]
    assert run["status"] == "did not end" and [f["section"] for f in run["findings"]].count("fit") == 1


def test_diagnosis_panels_of_earlier_versions_count_as_the_fit_end(tmp_path: Path, capsys) -> None:
    """Event files written before the panels moved to ``diagnosis/`` hold them under ``trainvitals/diagnosis/``."""
    from torch.utils.tensorboard import SummaryWriter

    from trainvitals.tensorboard.layout import TRAINVITALS_LAYOUT

    def write(folder: Path, panel: str) -> None:
        writer = SummaryWriter(str(folder))
        writer.add_custom_scalars(TRAINVITALS_LAYOUT)
        for step in range(3):
            writer.add_scalar("grad_norm/total", 1.0, step)
        writer.add_text(f"{panel}/GradNormMonitor", "done", 3)
        writer.close()

    write(tmp_path / "old", "trainvitals/diagnosis")
    write(tmp_path / "none", "elsewhere")
    _, doc = report_json(capsys, tmp_path)
    assert {run["run"]: run["fit_end"] for run in doc["runs"]} == {"old": "ended", "none": "did not end"}


def _report_process(logdir: Path, **popen: object) -> subprocess.CompletedProcess[str]:
    """``python -m trainvitals report logdir`` with its stdout as ``popen`` sets it; stderr captured."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "trainvitals", "report", str(logdir)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,
    )  # type: ignore[call-overload]
    if process.stdout is not None:
        process.stdout.close()  # the reader quits before the report is written (| head)
    _, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, "", err)


@pytest.mark.parametrize("stdout", ["closed pipe", "closed", "full"])
def test_an_unwritable_stdout_gives_no_traceback(tmp_path: Path, stdout: str) -> None:
    """A reader that quits is no error (the report's own status); a stdout that cannot take the report is
    status 4 with one line on stderr — never a traceback, never 1 (a critical finding)."""
    write_run(tmp_path / "run", HEALTHY)
    if stdout == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    if stdout == "closed pipe":
        done = _report_process(tmp_path, stdout=subprocess.PIPE)
    elif stdout == "closed":
        done = _report_process(tmp_path, pass_fds=(), preexec_fn=lambda: os.close(1))
    else:
        with open("/dev/full", "w") as full:
            done = _report_process(tmp_path, stdout=full)
    assert "Traceback" not in done.stderr
    if stdout == "closed pipe":
        assert (done.returncode, done.stderr) == (EXIT_OK, "")
    else:
        assert done.returncode == EXIT_UNWRITTEN
        assert done.stderr.startswith("trainvitals report: the report cannot be written to stdout")


def test_an_output_file_that_cannot_be_written_is_status_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "run", HEALTHY)
    status, out, err = report(capsys, str(tmp_path), "-o", str(tmp_path / "missing" / "report.txt"))
    assert (status, out) == (EXIT_UNWRITTEN, "")
    assert "missing/report.txt" in err and "No such file or directory" in err


def test_an_empty_logdir_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trainvitals report ""`` (an unset variable) is refused, not a report on the current folder."""
    write_run(tmp_path / "run", HEALTHY)
    monkeypatch.chdir(tmp_path)
    status, out, err = report(capsys, "")
    assert (status, out) == (EXIT_NO_DATA, "")
    assert err.startswith("trainvitals report: LOGDIR is empty")


def test_the_damage_names_the_last_logged_optimizer_step_not_a_panel_s(tmp_path: Path, capsys) -> None:
    """Text panels carry the fit's end step (24), past the last logged scalar (20): the damage and the
    status line name the same step."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in (10, 20):
        writer.add_scalar("grad_norm/total", 1.0, step)
    writer.add_text("grad_norm/stop_reason", "did not stop", 24)
    writer.close()
    path = event_file(tmp_path / "run")
    path.write_bytes(path.read_bytes() + b"\x01" * 5)  # cut inside a record's header
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_DAMAGED and text.startswith("run run: read in part, last logged optimizer step 20\n")
    assert "read whole up to logged optimizer step 20)" in text


@pytest.mark.parametrize("junk", ["zeros", "random"])
def test_junk_after_damage_is_skipped_without_a_checksum_per_byte(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, junk: str
) -> None:
    """A crash that leaves 256 KiB of zeros or junk after a damaged length: only offsets whose length fits
    in the file are checksummed, so the resync costs a handful of checksums, not one per byte."""
    import random

    from trainvitals.report import events

    write_run(tmp_path / "run", HEALTHY)
    path = event_file(tmp_path / "run")
    data = path.read_bytes()
    fill = bytes(256 * 1024) if junk == "zeros" else random.Random(0).randbytes(256 * 1024)
    path.write_bytes(data + b"\xff" * 12 + fill)  # a length that fails its checksum, then the fill
    calls = []

    def counting(chunk: bytes) -> int:
        calls.append(len(chunk))
        return masked_crc32c(chunk)

    monkeypatch.setattr(events, "masked_crc32c", counting)
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_DAMAGED
    (message,) = damage_findings(doc["runs"][0])
    assert message.startswith(
        f"run/{path.name} is damaged at byte {len(data):,} of {len(data) + 12 + len(fill):,} "
        "(a record's length fails its checksum;"
    )
    assert len(calls) < 2 * len(records(data)) + 100  # the records read whole, and a few candidates


def test_a_wrong_separator_gets_a_hint(tmp_path: Path, capsys) -> None:
    """Prefixed with "::" but read with the default "-": nothing measured, and the hint names "::"."""
    write_run(
        tmp_path / "run",
        {f"train::{tag}": value for tag, value in HEALTHY.items()},
        {"grad_norm/stop_reason": "did not stop"},
    )
    status, out, _ = report(capsys, str(tmp_path))
    assert status == EXIT_NO_DATA and "nothing measured" in out
    assert "look like a logger's prefixed ones: give its separator with --separator '::'." in out
    status, out, _ = report(capsys, str(tmp_path), "--separator", "::")
    assert status == EXIT_OK and "--separator" not in out
