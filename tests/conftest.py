"""Shared test helpers: a logger that records what callbacks write, and tiny data."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: ``series[tag]`` is a list of ``(step, value)``, ``calls`` the
    tags of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.calls: list[set[str]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(set(metrics))
        for k, v in metrics.items():
            self.series[k].append((step, float(v)))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, tag: str) -> list[float]:
        return [v for _, v in self.series.get(tag, [])]


@pytest.fixture
def recording_logger() -> RecordingLogger:
    return RecordingLogger()


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Quiet, fast, CPU Trainer settings for tests."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=False,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
