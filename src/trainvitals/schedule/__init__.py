"""A learning-rate schedule driven by the noise band: cut the lr (or stop) when the steps have become noise.

- :mod:`.decision`: torch- and Lightning-free — what to do when the band is entered (cut, stop, nothing), the
  band's edge at the current lr, a cut's record and its line;
- :mod:`.warmup`: torch only — how many scheduler steps a user's scheduler warms up for (LinearLR, SequentialLR,
  OneCycleLR, ConstantLR, a LambdaLR such as transformers' ``get_linear_schedule_with_warmup``);
- :mod:`.callback`: :class:`~trainvitals.schedule.callback.BandSchedule`, the noise band's stopper that cuts first.
"""
