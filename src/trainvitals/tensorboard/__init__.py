"""What TensorBoard shows of a run: the trainvitals dashboard.

- :mod:`.layout`: the custom-scalars layout — one quantity a chart, the noise band as a margin chart, a
  per-layer chart per top-level module — built from the tags of :mod:`trainvitals.tags`;
- :mod:`.dashboard`: :class:`~trainvitals.tensorboard.dashboard.TrainvitalsDashboard`, which writes the layout at
  fit start, each callback's end-of-run diagnosis as a text panel, and the grad norm and ``band_ratio`` to the
  progress bar.
"""
