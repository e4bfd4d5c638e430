"""The same vitals for W&B, MLflow and CSV users: one fit with every callback and four loggers at once (TensorBoard,
CSV, W&B offline, an MLflow file store), read back from each logger's own files; ``trainvitals report`` on the CSV
and MLflow folders against the TensorBoard folder of the same run. Nothing reaches a network."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _models import Regressor, loader, regression_data
from conftest import trainer_kwargs
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator

from trainvitals.activations.monitor import ActivationMonitor
from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.plumbing.writers import RunRecord, log_scalars
from trainvitals.report.command import EXIT_CRASHED, EXIT_DAMAGED, EXIT_OK, main
from trainvitals.tags import REPORT_HTML, REPORT_JSON, mlflow_key
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard
from trainvitals.updates.monitor import UpdateMonitor

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger  # noqa: E402  (after the skips)

pytestmark = [pytest.mark.loggers, pytest.mark.filterwarnings("ignore::UserWarning")]

OFFLINE = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store behind this switch
}


@pytest.fixture(scope="module")
def fit(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One 40-step fit of the regressor with every callback and the four loggers; W&B's run finished, so that its
    files are complete."""
    root = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as env:
        for key, value in {**OFFLINE, "WANDB_DIR": str(root)}.items():
            env.setenv(key, value)
        loggers = [
            TensorBoardLogger(root, name="tb", default_hp_metric=False),
            CSVLogger(root, name="csv"),
            WandbLogger(save_dir=root, offline=True, project="trainvitals"),
            MLFlowLogger(experiment_name="trainvitals", tracking_uri=f"file:{root}/mlruns"),
        ]
        callbacks = [
            GradNormMonitor(histogram_every_n_steps=10),
            BatchVarianceProbe(),
            GradNormEarlyStopping(min_steps=0),
            LRScalingAdvisor(),
            GraphIntegrityCallback(check_every_n_steps=10),
            MemoryTopologyProfiler(),
            UpdateMonitor(),
            ActivationMonitor(),
            TrainvitalsDashboard(),
        ]
        trainer = pl.Trainer(**trainer_kwargs(max_steps=40, logger=loggers, callbacks=callbacks, log_every_n_steps=2))
        trainer.fit(Regressor(), loader(regression_data(256), batch_size=8))
        wandb_dir = Path(loggers[2].experiment.dir).parent
        wandb.finish()
    mlflow_run = root / "mlruns" / loggers[3].experiment_id / loggers[3].run_id
    return SimpleNamespace(
        root=root,
        tensorboard=Path(loggers[0].log_dir),
        csv=Path(loggers[1].log_dir),
        wandb=wandb_dir,
        mlflow=mlflow_run,
        steps=trainer.global_step,
    )


def _report(capsys: pytest.CaptureFixture[str], folder: Path) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    status = main([str(folder), "--format", "json"])
    return status, json.loads(capsys.readouterr().out)


def _findings(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    (run,) = doc["runs"]
    return sorted((f["severity"], f["section"], f["message"]) for f in run["findings"])


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of the offline run's transaction log ``run-<id>.wandb``: ``{key: value}`` each.

    wandb 0.31 ships no Python reader of it (its datastore moved into wandb-core); the framing is LevelDB's log
    format, which wandb's own sync reads: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of records
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last), each a protobuf ``Record``.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, offset, pending = [], 7, b""
    while offset + 7 <= len(data):
        room = 32768 - offset % 32768
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if length == 0 and kind == 0:
            offset += room
            continue
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                row: dict[str, Any] = {}
                for item in record.history.item:  # media arrive as nested keys: [key, field]
                    value = json.loads(item.value_json)
                    *key, field = item.nested_key or [item.key]
                    (row.setdefault("/".join(key), {}) if key else row)[field] = value
                rows.append(row)
    return rows


def test_every_run_folder_holds_the_report_and_it_is_the_command_s(
    fit: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """The HTML page and the JSON in the TensorBoard, CSV and W&B folders and MLflow's artifacts, identical, and
    those ``trainvitals report --format json|html`` writes from the TensorBoard folder afterwards (the JSON with
    its record of the text panels besides)."""
    folders = [fit.tensorboard, fit.csv, fit.wandb / "files", fit.mlflow / "artifacts"]
    pages = {(folder / REPORT_HTML).read_text() for folder in folders}
    documents = {(folder / REPORT_JSON).read_text() for folder in folders}
    assert len(pages) == len(documents) == 1
    written = json.loads(documents.pop())
    status, read = _report(capsys, fit.tensorboard)
    assert status == EXIT_OK == written["exit_status"]
    assert _findings(read) and written.pop("record")["texts"]
    assert written == read  # values float32 in both: the record keeps them as an event file does
    assert read["runs"][0]["run"] == "version_0" and "integrity findings" in read["runs"][0]["panels"]
    assert main([str(fit.tensorboard), "--format", "html", "-o", str(fit.root / "page.html")]) == EXIT_OK
    assert pages.pop() == (fit.root / "page.html").read_text()


@pytest.mark.parametrize("which", ["csv", "mlflow"])
def test_the_report_on_the_csv_and_mlflow_folders_is_the_tensorboard_folder_s(
    fit: SimpleNamespace, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    """Scalars from metrics.csv / the metric files, text panels from the fit-end JSON: the same findings, status
    and last step as from the event files; the same rows in every section (values to float32's precision)."""
    status, doc = _report(capsys, getattr(fit, which) if which == "csv" else fit.root / "mlruns")
    tb_status, tb = _report(capsys, fit.tensorboard)
    assert status == tb_status == EXIT_OK
    assert _findings(doc) == _findings(tb)
    (run,), (tb_run,) = doc["runs"], tb["runs"]
    assert (run["status"], run["fit_end"], run["last_step"]) == (tb_run["status"], "ended", tb_run["last_step"])
    assert run["sections"].keys() == tb_run["sections"].keys()
    named = mlflow_key if which == "mlflow" else str  # module names as MLflow's keys hold them
    for title, rows in tb_run["sections"].items():
        assert [named(r["label"]) for r in run["sections"][title]] == [named(r["label"]) for r in rows]
        for mine, theirs in zip(run["sections"][title], rows):
            if isinstance(theirs["value"], float):
                assert mine["value"] == pytest.approx(theirs["value"], rel=1e-5, abs=1e-9), (title, theirs["label"])


def test_the_fits_loggers_under_one_folder_are_one_run_in_its_report(
    fit: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """The TensorBoard, CSV and MLflow logs of the one fit, read from the folder above them: one entry, named with
    each of them (values to float32's precision, tags as MLflow keeps them), not three with the same findings."""
    status, doc = _report(capsys, fit.root)
    (run,) = doc["runs"]
    assert status == EXIT_OK and run["run"] == "csv/version_0"  # in name order, the first kept
    assert run["same_logs"][0].startswith("mlruns/") and run["same_logs"][1:] == ["tb/version_0"]


def test_wandb_got_the_page_the_findings_histograms_and_text_panels(fit: SimpleNamespace) -> None:
    """The page as ``wandb.Html`` (its media file, byte for byte the report), the findings as a ``wandb.Table``,
    the gradient histograms (the counts TensorBoard got for the same tag and step) and the diagnoses as HTML."""
    files = fit.wandb / "files"
    (page,) = (files / "media" / "html" / "trainvitals").glob("report_*.html")
    assert page.read_text() == (fit.tensorboard / REPORT_HTML).read_text()
    (table,) = (files / "media" / "table" / "trainvitals").glob("findings_*.table.json")
    written = json.loads((fit.tensorboard / REPORT_JSON).read_text())
    assert sorted(map(tuple, json.loads(table.read_text())["data"])) == _findings(written)

    rows = _wandb_history(fit.wandb)
    histograms = {
        (row["trainer/global_step"], key): value
        for row in rows
        for key, value in row.items()
        if isinstance(value, dict) and value.get("_type") == "histogram"  # rows of W&B's own have no step
    }
    acc = event_accumulator.EventAccumulator(str(fit.tensorboard), size_guidance={event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    tags = acc.Tags()[event_accumulator.HISTOGRAMS]
    assert "grad_norm/hist/net.0" in tags and {key for _, key in histograms} >= set(tags)
    for tag in tags:
        for event in acc.Histograms(tag):
            counts = [int(c) for c in event.histogram_value.bucket]
            assert histograms[(event.step, tag)]["values"] == counts
            assert histograms[(event.step, tag)]["bins"][0] == pytest.approx(event.histogram_value.min, rel=1e-6)
    texts = {
        key
        for row in rows
        for key, value in row.items()
        if isinstance(value, dict) and value.get("_type") == "html-file"
    }
    assert {"diagnosis/GradNormMonitor", "trainvitals/fit_end"} <= texts


def test_mlflow_got_the_scalars_the_text_panels_and_the_report(fit: SimpleNamespace) -> None:
    """Metric files under the trainvitals tags, each text panel as ``<tag>/step_<n>.md`` with the markdown
    TensorBoard's Text tab got, and the report's two files as artifacts."""
    artifacts = fit.mlflow / "artifacts"
    assert (fit.mlflow / "metrics" / "grad_norm" / "total").is_file()
    assert {REPORT_HTML, REPORT_JSON} <= {p.name for p in artifacts.iterdir()}
    record = json.loads((artifacts / REPORT_JSON).read_text())["record"]["texts"]
    for tag, entries in record.items():
        for step, text in entries:
            assert (artifacts / tag / f"step_{step}.md").read_text() == text


def test_mlflow_keys_keep_only_what_mlflow_and_lightning_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-layer name with a character Lightning's MLFlowLogger drops (``:``, ``(``, a non-ASCII letter) is
    logged under ``_`` in its place, without Lightning's warning, and the report reads it back under that key."""
    assert mlflow_key("grad_norm/blocks:0(ü).weight-x y") == "grad_norm/blocks_0___.weight-x y"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(experiment_name="keys", tracking_uri=f"file:{tmp_path}/mlruns")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        log_scalars(SimpleNamespace(loggers=[logger], global_rank=0), {"grad_norm/a:b": torch.tensor(2.5)}, step=3)
    assert not [w for w in seen if "special characters" in str(w.message)]
    metric = tmp_path / "mlruns" / logger.experiment_id / logger.run_id / "metrics" / "grad_norm" / "a_b"
    assert metric.read_text().split()[1:] == ["2.5", "3"]


def test_a_csv_or_mlflow_file_cut_in_a_line_reads_in_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writer killed mid-line: the lines before it read, the run "read in part" (exit 3), the file named."""
    csv = tmp_path / "csv" / "version_0"
    csv.mkdir(parents=True)
    (csv / "metrics.csv").write_text("grad_norm/total,step\n1.5,0\n1.25,1\n1.0")
    status, doc = _report(capsys, tmp_path / "csv")
    assert status == EXIT_DAMAGED
    (run,) = doc["runs"]
    assert run["last_step"] == 1 and any("version_0/metrics.csv" in f["message"] for f in run["findings"])

    metrics = tmp_path / "mlruns" / "1" / "abc" / "metrics" / "grad_norm"
    metrics.mkdir(parents=True)
    (metrics.parent.parent / "meta.yaml").write_text("run_id: abc\n")
    (metrics / "total").write_text("100 1.5 0\n200 1.25 1\n300 1.")
    status, doc = _report(capsys, tmp_path / "mlruns")
    assert status == EXIT_DAMAGED
    (run,) = doc["runs"]
    assert run["run"] == "1/abc" and run["last_step"] == 1
    assert any("metrics/grad_norm/total" in f["message"] for f in run["findings"])


def test_the_record_keeps_every_value_in_order() -> None:
    record = RunRecord()
    record.add_scalars({"a": 1.0, "b": 2.0}, 0)
    record.add_scalars({"a": 0.5}, 4)
    record.add_text("t", "x", 4)
    assert record.series() == {"a": [(0, 1.0), (4, 0.5)], "b": [(0, 2.0)]}
    assert record.texts == {"t": [(4, "x")]}


def test_a_tensorboard_only_fit_imports_neither_wandb_nor_mlflow(tmp_path: Path) -> None:
    """The extras are imported only where such a logger is in use: a fit with every W&B/MLflow-aware path
    (histograms, text panels, the fit-end report) and a TensorBoardLogger alone leaves both out of sys.modules."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from _models import Regressor, loader, regression_data
import trainvitals
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard
pl.Trainer(max_steps=4, logger=TensorBoardLogger({str(tmp_path)!r}), enable_progress_bar=False,
           enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
           callbacks=[GradNormMonitor(histogram_every_n_steps=1), TrainvitalsDashboard()]).fit(
    Regressor(), loader(regression_data(32), batch_size=8))
print(sorted(m for m in ("wandb", "mlflow") if m in sys.modules))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (Path(tmp_path) / "lightning_logs" / "version_0" / REPORT_JSON).is_file()


def _short_fit(logger: Any, model: pl.LightningModule | None = None) -> None:
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=12, logger=logger, callbacks=[GradNormMonitor(), TrainvitalsDashboard()], log_every_n_steps=1
        )
    )
    trainer.fit(model or Regressor(), loader(regression_data(128), batch_size=8))


def test_an_mlflow_only_fit_gets_the_report_as_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No logger with a folder of its own: the files go to the run's artifacts through a temporary folder, the
    run is named by its id, and the command reads it back as the fit wrote it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(experiment_name="alone", tracking_uri=f"file:{tmp_path}/mlruns")
    _short_fit(logger)
    artifacts = tmp_path / "mlruns" / logger.experiment_id / logger.run_id / "artifacts"
    written = json.loads((artifacts / REPORT_JSON).read_text())
    assert (artifacts / REPORT_HTML).is_file() and written["runs"][0]["run"] == logger.run_id
    status, doc = _report(capsys, tmp_path / "mlruns")
    assert status == EXIT_OK and _findings(doc) == _findings(written)
    assert doc["runs"][0]["last_step"] == written["runs"][0]["last_step"] == 11


def test_a_crashed_csv_fit_reads_as_crashed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dashboard writes the report from ``on_exception`` too: a CSV-only fit that raised exits 5, the exception
    named, as its event files would say."""
    from test_report_fit_end import RaisesAt

    with pytest.raises(RuntimeError):
        _short_fit(CSVLogger(tmp_path, name="csv"), RaisesAt(8, RuntimeError))
    status, doc = _report(capsys, tmp_path / "csv")
    assert status == EXIT_CRASHED
    (run,) = doc["runs"]
    assert run["fit_end"] == "crashed" and any("RuntimeError" in f["message"] for f in run["findings"])


def test_the_readme_names_the_switch_mlflow_3_needs_for_the_store_the_report_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh user's MLFlowLogger raised under MLflow 3 (its default `./mlruns` is a file store, the only MLflow
    store the report reads); docs/report.md said why, the README's logger table, read first, did not. The README
    says it while MLflow still needs it."""
    if int(mlflow.__version__.split(".")[0]) < 3:
        pytest.skip("MLflow before 3 opens a file store without a switch")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(mlflow.exceptions.MlflowException, match="MLFLOW_ALLOW_FILE_STORE"):
        MLFlowLogger(experiment_name="switch", tracking_uri=f"file:{tmp_path}/mlruns")
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    loggers = readme.split("What each logger gets", 1)[1].split("\n## ", 1)[0]
    assert "`MLFLOW_ALLOW_FILE_STORE=true`" in loggers
