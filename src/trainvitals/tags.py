"""The metric tags the callbacks write, as the dashboard and the report read them.

The callbacks own their tags; this module only names what the readers look for, so that the
custom-scalars layout and ``trainvitals report`` agree with each other. Kept free of Lightning and
TensorBoard imports so that the report command starts quickly.

Scalar tags are ``<root>/<name>``; with several optimizers :class:`GradNormMonitor` inserts
``optimizer_<i>/`` after ``grad_norm/``. TensorBoard text panels written through ``SummaryWriter.add_text``
are stored under ``<tag>/text_summary``.

A logger with a ``prefix`` puts it before every scalar it logs, joined by the logger's ``LOGGER_JOIN_CHAR``
(Lightning's ``_add_prefix``): ``TensorBoardLogger(prefix="train")`` logs ``train-grad_norm/total``. Text
panels go to the ``SummaryWriter`` itself and keep their tag. Every regex here is of the tag without that
prefix: :func:`with_prefix` puts a known prefix in front of one, :func:`split_prefix` takes an unknown one
off a tag.
"""

from __future__ import annotations

import functools
import re

TRAINVITALS_ROOTS = (
    "grad_norm",
    "grad_noise",
    "lr_scaling",
    "graph",
    "memory",
    "guard",
    "update",
    "activation",
    "schedule",
    "trainvitals",
    "diagnosis",
)
"""The first component of every tag a trainvitals callback writes (``diagnosis``: TrainvitalsDashboard's
end-of-fit panels, :data:`DIAGNOSIS_TAG`)."""

TRAINVITALS_PREFIXES = tuple(f"{root}/" for root in TRAINVITALS_ROOTS)

LOGGER_JOIN_CHAR = "-"
"""Lightning's separator between a logger's ``prefix`` and a metric key (``Logger.LOGGER_JOIN_CHAR``)."""

OPTIMIZER_INFIX = r"(?:optimizer_\d+/)?"
"""Matches the ``optimizer_<i>/`` infix GradNormMonitor adds when the module has several optimizers."""

GRAD_NORM_SUMMARIES = (
    "total",
    "clipped_total",
    "clip_lr_cut",
    "noise_floor",
    "noise_floor_se",
    "measured_total",
    "band_norm",
    "band_floor",
    "band_edge",
    "band_ratio",
    "band_ratio_low",
    "band_ratio_high",
    "in_noise_band",
    "band_streak",
    "held_from_start",
    "loss_drop",
    "nonfinite_steps",
    "amp_skipped_steps",
    "spike_steps",
)
"""Names under ``grad_norm/`` that are not a layer: every other ``grad_norm/<name>`` scalar is a layer."""

TEXT_SUFFIX = "/text_summary"


def grad_norm(name: str) -> str:
    """Regex of the ``grad_norm/<name>`` scalar for any optimizer (``name`` is taken literally)."""
    return rf"grad_norm/{OPTIMIZER_INFIX}{re.escape(name)}$"


PER_LAYER_GRAD_NORM = rf"grad_norm/{OPTIMIZER_INFIX}(?!(?:{'|'.join(GRAD_NORM_SUMMARIES)})$)(?!hist/)[^/]+$"
"""Regex of the per-layer norms ``grad_norm/<module path>``: every ``grad_norm/`` scalar but the summaries."""


def update(name: str) -> str:
    """Regex of UpdateMonitor's ``update/<name>`` scalars for any optimizer (``name`` is a regex: ``ratio/.+``)."""
    return rf"update/{OPTIMIZER_INFIX}{name}$"


def activation(stat: str) -> str:
    """Regex of ActivationMonitor's ``activation/<stat>/<module>`` scalars (``rms``, ``dead_fraction``, ...)."""
    return rf"activation/{re.escape(stat)}/.+"


MEMORY_BYTES = r"memory/[^/]+_bytes$"
"""MemoryTopologyProfiler's byte counts by category, logged as ``memory/<key>_bytes``: one for each bytes row of
``trainvitals.memory.categories.MEMORY_CATEGORIES`` (parameters, gradients, optimizer state, inputs,
saved activations, held after backward; CUDA peaks and temporaries)."""

SUGGESTED_LR = re.compile(r"suggested_lr_(?:x(?P<factor>[0-9.]+)|b(?P<size>[0-9]+))/(?P<group>.+)$")
"""LRScalingAdvisor's suggested lr under ``lr_scaling/``: at ×factor of the batch, or at batch size B, per group."""

DIAGNOSIS_TAG = "diagnosis"
"""Text panels ``diagnosis/<callback class>`` hold each callback's end-of-run markdown. TensorBoard's Text tab
groups panels by the tag's first component in name order: ``diagnosis`` comes before every other group
(``grad_noise``, ``grad_norm``, ``graph``, ``lr_scaling``, ``memory``), so the diagnoses are what it shows first."""

DIAGNOSIS_PREFIXES = (f"{DIAGNOSIS_TAG}/", "trainvitals/diagnosis/")
"""Where the diagnosis panels are, in event files of this version and of earlier ones (``trainvitals/diagnosis/``)."""


def with_prefix(pattern: str, prefix: str = "", separator: str = LOGGER_JOIN_CHAR) -> str:
    """The tag regex ``pattern`` (matched from the tag's start) for a logger that prefixes its keys with
    ``prefix`` and ``separator``; ``pattern`` itself without a prefix."""
    return f"{re.escape(prefix + separator)}(?:{pattern})" if prefix else pattern


@functools.cache
def _prefixed(separator: str) -> re.Pattern[str]:
    return re.compile(rf"(.+?){re.escape(separator)}(?=(?:{'|'.join(TRAINVITALS_ROOTS)})/)", re.DOTALL)


def split_prefix(tag: str, separator: str = LOGGER_JOIN_CHAR) -> tuple[str, str]:
    """``(prefix, key)`` of a trainvitals tag that a logger wrote as ``<prefix><separator><key>``;
    ``("", tag)`` for a trainvitals tag without prefix and for any other tag.

    The prefix is the shortest that leaves a trainvitals tag: ``"a-b-grad_norm/total"`` is
    ``("a-b", "grad_norm/total")``, since ``b-grad_norm/total`` is not one.
    """
    if tag.startswith(TRAINVITALS_PREFIXES):
        return "", tag
    match = _prefixed(separator).match(tag)
    return (match.group(1), tag[match.end() :]) if match else ("", tag)


FIT_END_TAG = "trainvitals/fit_end"
"""TrainvitalsDashboard's text panel of how the fit ended, at ``trainer.global_step``: a line starting with
:data:`FIT_ENDED` at fit end (Lightning's ``on_fit_end``, which a fit that raises never reaches), or with
:data:`FIT_RAISED` and the exception's type when it raised (``on_exception``: an error, KeyboardInterrupt).
A fit that was killed (SIGKILL, out of memory, preempted) or is still running leaves neither: its layout,
written at fit start, is all there is."""

FIT_ENDED, FIT_RAISED = "the fit ended", "the fit raised"

REPORT_HTML, REPORT_JSON = "trainvitals_report.html", "trainvitals_report.json"
"""TrainvitalsDashboard's fit-end report, written into each logger's run folder: the page ``trainvitals report
--format html`` writes, and its JSON with the run's text panels (``"record"``), which ``trainvitals report``
reads back beside a CSVLogger's ``metrics.csv`` or in an MLflow run's artifacts."""

SKIP_BATCHES_FILE = "skip_batches.json"
"""TrainingGuard's record of every event, in the Trainer's ``log_dir`` (the folder of a TensorBoardLogger's event
files, of a CSVLogger's ``metrics.csv``): ``trainvitals report`` reads it beside the run's scalars."""

GUARD_EVENT_LOG = "guard/event_log"
"""TrainingGuard's text panel: its summary line (skips, rollbacks, a stop, the producer), then its latest events."""


def mlflow_key(key: str) -> str:
    """``key`` as both MLflow and Lightning's MLFlowLogger take it: every character but ``A-Z a-z 0-9 _ - . /`` and
    space as ``_`` (``grad_norm/blocks:0`` is ``grad_norm/blocks_0``), where Lightning would drop it with a warning."""
    return _MLFLOW_OTHER.sub("_", key)


_MLFLOW_OTHER = re.compile(r"[^A-Za-z0-9_\-. /]")
