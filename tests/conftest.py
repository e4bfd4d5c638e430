"""Shared test helpers: a logger that records what callbacks write, and tiny data."""

from __future__ import annotations

import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
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


_ROOT = tempfile.mkdtemp(prefix="trainvitals-tests-")
"""The Trainers' ``default_root_dir``: what a run without a logger writes (``skip_batches.json``) stays out of the
checkout."""


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Quiet, fast, CPU Trainer settings for tests."""
    kwargs: dict[str, Any] = dict(
        default_root_dir=_ROOT,
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


CHECKOUT = Path(__file__).resolve().parents[1]


def _root_entries() -> set[str]:
    """The names in the checkout's root, less the dot-names: a tool's cache (``.pytest_cache``, ``.ruff_cache``),
    made by whatever else runs there meanwhile."""
    return {name for name in os.listdir(CHECKOUT) if not name.startswith(".")}


@pytest.fixture(scope="session")
def _checkout_entries() -> set[str]:
    """What the checkout's root holds before the first test."""
    return _root_entries()


@pytest.fixture(autouse=True)
def _nothing_left_in_the_checkout(_checkout_entries: set[str]) -> Iterator[None]:
    """A test that leaves a file in the checkout's root (a Trainer's ``skip_batches.json`` or ``lightning_logs``
    from a fit outside :func:`trainer_kwargs`, or a subprocess run in the working directory) errors at its teardown,
    named; one listing of the root per test. The file stays for a look, blamed on that test alone."""
    yield
    if left := _root_entries() - _checkout_entries:
        _checkout_entries |= left
        pytest.fail(
            f"left {', '.join(sorted(left))} in the checkout's root {CHECKOUT}: write under tmp_path, or give a "
            "Trainer trainer_kwargs()'s default_root_dir (a subprocess's Trainer its own)"
        )


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")
"""The Tensor methods that read a value on the host: on a device each is a sync."""


class HostReads:
    """Counts host reads of tensors (:data:`HOST_READS`) made while :attr:`watching` is set, as
    ``(watching, method)`` in :attr:`reads`; installed on ``torch.Tensor`` with ``monkeypatch``.

    Autograd's CPU scalars that ``detect_loss_reduction`` reads (a Python divisor, no device sync) are not
    counted.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[Any, str]] = []
        self.watching: Any = None
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if self.watching is not None and not sys._getframe(1).f_code.co_filename.endswith("loss_reduction.py"):
                    self.reads.append((self.watching, _name))
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def watch(self, callback: Any, hooks: tuple[str, ...]) -> None:
        """Watch ``callback``'s ``hooks``: inside each, :attr:`watching` is the trainer's ``global_step``."""
        for hook in hooks:
            original = getattr(callback, hook)

            def wrapped(trainer, *args, _original=original, **kwargs):
                self.watching = trainer.global_step
                try:
                    return _original(trainer, *args, **kwargs)
                finally:
                    self.watching = None

            setattr(callback, hook, wrapped)


FAST_FILES = frozenset(
    {
        "test_fused_norms.py",
        "test_spikes.py",
        "test_clipping.py",
        "test_estimators.py",
        "test_estimate.py",
        "test_gsnr.py",
        "test_outliers.py",
        "test_rules.py",
        "test_per_example_core.py",
        "test_lr_rules.py",
        "test_graph.py",
        "test_diagnoses.py",
        "test_checks.py",
        "test_memory_core.py",
        "test_terminal.py",
        "test_interval_words.py",
        "test_decision.py",
        "test_activation_stats.py",
        "test_update_measure.py",
        "test_base.py",
        "test_sharing.py",
        "test_docs.py",
        "test_loss_progress.py",
    }
)
"""The edit loop's subset, ``pytest -m fast`` (under a minute): the torch-only math of every feature against its
brute force or closed form, plain tensors and no Trainer, plus the sharing hub and the docs' code blocks. A test
of these files marked ``slow`` (a fit, a subprocess, a Monte Carlo over hundreds of seeds) runs in the whole suite
only."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in FAST_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
