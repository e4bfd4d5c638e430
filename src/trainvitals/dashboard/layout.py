"""The trainvitals dashboard layout: the TensorBoard custom-scalars charts of a run.

TensorBoard's Custom Scalars dashboard draws charts whose lines are picked by tag regexes (matched
from the start of the tag with Python's ``re.match``); the layout is a ``layout_pb2.Layout`` written
once into the event file under the ``custom_scalars__config__`` tag. :data:`TRAINVITALS_LAYOUT` is
that layout: the story of a run on one page, whichever callbacks were attached — a chart whose tags
were never logged stays empty and harmless.

The layout proto has no y-scale field: the log scale of the gradient-norm chart is the chart's own
"Toggle y-axis log scale" button (the browser test turns it on for the README screenshot).
"""

from __future__ import annotations

from typing import Any

from trainvitals.dashboard.tags import MEMORY_BYTES, PER_LAYER_GRAD_NORM, grad_norm

CATEGORY = "trainvitals"

TRAINVITALS_LAYOUT: dict[str, dict[str, list[Any]]] = {
    CATEGORY: {
        "gradient norm vs noise floor (use the log-scale toggle)": [
            "Multiline",
            [grad_norm("total"), grad_norm("clipped_total"), grad_norm("noise_floor"), grad_norm("noise_floor_se"),
             grad_norm("measured_total")],
        ],
        "in the noise band (1 = yes)": ["Multiline", [grad_norm("in_noise_band")]],
        "B_simple vs effective batch (examples)": [
            "Multiline",
            [r"grad_noise/b_simple$", r"lr_scaling/(?:effective_batch|b_noise)$"],
        ],
        "per-layer gradient norm": ["Multiline", [PER_LAYER_GRAD_NORM]],
        "per-layer GSNR": ["Multiline", [r"grad_noise/gsnr/.+"]],
        "gradient noise: tr(Σ), ‖G‖², evidence criterion": [
            "Multiline",
            [r"grad_noise/(?:trace_cov|grad_sq_norm)(?:_se)?$", r"grad_noise/(?:eb_criterion|coverage|b_simple_rel_err|b_simple_unreliable)$"],
        ],
        "memory by category (bytes)": ["Multiline", [MEMORY_BYTES]],
        "saved activations per module (bytes)": ["Multiline", [r"memory/activations/.+"]],
        "integrity counters": [
            "Multiline",
            [grad_norm("nonfinite_steps"), grad_norm("amp_skipped_steps"), grad_norm("spike_steps"), r"graph/.+"],
        ],
        "learning rate and its suggestion": ["Multiline", [r"lr-.+", r"lr_scaling/(?:lr|suggested_lr_[^/]+)/.+"]],
        "steps and examples over their minimum": ["Multiline", [r"lr_scaling/(?:steps|examples)_over_min$"]],
    }
}
"""``SummaryWriter.add_custom_scalars`` layout: {category: {chart title: ["Multiline", [tag regexes]]}}.

The ``lr-.+`` line is Lightning's ``LearningRateMonitor``; everything else is a trainvitals callback.
"""
