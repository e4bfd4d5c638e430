"""Issue #24's BatchNorm digits case: the chart said "in the band" while ``grad_norm/in_noise_band`` stayed 0.

Under BatchNorm in training mode the per-example gradients are coupled, so the probe measures every parameter from
the micro-batches of accumulation (the stopper's source), and no per-example truth exists (tests/noise/_truth.py
refuses it). What can be checked is that what the charts draw and what the stopper decides are one smoothed
quantity: the band chart's series (tensorboard/layout.py ``BAND_TAGS``) put the smoothed norm inside the band exactly
at the steps ``in_noise_band`` is 1, and their noise level is the gradient-norm chart's.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from _truth import Classifier, digits_train
from conftest import RecordingLogger, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping, GradNormMonitor
from trainvitals.tensorboard.layout import BAND_TAGS

STEPS, EVERY = 250, 10


def test_the_band_chart_and_the_decision_read_one_smoothed_quantity_under_batchnorm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    probe = BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False)
    stopper = GradNormEarlyStopping(min_steps=10**6, verbose=False)  # decides the band at every step, never stops
    logger = RecordingLogger()
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            callbacks=[GradNormMonitor(), probe, stopper],
            max_steps=STEPS,
            accumulate_grad_batches=4,
            log_every_n_steps=EVERY,
        )
    )
    trainer.fit(Classifier(net, lr=1e-2), DataLoader(TensorDataset(*digits_train()), batch_size=16, shuffle=True))
    assert "BatchNorm (net.2)" in probe.sources and "micro-batches" in probe.sources
    assert [s.name for s in probe.gradient_noise.valid_sources()] == ["micro_batch"]

    series = {tag: dict(values) for tag, values in logger.series.items()}
    decided = series["grad_norm/in_noise_band"]
    norm, floor, edge = (series[tag] for tag in BAND_TAGS)
    assert set(norm) == set(floor) == set(edge) == set(decided) and len(decided) >= STEPS // EVERY - 3
    for step, in_band in decided.items():
        # The band chart's noise level is the gradient-norm chart's, and its smoothed norm is inside the shade
        # (at most the band's edge) exactly where the stopper decides "in the band".
        assert floor[step] == pytest.approx(series["grad_norm/noise_floor"][step], rel=1e-12)
        ratio = series["grad_norm/band_ratio"][step]
        assert math.isclose(norm[step] ** 2, floor[step] ** 2 * (1 + stopper.margin * ratio), rel_tol=1e-9)
        if abs(ratio - 1) > 1e-9:
            assert in_band == float(norm[step] <= edge[step]) == float(ratio <= 1)
    assert {0.0, 1.0} <= set(decided.values())  # the run enters the band: both sides are checked
