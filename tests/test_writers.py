"""The shared writer: one TensorBoard event per logging step, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from conftest import RecordingLogger
from trainvitals.callbacks._writers import log_scalars


def _events(log_dir: str) -> list:
    (path,) = Path(log_dir).glob("events.out.tfevents.*")
    return [e for e in LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]


def test_one_event_per_step_with_every_value_and_the_logger_prefix(tmp_path: Path) -> None:
    tensorboard = TensorBoardLogger(tmp_path, prefix="fold1")
    recording = RecordingLogger()
    trainer = SimpleNamespace(loggers=[tensorboard, recording], global_rank=0)
    metrics = {"grad_norm/total": torch.tensor(3.5, dtype=torch.float64), "grad_norm/a": torch.tensor(0.25), "x": 2}
    returned = log_scalars(trainer, metrics, step=7)
    log_scalars(trainer, {"grad_norm/total": torch.tensor(1.0)}, step=8)
    tensorboard.finalize("success")

    assert returned == {"grad_norm/total": 3.5, "grad_norm/a": 0.25, "x": 2.0}
    events = _events(tensorboard.log_dir)
    assert [e.step for e in events] == [7, 8]
    assert {v.tag: v.simple_value for v in events[0].summary.value} == {
        "fold1-grad_norm/total": 3.5, "fold1-grad_norm/a": 0.25, "fold1-x": 2.0}
    # Other loggers get the same values through their own log_metrics.
    assert recording.series["grad_norm/total"] == [(7, 3.5), (8, 1.0)]


def test_other_ranks_write_no_tensorboard_event(tmp_path: Path) -> None:
    tensorboard = TensorBoardLogger(tmp_path)
    log_scalars(SimpleNamespace(loggers=[tensorboard], global_rank=1), {"a": torch.tensor(1.0)}, step=0)
    tensorboard.experiment.flush()
    assert _events(tensorboard.log_dir) == []


def test_a_tensorboard_logger_that_overrides_log_metrics_keeps_it(tmp_path: Path) -> None:
    class Renaming(TensorBoardLogger):
        def log_metrics(self, metrics, step=None):
            super().log_metrics({f"renamed/{k}": v for k, v in metrics.items()}, step)

    tensorboard = Renaming(tmp_path)
    log_scalars(SimpleNamespace(loggers=[tensorboard], global_rank=0), {"a": torch.tensor(1.0)}, step=3)
    tensorboard.experiment.flush()
    assert [v.tag for e in _events(tensorboard.log_dir) for v in e.summary.value] == ["renamed/a"]
