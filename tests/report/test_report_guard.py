"""``trainvitals report`` on TrainingGuard's runs: what it met and did, from real fits' event files, a CSVLogger's
``metrics.csv`` and the guard's ``skip_batches.json``, checked against the guard's own record of the fit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _models import LogModel, Regressor, loader, log_data, regression_data
from conftest import trainer_kwargs
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from test_report import report, report_json, rows

from trainvitals.guard.callback import TrainingGuard
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.report.command import EXIT_CRITICAL, EXIT_OK, main
from trainvitals.report.guard import GUARD
from trainvitals.report.model import SPIKES
from trainvitals.tags import SKIP_BATCHES_FILE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Faulty(Regressor):
    """The regressor with its loss made NaN at the optimizer steps ``nan_at`` and 1000× at ``spike_at``."""

    def __init__(self, nan_at=(), spike_at=()) -> None:
        super().__init__(autocast=False)
        self.nan_at, self.spike_at = set(nan_at), set(spike_at)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step in self.nan_at:
            return loss * float("nan")
        return loss * 1000.0 if self.global_step in self.spike_at else loss


def _fit(logger, model: pl.LightningModule, guard: TrainingGuard, data=None, max_steps: int = 12) -> pl.Trainer:
    trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, logger=logger, callbacks=[guard], log_every_n_steps=1))
    trainer.fit(model, data if data is not None else loader(regression_data(128), 8))
    return trainer


def _guard_run(doc: dict) -> tuple[dict, list[dict]]:
    (run,) = doc["runs"]
    return rows(run, GUARD), [f for f in run["findings"] if f["section"] == GUARD]


def test_skips_and_a_rollback_are_a_warning_with_the_guards_own_counts(tmp_path: Path, capsys) -> None:
    guard = TrainingGuard(on_nonfinite="skip", on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2)
    _fit(TensorBoardLogger(tmp_path, name="run"), Faulty(nan_at={4, 6}, spike_at={9}), guard)
    status, doc = report_json(capsys, tmp_path)
    section, (finding,) = _guard_run(doc)
    assert status == EXIT_OK and finding["severity"] == "warning"  # the run went on without those steps
    assert (guard.skipped_steps, guard.rollbacks) == (2, 1)
    assert section["events"] == len(guard.events) == 3
    assert (section["non-finite steps"], section["spikes"]) == (2, 1)
    assert (section["steps skipped"], section["rollbacks"]) == (2, 1)
    assert (
        [label for label in section if label.startswith("event at")]
        == [f"event at optimizer step {e['global_step']}" for e in guard.events]
        == ["event at optimizer step 4", "event at optimizer step 6", "event at optimizer step 9"]
    )
    assert section["event at optimizer step 9"].startswith("rollback: spike")
    recorded = Path(section["every event's batches"])
    assert recorded.name == SKIP_BATCHES_FILE and json.loads(recorded.read_text()) == json.loads(
        json.dumps(guard.events)
    )
    assert "skipped 2 step(s)" in finding["message"] and "rolled back 1 time(s)" in finding["message"]
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_OK and "training guard" in text and "[warning] training guard" in text


@pytest.mark.parametrize(("action", "expected"), [("skip", EXIT_OK), ("stop", EXIT_CRITICAL), ("warn", EXIT_CRITICAL)])
def test_a_stop_or_an_applied_nan_is_critical_and_the_producer_is_named(
    tmp_path: Path, capsys, action: str, expected: int
) -> None:
    """LogModel's layer net.2 (a log) makes -inf on batch 3: the report names it as the guard did."""
    guard = TrainingGuard(on_nonfinite=action)
    trainer = _fit(TensorBoardLogger(tmp_path, name="run"), LogModel(), guard, log_data(bad_batch=3), max_steps=6)
    status, doc = report_json(capsys, tmp_path)
    section, (finding,) = _guard_run(doc)
    assert status == expected and finding["severity"] == ("warning" if expected == EXIT_OK else "critical")
    assert guard.producer is not None and guard.producer.module == "net.2"
    assert section["first inf/NaN made by"] == guard.producer.describe() and "`net.2`" in finding["message"]
    assert section["non-finite steps"] >= 1 and guard.events[0]["global_step"] == 3
    if action == "stop":
        assert trainer.global_step == 4 and "optimizer step 3" in section["stopped"]
        assert (
            section["stopped"].endswith("guard-stop-step=4.ckpt") and Path(section["stopped"].split(": ")[-1]).exists()
        )
    if action == "warn":  # the NaN weights make every later step non-finite too
        assert section["non-finite steps"] == len(guard.events) == 3 and "applied as they were" in finding["message"]


def test_without_skip_batches_json_the_panel_gives_the_latest_events(tmp_path: Path, capsys) -> None:
    guard = TrainingGuard(on_nonfinite="skip", budget_events=100)
    _fit(TensorBoardLogger(tmp_path, name="run"), Faulty(nan_at=range(2, 26)), guard, max_steps=28)
    (recorded,) = tmp_path.rglob(SKIP_BATCHES_FILE)
    recorded.unlink()
    status, doc = report_json(capsys, tmp_path)
    section, (finding,) = _guard_run(doc)
    assert status == EXIT_OK and section["events"] == guard.skipped_steps == 24
    assert section["non-finite steps among the latest 20"] == 20  # the panel's rows
    assert "every event's batches" not in section
    shown = [int(label.rsplit(" ", 1)[1]) for label in section if label.startswith("event at")]
    assert shown == [e["global_step"] for e in guard.events[-10:]] == list(range(16, 26))


def test_a_csv_loggers_run_reads_the_counters_and_skip_batches_json(tmp_path: Path, capsys) -> None:
    guard = TrainingGuard(on_nonfinite="skip", on_spike="skip", spike_warmup_steps=3)
    _fit(CSVLogger(tmp_path, name="csv"), Faulty(nan_at={4}, spike_at={8}), guard)
    status, doc = report_json(capsys, tmp_path)
    section, (finding,) = _guard_run(doc)
    assert status == EXIT_OK and finding["severity"] == "warning"
    assert section["events"] == section["steps skipped"] == guard.skipped_steps == 2
    assert (section["non-finite steps"], section["spikes"]) == (1, 1)
    assert Path(section["every event's batches"]).parent == Path(guard._folder)


def test_the_html_report_plots_the_guards_actions(tmp_path: Path, capsys) -> None:
    guard = TrainingGuard(on_nonfinite="skip", on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2)
    _fit(TensorBoardLogger(tmp_path, name="run"), Faulty(nan_at={4}, spike_at={9}), guard)
    page = tmp_path / "report.html"
    assert main([str(tmp_path), "--format", "html", "-o", str(page)]) == EXIT_OK
    capsys.readouterr()
    html = page.read_text()
    assert "TrainingGuard&#x27;s actions" in html and "<h3>training guard</h3>" in html
    assert "event at optimizer step 9" in html


def test_a_report_reads_skip_batches_json_once(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard section, the monitor's answered non-finite steps and the HTML plot share one read of the file; the
    report is the same as one read with every open of it counted (the JSON's rows, the page's)."""
    guard = TrainingGuard(on_nonfinite="skip", on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2)
    callbacks = [guard, GradNormMonitor()]
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=12, logger=TensorBoardLogger(tmp_path, name="run"), callbacks=callbacks, log_every_n_steps=1
        )
    )
    trainer.fit(Faulty(nan_at={4, 6}, spike_at={9}), loader(regression_data(128), 8))
    before = report_json(capsys, tmp_path)
    assert main([str(tmp_path), "--format", "html", "-o", str(tmp_path / "before.html")]) == EXIT_OK
    opened: list[str] = []
    real_open = Path.open

    def counting_open(self: Path, *args, **kwargs):
        if self.name == SKIP_BATCHES_FILE:
            opened.append(str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    after = report_json(capsys, tmp_path)
    assert len(opened) == 1  # Path.read_text opens through Path.open
    assert main([str(tmp_path), "--format", "html", "-o", str(tmp_path / "after.html")]) == EXIT_OK
    assert len(opened) == 2  # one more report, one more read
    capsys.readouterr()
    assert after == before
    (run,) = after[1]["runs"]
    assert rows(run, GUARD)["events"] == len(guard.events) == 3
    (spikes,) = [f for f in run["findings"] if f["section"] == SPIKES and "non-finite" in f["message"]]
    assert "answered by TrainingGuard" in spikes["message"]  # the monitor's 2 steps, both skipped per the file
    pages = [(tmp_path / name).read_text().replace(name, "") for name in ("before.html", "after.html")]
    assert pages[0] == pages[1]


@pytest.mark.parametrize(("action", "expected"), [("skip", EXIT_OK), ("warn", EXIT_CRITICAL)])
def test_the_monitors_nonfinite_steps_are_a_warning_when_the_guard_answered_them(
    tmp_path: Path, capsys, action: str, expected: int
) -> None:
    """GradNormMonitor counts the steps the guard skipped too: answered, they are no divergence (the same run
    exits alike with the monitor and without it); applied, they stay critical."""
    guard = TrainingGuard(on_nonfinite=action)
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=12,
            logger=TensorBoardLogger(tmp_path, name="run"),
            callbacks=[guard, GradNormMonitor()],
            log_every_n_steps=1,
        )
    )
    trainer.fit(Faulty(nan_at={4, 6}), loader(regression_data(128), 8))
    status, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    (spikes,) = [f for f in run["findings"] if f["section"] == SPIKES and "non-finite" in f["message"]]
    assert status == expected and rows(run, SPIKES)["steps with non-finite gradients"] >= 2
    assert spikes["severity"] == ("warning" if action == "skip" else "critical")
    assert ("answered by TrainingGuard" in spikes["message"]) == (action == "skip")
