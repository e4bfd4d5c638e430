"""Gradient norms: how large the gradient is, in total and per layer, and when it spikes or goes non-finite.

The callback is :class:`~trainvitals.norms.monitor.GradNormMonitor` (:mod:`.monitor`); the math is torch-only:

- :mod:`.fused`: per-tensor, per-group and total p-norms over many tensors in one fused ``torch._foreach_norm``
  per dtype, without a host sync, DTensor shards included;
- :mod:`.spikes`: a value far above its running EMA, found in host floats at a logging step;
- :mod:`.nonfinite`: the count of optimizer steps whose gradient held inf/NaN, for the callbacks that see
  the gradient without a GradNormMonitor.
"""
