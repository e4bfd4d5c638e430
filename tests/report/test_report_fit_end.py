"""``trainvitals report`` for a requeue script: a fit that crashed, was killed or stopped again at once has its
own status and exit code, and every error is JSON on stdout under ``--format json``."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _models import Regressor, regression_data
from conftest import trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from test_report import HEALTHY, report, report_json, write_run
from torch.utils.data import DataLoader

from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.report.command import (
    EXIT_CRASHED,
    EXIT_NO_DATA,
    EXIT_OK,
    EXIT_UNFINISHED,
    EXIT_UNWRITTEN,
    main,
    read_runs,
)
from trainvitals.tags import FIT_END_TAG
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class RaisesAt(Regressor):
    """Raises ``error`` in the training step of optimizer step ``at``."""

    def __init__(self, at: int, error: type[BaseException]) -> None:
        super().__init__()
        self.at, self.error = at, error

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            raise self.error("the data loader went away")
        return super().training_step(batch, batch_idx)


def _fit(logdir: Path, model: pl.LightningModule, callbacks: list, ckpt_path: str | None = None, **trainer) -> None:
    fit = pl.Trainer(
        **trainer_kwargs(
            **{
                "max_steps": 20,
                "logger": TensorBoardLogger(logdir, name="run"),
                "callbacks": callbacks,
                "log_every_n_steps": 1,
                **trainer,
            }
        )
    )
    fit.fit(model, DataLoader(regression_data(128), batch_size=4), ckpt_path=ckpt_path)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_crashed_fit_exits_5_and_names_its_exception(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], error: type[BaseException]
) -> None:
    """An exception at step 15 (Lightning turns a KeyboardInterrupt into exit 1): the steps before it read as
    they were, the status is "crashed" and the exception's type is named — never "ok" with exit 0."""
    with pytest.raises(SystemExit if error is KeyboardInterrupt else error):
        _fit(tmp_path, RaisesAt(15, error), [GradNormMonitor(), TrainvitalsDashboard()])
    status, doc = report_json(capsys, tmp_path)
    assert status == doc["exit_status"] == EXIT_CRASHED
    (run,) = doc["runs"]
    assert (run["status"], run["fit_end"], run["last_step"]) == ("crashed", "crashed", 14)
    (crash,) = [f for f in run["findings"] if f["section"] == "fit"]
    assert error.__name__ in crash["message"] and "15" in crash["message"]


@pytest.mark.parametrize("diagnosis", [True, False])
def test_a_finished_fit_exits_0_with_or_without_diagnosis_panels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], diagnosis: bool
) -> None:
    """The fit's end is its own mark: a dashboard without diagnosis panels still says the fit ended."""
    _fit(tmp_path, Regressor(), [GradNormMonitor(), TrainvitalsDashboard(diagnosis=diagnosis)])
    (run,) = read_runs(tmp_path)
    assert [step for step, _ in run.texts[FIT_END_TAG]] == [20]
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK and doc["runs"][0]["fit_end"] == "ended"


def test_a_crash_beside_finished_runs_is_the_commands_status(tmp_path: Path, capsys) -> None:
    """A crashed fit (the dashboard's layout and its exception) beside a healthy run and one that did not end
    (the layout alone: killed, or still running): the crash is the most severe."""
    from torch.utils.tensorboard import SummaryWriter

    from trainvitals.tensorboard.layout import TRAINVITALS_LAYOUT

    write_run(tmp_path / "healthy", HEALTHY)
    for name, line in (("killed", None), ("crashed", "the fit raised RuntimeError: CUDA error (at optimizer step 7).")):
        writer = SummaryWriter(str(tmp_path / name))
        writer.add_custom_scalars(TRAINVITALS_LAYOUT)
        for step in range(7):
            writer.add_scalar("grad_norm/total", 1.0, step)
        if line:
            writer.add_text(FIT_END_TAG, line, 7)
        writer.close()
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRASHED
    assert {r["run"]: r["status"] for r in doc["runs"]} == {
        "crashed": "crashed",
        "healthy": "ok",
        "killed": "did not end",
    }
    (tmp_path / "crashed" / next(p.name for p in (tmp_path / "crashed").iterdir())).unlink()
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_UNFINISHED


def test_a_fit_resumed_after_its_stop_reads_stopped_again(tmp_path: Path, capsys) -> None:
    """A requeued job relaunched after the stopper stopped it: the new fit takes no step, and its log folder
    holds only the panels. It reads as the stop it repeats (exit 0), not as "nothing measured" (exit 2)."""

    def callbacks() -> list:
        stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, min_steps=0, patience=3, check_every_n_steps=1)
        return [GradNormMonitor(), stopper, TrainvitalsDashboard()]

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path, Regressor(), [*callbacks(), checkpoint], max_steps=-1, max_epochs=3, enable_checkpointing=True)
    _fit(tmp_path, Regressor(), callbacks(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), max_steps=-1, max_epochs=3)
    status, text, _ = report(capsys, str(tmp_path / "run" / "version_1"))
    assert status == EXIT_OK and "nothing measured" not in text
    status, doc = report_json(capsys, tmp_path / "run" / "version_1")
    (run,) = doc["runs"]
    assert run["status"] == "stopped again" and run["stopped_again"] is True
    (stop,) = [row["value"] for row in run["sections"]["convergence"] if row["label"] == "stop"]
    assert stop.startswith("stopped at optimizer step 2 (after 3 steps)") and "stopped again" in stop
    status, doc = report_json(capsys, tmp_path)  # beside the fit that stopped
    assert status == EXIT_OK
    assert [r["status"] for r in doc["runs"]] == ["ok", "stopped again"]


def _json_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    status, out, err = report(capsys, *argv, "--format", "json")
    return status, json.loads(out), err


def test_errors_are_json_on_stdout_under_format_json(tmp_path: Path, capsys) -> None:
    for argv in ([str(tmp_path / "missing")], [""]):
        status, doc, err = _json_error(capsys, *argv)
        assert status == doc["exit_status"] == EXIT_NO_DATA and doc["error"] and doc["error"] in err
    write_run(tmp_path / "run", HEALTHY)
    status, doc, err = _json_error(capsys, str(tmp_path), "-o", str(tmp_path / "missing" / "report.json"))
    assert status == doc["exit_status"] == EXIT_UNWRITTEN and "missing/report.json" in doc["error"]
    status, out, _ = report(capsys, str(tmp_path / "missing"))
    assert status == EXIT_NO_DATA and out == ""  # the text format keeps stdout for the report


@pytest.mark.parametrize("argv", [["--format", "json"], ["--format=json", "x", "--separator"]])
def test_a_usage_error_is_json_on_stdout_under_format_json(capsys, argv: list[str]) -> None:
    """argparse's own message on stderr, and the same error as JSON on stdout, through either entry point."""
    from trainvitals.cli import main as cli

    for status, (out, err) in ((main(argv), capsys.readouterr()), (cli(["report", *argv]), capsys.readouterr())):
        doc = json.loads(out)
        assert status == doc["exit_status"] == EXIT_NO_DATA and doc["error"] in err and "usage" in err


def test_an_empty_event_file_is_empty_not_another_tools(tmp_path: Path, capsys) -> None:
    """0 bytes: the writer had not flushed yet, or the run died at once; alone, nothing to report (2)."""
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "events.out.tfevents.1.host").write_bytes(b"")
    status, doc, err = _json_error(capsys, str(tmp_path))
    assert status == EXIT_NO_DATA and "empty" in doc["error"] and "another tool" not in doc["error"]
    write_run(tmp_path / "run", HEALTHY)
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    assert (doc["empty_runs"], doc["skipped_runs"], [r["run"] for r in doc["runs"]]) == (["early"], [], ["run"])
