"""The metric tags the callbacks write, as the dashboard and the report read them.

The callbacks own their tags; this module only names what the readers look for, so that the
custom-scalars layout and ``trainvitals report`` agree with each other. Kept free of Lightning and
TensorBoard imports so that the report command starts quickly.

Scalar tags are ``<prefix>/<name>``; with several optimizers :class:`GradNormMonitor` inserts
``optimizer_<i>/`` after ``grad_norm/``. TensorBoard text panels written through ``SummaryWriter.add_text``
are stored under ``<tag>/text_summary``.
"""

from __future__ import annotations

import re

OPTIMIZER_INFIX = r"(?:optimizer_\d+/)?"
"""Matches the ``optimizer_<i>/`` infix GradNormMonitor adds when the module has several optimizers."""

GRAD_NORM_SUMMARIES = (
    "total",
    "clipped_total",
    "noise_floor",
    "noise_floor_se",
    "measured_total",
    "in_noise_band",
    "band_streak",
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

MEMORY_BYTES = r"memory/[^/]+_bytes$"
"""MemoryTopologyProfiler's byte counts by category (parameters, gradients, optimizer state, inputs, saved
activations, held after backward; CUDA peaks and temporaries), logged as ``memory/<category>_bytes``."""

DIAGNOSIS_TAG = "trainvitals/diagnosis"
"""Text panels ``trainvitals/diagnosis/<callback class>`` hold each callback's end-of-run markdown."""
