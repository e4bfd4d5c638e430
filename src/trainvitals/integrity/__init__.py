"""Graph integrity: the autograd graph behind each loss, and what is wrong in it, in plain words.

The callback is :class:`~trainvitals.integrity.callback.GraphIntegrityCallback` (:mod:`.callback`): it runs
the check windows and calls each check's hooks. Each check is one file in :mod:`.checks` (a loss without
``grad_fn``, unreachable or dead parameters, leaves outside the optimizer, graphs carried across steps, a
param group at lr 0, examples mixed across the batch, autograd's classic errors). The torch-only analysis:

- :mod:`.graph`: walks of ``loss.grad_fn`` to its leaves, naming, saved-tensor errors;
- :mod:`.tracer`: re-runs a failing step to find where a value left the graph or was modified in place;
- :mod:`.diagnoses`: what the walks conclude — streaks, reasons, the diagnoses of autograd's errors;
- :mod:`.findings`: the finding kinds, one row each (counter, window metric, the report's message); no torch
  import, so that ``trainvitals report`` reads it too.
"""
