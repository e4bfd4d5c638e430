"""The noise callbacks' fused per-step paths give the numbers and decisions of the straightforward ones.

The reference is the same code with each fused step replaced by the plain computation it stands for (every
window's EMAs updated one at a time, each value bias-corrected on its own, :meth:`NoiseSource.choice` computed
afresh at every call): a fit with the stopper (and a probe) must log the same values at the same steps and stop at
the same step. The per-step paths' kernel counts are pinned too: they are the host cost on a small model.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from test_stopper import converging, regression_stream
from torch.utils._python_dispatch import TorchDispatchMode

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping
from trainvitals.noise import estimate as estimate_module
from trainvitals.noise import estimators as estimators_module
from trainvitals.noise.estimate import _VERSIONS, GradientNoise, NoiseSource, _pick
from trainvitals.noise.estimators import effective_count, t_quantile


def _reference_update(self, grad_sq_norm, trace_cov, valid=True, covered_sq_norm=None, total_sq_norm=None):
    """NoiseSource.update as each window's own update, one after the other."""
    self.version = next(_VERSIONS)
    for ema, error in self.windows:
        ema.update(grad_sq_norm, trace_cov, valid)
        error.update(grad_sq_norm, trace_cov, valid)
    if covered_sq_norm is not None and total_sq_norm is not None:
        pair = torch.stack([covered_sq_norm.detach().double(), total_sq_norm.detach().double()])
        self._norms.update(pair, valid)
        self.last_covered_sq_norm = pair[0]


def _reference_slow_moments(self):
    ema, error = self.windows[self.band_window]
    var_s, var_g, cov = error.mean_covariance(ema)
    g, t = ema.values.unbind()
    return g, t, var_g, var_s, cov, effective_count(ema.beta, ema.count)


def _reference_smoothed(self):
    values, per_step, cross, lag_sq, chosen, overlap = self.choice()
    g_i, s_i = chosen.unbind()
    g, t = _pick(values[:, 0], g_i), _pick(values[:, 1], s_i)
    var_g = _pick(per_step[:, 0], g_i) * overlap[g_i, g_i] + _pick(lag_sq[:, 0], g_i)
    var_s = _pick(per_step[:, 1], s_i) * overlap[s_i, s_i] + _pick(lag_sq[:, 1], s_i)
    cross = _pick(cross, torch.maximum(g_i, s_i)) * overlap[g_i, s_i]
    cov = torch.where(torch.isfinite(var_g * var_s), cross, 0.0)
    n_eff = 1.0 / torch.maximum(overlap[g_i, g_i], overlap[s_i, s_i]).clamp_min(1e-300)
    return g, t, var_g, var_s, cov, torch.where(self.ema.count > 0, n_eff, 0.0)


def _reference_band_values(self):
    values, _, _, _, chosen, _ = self.choice()
    g_i, s_i = chosen.unbind()
    return torch.stack([_pick(values[:, 0], g_i), _pick(values[:, 1], s_i), values[self.band_window, 0]])


def _reference_t_quantile(z, dof):
    """Student's t quantile (Cornish–Fisher) with z a tensor on the device, every term a tensor operation."""
    dof = torch.as_tensor(dof, dtype=torch.float64)
    z = torch.as_tensor(z, dtype=torch.float64, device=dof.device)
    nu = dof.clamp_min(1e-300)
    z3, z5 = z**3, z**5
    t = z + (z3 + z) / (4 * nu) + (5 * z5 + 16 * z3 + 3 * z) / (96 * nu**2)
    return torch.where(dof > 0, t, torch.full_like(t, float("inf")))


def test_t_quantile_of_a_constant_is_that_of_the_tensor_computation():
    dof = torch.cat(
        [torch.linspace(-1, 200, 2011, dtype=torch.float64), torch.logspace(2, 6, 500, dtype=torch.float64)]
    )
    for z in (estimate_module.Z90, estimate_module.AGREEMENT_Z, estimate_module.COUPLING_Z):
        assert torch.equal(t_quantile(z, dof), _reference_t_quantile(z, dof))
        assert all(torch.equal(t_quantile(z, d), _reference_t_quantile(z, d)) for d in dof[::37])


def _straightforward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace every fused per-step path by the plain computation."""
    fresh_choice = NoiseSource.choice

    def choice(self):
        self._choice = None  # no reuse within a step
        return fresh_choice(self)

    monkeypatch.setattr(NoiseSource, "update", _reference_update)
    monkeypatch.setattr(NoiseSource, "choice", choice)
    monkeypatch.setattr(NoiseSource, "slow_moments", _reference_slow_moments)
    monkeypatch.setattr(NoiseSource, "smoothed", _reference_smoothed)
    monkeypatch.setattr(NoiseSource, "band_values", _reference_band_values)
    monkeypatch.setattr(estimate_module, "t_quantile", _reference_t_quantile)
    monkeypatch.setattr(estimators_module, "t_quantile", _reference_t_quantile)
    monkeypatch.setattr(estimate_module, "stacked_values", lambda emas, betas: torch.stack([e.value for e in emas]))


def _core_run(seed: int) -> list[torch.Tensor]:
    """A source fed a seeded sequence (with a non-finite and an invalid step): everything it states, per step."""
    gen = torch.Generator().manual_seed(seed)
    src, out = NoiseSource("probe", 0.98, steps_per_update=2), []
    for step in range(150):
        g = torch.randn((), generator=gen, dtype=torch.float64) + 0.3 * math.exp(-step / 40)
        s = 4 + torch.randn((), generator=gen, dtype=torch.float64).abs()
        if step == 7:
            g = torch.tensor(float("nan"), dtype=torch.float64)
        valid = torch.tensor(step != 11)
        src.update(g, s, valid, covered_sq_norm=s / 3, total_sq_norm=s / 2)
        out += [*src.choice(), *src.smoothed(), *src.slow_moments(), src.band_values(), src.band_drift()]
        out += [ema.values for ema, _ in src.windows] + [error.moments for _, error in src.windows]
        out += [src.ema.count, src.error._moments.count, src.norm_share]
    return out


def test_a_source_states_what_the_straightforward_computation_does(monkeypatch):
    fused = _core_run(0)
    _straightforward(monkeypatch)
    reference = _core_run(0)
    assert len(fused) == len(reference)
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b) or torch.allclose(a, b, rtol=1e-12, atol=0, equal_nan=True), (i, a, b)


def _stopper_fit(probe: bool) -> tuple[dict[str, list], int | None]:
    torch.manual_seed(0)
    stopper = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=3, verbose=False)
    callbacks = [BatchVarianceProbe(histogram_every_n_steps=0), stopper] if probe else [stopper]
    logger = RecordingLogger()
    trainer = Trainer(
        **trainer_kwargs(
            callbacks=callbacks, logger=logger, max_epochs=1, accumulate_grad_batches=4, log_every_n_steps=2
        )
    )
    trainer.fit(converging(10), regression_stream(1200, 16, 10, torch.zeros(10), 1.0))
    return dict(logger.series), stopper.stopped_step


@pytest.mark.parametrize("probe", [False, True], ids=["micro_batches", "with_a_probe"])
def test_a_fit_logs_and_stops_as_the_straightforward_computation_does(monkeypatch, probe):
    fused, stop = _stopper_fit(probe)
    _straightforward(monkeypatch)
    reference, reference_stop = _stopper_fit(probe)
    assert stop is not None and stop == reference_stop
    assert fused.keys() == reference.keys() and any(k.startswith("grad_noise/") for k in fused)
    for tag, series in reference.items():
        assert [s for s, _ in fused[tag]] == [s for s, _ in series], tag
        assert [v for _, v in fused[tag]] == pytest.approx([v for _, v in series], rel=1e-9, abs=0), tag


class _Kernels(TorchDispatchMode):
    """Counts the tensor operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _kernels(run) -> int:
    with _Kernels() as kernels:
        run()
    return kernels.count


def test_the_per_step_paths_run_a_bounded_number_of_kernels():
    """The host cost on a small model is the number of tensor operations: the micro-batch source's update, the
    per-step band, a full estimate and the disagreement check of a lone micro-batch source (nothing to check: no
    transfer). Before the fused paths: 81, 124, 783 and 250."""
    gen = torch.Generator().manual_seed(0)
    noise, src = GradientNoise(), NoiseSource("micro_batch", 0.98)
    src.effective_batch_size = 48
    noise.attach(src)
    step = [torch.randn((), generator=gen, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)]
    for _ in range(30):
        src.update(step[0] * torch.rand((), generator=gen), step[1], torch.tensor(True))
    noise.estimate()
    assert _kernels(lambda: src.update(*step, torch.tensor(True))) <= 45
    assert _kernels(lambda: noise.in_noise_band(0.2)) <= 105
    assert _kernels(noise.estimate) <= 600
    assert _kernels(noise.disagreement) == 0
