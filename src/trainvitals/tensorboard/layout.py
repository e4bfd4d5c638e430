"""The trainvitals dashboard layout: the TensorBoard custom-scalars charts of a run.

TensorBoard's Custom Scalars dashboard draws charts whose lines are picked by tag regexes (matched
from the start of the tag with Python's ``re.match``); the layout is a ``layout_pb2.Layout`` written
once into the event file under the ``custom_scalars__config__`` tag. :func:`trainvitals_layout` builds
it: the story of a run on one page, whichever callbacks were attached — a chart whose tags were never
logged stays empty and harmless.

Readable at a glance within what the plugin offers: every line of a chart takes the run's colour, so a
chart holds one quantity (or lines of one scale that are told apart by the chart itself: the smoothed norm
inside its band is a margin chart, the shaded band from the noise level to the band's edge); quantities whose
scales differ by orders of magnitude (tr(Σ) ~100, ‖G‖² ~0.01) get a chart each; the per-layer norms get
one chart per top-level module (a parameter of the LightningModule itself is one), the per-layer GSNR one chart:
which layers have a GSNR the probe's sources decide during the fit, not the module tree at its start.
The layout proto has no y-scale field: the log scale is the chart's own
"Toggle y-axis log scale" button, and TensorBoard's "Ignore outliers in chart scaling" (on by default, in
the settings) clips a chart's extremes: the title of a chart it hides (a 0/1 flag, a streak of a few
steps) says to turn it off; docs/callbacks/dashboard.md says when else.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from trainvitals.fused_norms import group_name
from trainvitals.tags import (
    MEMORY_BYTES,
    OPTIMIZER_INFIX,
    PER_LAYER_GRAD_NORM,
    activation,
    grad_norm,
    update,
    with_prefix,
)

CATEGORY = "trainvitals"
BAND_CATEGORY = "trainvitals: the gradient norm in its noise band"
"""The margin chart's own category: TensorBoard draws a category's margin charts after its multiline ones, so
the chart that says most comes first only in a category of its own."""
MAX_LAYER_CHARTS = 8
"""Beyond this many top-level modules, the per-layer norms share one chart (the histograms tab shows them too)."""

GRAD_NORM_CHART = (
    "gradient norm ‖ḡ‖ per step, its expected RMS sqrt(‖G‖² + tr Σ/B), and the noise level sqrt(tr Σ/B) "
    "(the RMS norm of pure noise: single steps fall below it often)"
)
BAND_CHART = (
    "smoothed gradient norm sqrt(‖G‖² + tr Σ/B), what the stop decides on, and its noise band (shaded: the noise "
    "level sqrt(tr Σ/B) to the band's edge; in the band below the edge; Toggle y-axis log scale to see it whole)"
)
BAND_TAGS = ("grad_norm/band_norm", "grad_norm/band_floor", "grad_norm/band_edge")
"""The margin chart's value, lower and upper series, which GradNormEarlyStopping logs at the same steps (a margin
chart whose three series' steps differ is not drawn): exact tags (single optimizer), not regexes."""
OUTLIERS_OFF = "turn off Ignore outliers in chart scaling (settings), on by default, or its few high points are cut"
"""Said in the title of a chart that TensorBoard's default scaling hides (a 0/1 flag, a short streak)."""
IN_BAND_CHART = (
    f"in the noise band (1 = yes), and held from the start (1: a full streak not stopped on): {OUTLIERS_OFF}"
)
STREAK_CHART = f"steps in a row in the noise band (the stop comes at its patience): {OUTLIERS_OFF}"


def _charts(groups: Sequence[str]) -> dict[str, list[Any]]:
    charts: dict[str, list[Any]] = {
        GRAD_NORM_CHART: [
            "Multiline",
            [
                grad_norm("total"),
                grad_norm("clipped_total"),
                r"grad_noise/expected_batch_norm$",
                grad_norm("noise_floor"),
                grad_norm("noise_floor_se"),
                grad_norm("measured_total"),
            ],
        ],
        IN_BAND_CHART: ["Multiline", [grad_norm("in_noise_band"), grad_norm("held_from_start")]],
        STREAK_CHART: ["Multiline", [grad_norm("band_streak")]],
        "training loss's fall since its first 10 steps, a fraction of its start (below min_loss_drop no stop and no "
        "cut: a plateau the run has not left)": ["Multiline", [grad_norm("loss_drop")]],
        "smoothed ‖G‖² over the band's edge margin·tr Σ/B (≤ 1: in the noise band; a checkpoint's monitor), and its "
        "90 % interval": [
            "Multiline",
            [grad_norm("band_ratio"), grad_norm("band_ratio_low"), grad_norm("band_ratio_high")],
        ],
        "current ‖G‖² over the band's edge (each quantity's chosen window, its lag in the error; what the lr cuts "
        "quote), and its 90 % interval": ["Multiline", [r"grad_noise/band_ratio(?:_low|_high)?$"]],
        "band-driven schedule: lr scale × the scheduler's lr (BandSchedule; each cut multiplies it)": [
            "Multiline",
            [r"schedule/lr_scale$"],
        ],
        f"band-driven schedule: lr cuts so far: {OUTLIERS_OFF}": ["Multiline", [r"schedule/cuts$"]],
        "band-driven schedule: accumulate_grad_batches set by its batch growths (grow_batch=True)": [
            "Multiline",
            [r"schedule/accumulate_grad_batches$"],
        ],
        # Multiline, not Margin: a margin chart draws nothing at a step without its upper series, and B_simple's
        # high end is not logged where it is infinite (‖G‖² within its error of 0): the low end is then the news.
        "B_simple and its 90 % interval (no high end: unbounded above) vs effective batch (examples)": [
            "Multiline",
            [r"grad_noise/b_simple(?:_low|_high)?$", r"lr_scaling/(?:effective_batch|b_noise)$"],
        ],
        "gradient noise: tr(Σ) per example, its standard error and 90 % interval": [
            "Multiline",
            [r"grad_noise/trace_cov(?:_se|_low|_high)?$"],
        ],
        "gradient noise: ‖G‖², the true gradient's squared norm, its standard error and 90 % interval": [
            "Multiline",
            # with δ_R, what a reshuffled epoch can add to it, which the interval's low end allows for (rule 6)
            [r"grad_noise/grad_sq_norm(?:_se|_low|_high)?$", r"grad_noise/reshuffle_excess$"],
        ],
        "noise estimate: effective number of measurements behind it": [
            "Multiline",
            [r"grad_noise/effective_measurements$"],
        ],
        "batch-gradient variance at the micro-batch and the full batch (Var ∝ 1/B)": [
            "Multiline",
            [r"grad_noise/batch_grad_var/(?:micro_batch|full_batch)$"],
        ],
        "gradient noise: evidence-based criterion (stop when > 0)": ["Multiline", [r"grad_noise/eb_criterion$"]],
        "noise estimate: coverage, unmeasured tr(Σ) bound, B_simple's relative error, unreliable (1 = yes)": [
            "Multiline",
            [r"grad_noise/(?:coverage|unmeasured_trace_share|b_simple_rel_err|b_simple_unreliable)$"],
        ],
    }
    if 0 < len(groups) <= MAX_LAYER_CHARTS:
        for group in groups:
            module = re.escape(group)
            charts[f"per-layer gradient norm: {group}"] = [
                "Multiline",
                [rf"grad_norm/{OPTIMIZER_INFIX}{module}(?:\.[^/]+)?$"],
            ]
    else:
        charts["per-layer gradient norm"] = ["Multiline", [PER_LAYER_GRAD_NORM]]
    charts["per-layer GSNR"] = ["Multiline", [r"grad_noise/gsnr/.+"]]
    charts.update(
        {
            "memory by category (bytes)": ["Multiline", [MEMORY_BYTES]],
            "saved activations per module (bytes)": ["Multiline", [r"memory/activations/.+"]],
            "integrity counters": [
                "Multiline",
                [grad_norm("nonfinite_steps"), grad_norm("amp_skipped_steps"), grad_norm("spike_steps"), r"graph/.+"],
            ],
            "learning rate and its suggestion": [
                "Multiline",
                [r"lr-.+", r"lr_scaling/(?:lr|base_lr|suggested_lr_[^/]+)/.+"],
            ],
            "steps and examples over their minimum": ["Multiline", [r"lr_scaling/(?:steps|examples)_over_min$"]],
            "update/weight ratio ‖Δθ‖/‖θ‖ per layer (rule of thumb: ~1e-3 per step)": [
                "Multiline",
                [update("ratio/.+"), update("total_ratio")],
            ],
            "update norm ‖Δθ‖ per layer": ["Multiline", [update("norm/.+"), update("total_norm")]],
            "cos(−Δθ, gradient) per layer (1: plain SGD)": ["Multiline", [update("grad_cosine/.+")]],
            "Adam: step per unit lr ‖m̂/(√v̂+ε)‖ per layer": ["Multiline", [update("unit_step_norm/.+")]],
            "activation rms per module": ["Multiline", [activation("rms")]],
            "activation max |x| per module": ["Multiline", [activation("abs_max")]],
            "activation kurtosis per module (3: Gaussian)": ["Multiline", [activation("kurtosis")]],
            "dead units per ReLU (share)": ["Multiline", [activation("dead_fraction")]],
            "inactive units per GELU, SiLU, ... (share)": ["Multiline", [activation("inactive_fraction")]],
        }
    )
    return charts


def trainvitals_layout(
    prefix: str = "", join_char: str = "-", groups: Sequence[str] = ()
) -> dict[str, dict[str, list[Any]]]:
    """``SummaryWriter.add_custom_scalars`` layout: {category: {chart title: [kind, tags]}}.

    Args:
        prefix: the TensorBoardLogger's ``prefix``; its tags are ``<prefix><join_char><tag>``, and so
            are the layout's regexes (and the margin chart's exact tags).
        join_char: the logger's ``LOGGER_JOIN_CHAR`` (Lightning's is ``"-"``).
        groups: the top-level groups of the parameters (``features``, ``head``, a root parameter ``pos``), as
            :func:`layer_groups` names them: one per-layer norm chart each, up to :data:`MAX_LAYER_CHARTS`;
            empty for one chart of every layer.

    A ``"Multiline"`` chart lists tag regexes; a ``"Margin"`` chart the exact tags of its value, lower and
    upper series. The ``lr-.+`` line is Lightning's ``LearningRateMonitor``; everything else a trainvitals
    callback's.
    """
    exact = prefix + join_char if prefix else ""
    band = {BAND_CHART: ["Margin", [exact + tag for tag in BAND_TAGS]]}
    charts = {
        title: [kind, [with_prefix(tag, prefix, join_char) for tag in tags]]
        for title, (kind, tags) in _charts(groups).items()
    }
    return {BAND_CATEGORY: band, CATEGORY: charts}


def layer_groups(parameter_names: Sequence[str]) -> list[str]:
    """The top-level groups of the named parameters, in order (``features.0.weight`` → ``features``; a parameter
    of the root module, ``pos``, is its own), named as GradNormMonitor names them.

    Pass ``named_parameters()``'s names: it lists a shared tensor once, under its first name, as GradNormMonitor
    does, so an output layer tied to the embedding gets no chart of its own that would stay empty.
    """
    return list(dict.fromkeys(group_name(name, "block") for name in parameter_names))


TRAINVITALS_LAYOUT = trainvitals_layout()
"""The layout without a logger prefix and with one per-layer chart: what a model-less reader expects."""
