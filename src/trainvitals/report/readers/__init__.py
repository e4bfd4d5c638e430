"""The run folders ``trainvitals report`` reads besides TensorBoard's, one module a logger's format.

:func:`trainvitals.report.events.read_runs` walks LOGDIR: a folder with TensorBoard event files is read as one
(:mod:`trainvitals.report.events`); any other is offered to :data:`READERS` in order, and the first whose
``finds(files, subfolders)`` says yes makes its :class:`~trainvitals.report.events.Run` with
``read(folder, name)``. Each reads the scalars the format holds and, when the run's TrainvitalsDashboard wrote
it, the text panels from its fit-end JSON (:func:`trainvitals.report.record.read_record`), which that format
cannot hold:

- :mod:`.csv`: a CSVLogger's ``log_dir`` (``metrics.csv``);
- :mod:`.mlflow`: a run of an MLflow file store (``mlruns/<experiment>/<run>/``: ``meta.yaml`` and ``metrics/``).

A new format is a module with ``finds`` and ``read``, added here.
"""

from __future__ import annotations

from types import ModuleType

from trainvitals.report.readers import csv, mlflow

READERS: tuple[ModuleType, ...] = (csv, mlflow)


def reader_for(files: list[str], subfolders: list[str]) -> ModuleType | None:
    """The first of :data:`READERS` that finds a run in a folder holding ``files`` and ``subfolders`` (names)."""
    return next((reader for reader in READERS if reader.finds(files, subfolders)), None)
