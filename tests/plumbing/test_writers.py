"""The shared writer: one TensorBoard event per logging step, read back with TensorBoard's own reader;
the same values in ``trainer.callback_metrics`` for Lightning's own callbacks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _models import Regressor, ReleaseProcessGroup, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.plumbing.writers import histogram_summary, log_scalars


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
        "fold1-grad_norm/total": 3.5,
        "fold1-grad_norm/a": 0.25,
        "fold1-x": 2.0,
    }
    # Other loggers get the same values through their own log_metrics.
    assert recording.series["grad_norm/total"] == [(7, 3.5), (8, 1.0)]


def test_a_value_left_out_of_the_charts_is_not_left_stale_in_callback_metrics() -> None:
    """An interval's end that becomes unbounded (inf) or a point that becomes undefined (NaN) is left out of the
    loggers but reaches ``trainer.callback_metrics`` as such: a ModelCheckpoint reading it never gets the last
    finite value of an earlier step."""
    recording = RecordingLogger()
    trainer = SimpleNamespace(
        loggers=[recording], global_rank=0, _logger_connector=SimpleNamespace(_callback_metrics={})
    )
    log_scalars(trainer, {"b_simple": torch.tensor(120.0), "b_simple_high": 900.0}, step=0, finite_only=True)
    returned = log_scalars(
        trainer, {"b_simple": torch.tensor(float("nan")), "b_simple_high": math.inf}, step=1, finite_only=True
    )
    metrics = {k: float(v) for k, v in trainer._logger_connector._callback_metrics.items()}
    assert returned == {} and math.isnan(metrics["b_simple"]) and metrics["b_simple_high"] == math.inf
    assert recording.series == {"b_simple": [(0, 120.0)], "b_simple_high": [(0, 900.0)]}


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


class _Seen(pl.Callback):
    """What ``trainer.callback_metrics`` holds at the end of each batch, after the trainvitals callbacks."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if "grad_norm/total" in trainer.callback_metrics:
            self.seen[trainer.global_step - 1] = float(trainer.callback_metrics["grad_norm/total"])


def test_lightning_checkpoint_and_early_stopping_monitor_a_trainvitals_metric(tmp_path: Path) -> None:
    recording, seen = RecordingLogger(), _Seen()
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, monitor="grad_norm/total", mode="min", every_n_train_steps=1, save_top_k=1
    )
    # A threshold every norm is under: EarlyStopping stops at the first epoch end it checks.
    stopping = EarlyStopping(
        monitor="grad_norm/total", mode="min", stopping_threshold=1e9, check_on_train_epoch_end=True
    )
    model = Regressor()
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=recording,
            max_epochs=5,
            log_every_n_steps=3,
            enable_checkpointing=True,
            callbacks=[GradNormMonitor(histogram_every_n_steps=0), seen, checkpoint, stopping],
        )
    )
    trainer.fit(model, loader(regression_data(n=64), batch_size=8))

    logged = dict(recording.series["grad_norm/total"])
    assert {0, 3, 6} <= set(logged)  # 8 steps, one epoch, every third (and the monitor's last step)
    # At each logged step Lightning sees the value just logged (the module's brute-force norm of that
    # step); between them, the last one logged.
    assert len(seen.seen) == 8
    for step, value in seen.seen.items():
        assert value == pytest.approx(logged[max(s for s in (0, 3, 6) if s <= step)], rel=1e-6)
    assert list(logged.values()) == pytest.approx([model.reference_norms[s] for s in logged], rel=1e-5)
    # The monitor logs the last step at train end: that too reaches callback_metrics.
    assert float(trainer.callback_metrics["grad_norm/total"]) == pytest.approx(logged[7], rel=1e-6)
    assert stopping.stopped_epoch == 0 and trainer.current_epoch == 1
    assert float(checkpoint.best_model_score) == pytest.approx(min(seen.seen.values()), rel=1e-6)
    assert Path(checkpoint.best_model_path).is_file()


class _MetricsPerRank(pl.Callback):
    """Writes what each rank's ``trainer.callback_metrics`` held for the monitor's tag to ``<dir>/rank<k>.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if "grad_norm/total" in trainer.callback_metrics:
            self.seen.append(float(trainer.callback_metrics["grad_norm/total"]))

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        stopping = next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"seen": self.seen, "epoch": trainer.current_epoch, "stopped_epoch": stopping.stopped_epoch})
        )


@pytest.mark.slow
def test_early_stopping_on_a_trainvitals_metric_under_ddp(tmp_path: Path) -> None:
    callbacks = [
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        _MetricsPerRank(str(tmp_path)),
        EarlyStopping(monitor="grad_norm/total", mode="min", stopping_threshold=1e9, check_on_train_epoch_end=True),
        ReleaseProcessGroup(),
    ]
    trainer = pl.Trainer(
        **trainer_kwargs(strategy="ddp_spawn", devices=2, callbacks=callbacks, max_epochs=4, log_every_n_steps=1)
    )
    trainer.fit(Regressor(), loader(regression_data(n=64), batch_size=8))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Every rank has the value (the norm of the all-reduced gradient: the same on both), and both stop together.
    assert len(ranks[0]["seen"]) == 4 and ranks[0]["seen"] == pytest.approx(ranks[1]["seen"], rel=1e-6)
    assert ranks[0]["stopped_epoch"] == ranks[1]["stopped_epoch"] == 0 and ranks[0]["epoch"] == ranks[1]["epoch"] == 1


def test_histogram_summary_counts_every_finite_value_of_several_tensors() -> None:
    """Bounded-memory histogram of a group's gradients against numpy on their concatenation."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(40, 7, generator=g), 3 * torch.randn(13, generator=g), torch.randn(5, 5, generator=g).half()]
    parts[1][4] = float("nan")
    parts[0][2, 3] = float("inf")
    summary = histogram_summary(parts, bins=16)
    flat = np.concatenate([p.float().reshape(-1).numpy() for p in parts])
    flat = flat[np.isfinite(flat)].astype(np.float64)
    counts, edges = np.histogram(flat, bins=16, range=(flat.min(), flat.max()))
    assert summary["num"] == flat.size == sum(summary["bucket_counts"])
    assert (summary["min"], summary["max"]) == pytest.approx((flat.min(), flat.max()))
    assert summary["bucket_limits"] == pytest.approx(edges[1:].tolist())
    assert np.abs(np.array(summary["bucket_counts"]) - counts).sum() <= 2  # float32 edge rounding at most
    assert summary["sum"] == pytest.approx(flat.sum(), rel=1e-5)
    assert summary["sum_squares"] == pytest.approx((flat**2).sum(), rel=1e-5)
    assert histogram_summary([torch.full((3,), float("nan"))]) is None


def test_histogram_summary_reads_the_host_three_times_whatever_the_tensors(monkeypatch) -> None:
    """Which tensors hold non-finite values, the range, and the counts with Σv and Σv²: one read each."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    summary = histogram_summary([torch.randn(30), torch.randn(4, 5), torch.tensor([1.0, float("inf")])], bins=8)
    monkeypatch.undo()
    assert reads == ["tolist"] * 3 and summary["num"] == 51 and sum(summary["bucket_counts"]) == 51
