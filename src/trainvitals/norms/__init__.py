"""Gradient norms: how large the gradient is, in total and per layer, and when it spikes or goes non-finite.

The callback is :class:`~trainvitals.norms.monitor.GradNormMonitor` (:mod:`.monitor`); the math is torch-only:

- :mod:`trainvitals.fused_norms` (below every feature: the sharing hub takes the step's norms with it):
  per-tensor, per-group and total p-norms in one fused ``torch._foreach_norm`` per dtype, no host sync;
- :mod:`.spikes`: a value far above its running EMA, found in host floats at a logging step;
- :mod:`.clipping`: the Trainer's clipping by norm, its factor on a step, and when it binds on most steps (read by the
  report too: torch- and Lightning-free);
- :mod:`.nonfinite`: the count of optimizer steps whose gradient held inf/NaN, for the callbacks that see
  the gradient without a GradNormMonitor, and the one re-run that names the module that produced the first;
- :mod:`.producer`: that module (or backward node, or optimizer step), from finiteness flags on every
  module's output or from ``torch.autograd.detect_anomaly`` (below TrainingGuard, which imports it).
"""
