"""Gradient noise: how much of a mini-batch gradient is noise, and when a run has reached its noise band.

E‖ḡ_B‖² = ‖G‖² + tr(Σ)/B (McCandlish et al. 2018, Eq. A.1; docs/science.md §3). The torch-only math:

- :mod:`.estimators`: the two-batch-size estimators of ‖G‖² and tr(Σ), bias-corrected EMAs, B_simple, the
  noise level sqrt(tr(Σ)/B), and the hooks that read each micro-batch's gradient;
- :mod:`.estimate`: the run's one :class:`~trainvitals.noise.estimate.GradientNoise`, every source's EMAs
  and sampling variances combined by inverse-variance weighting, with standard errors;
- :mod:`.gsnr`: per-module gradient signal-to-noise ratios and the EB criterion, within a coordinate budget;
- :mod:`.outliers`: the examples with the largest per-example gradient norms.

The callbacks: :class:`~trainvitals.noise.probe.BatchVarianceProbe` (:mod:`.probe`, with its sources in
:mod:`.probe_sources` and one measured step in :mod:`.probe_step`; per-example norms from
:mod:`trainvitals.per_example`) and :class:`~trainvitals.noise.stopper.GradNormEarlyStopping`
(:mod:`.stopper`), which stops a run that has stayed in its noise band.
"""
