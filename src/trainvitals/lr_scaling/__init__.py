"""Batch size and learning rate: which lr another batch size needs, and what a batch costs in steps and examples.

- :mod:`.rules`: torch- and Lightning-free — the noise-aware rule (McCandlish et al. 2018, Eq. 2.6) for
  SGD-like optimizers and its square root for Adam-like ones (Malladi et al. 2022), the classic linear and
  square-root rules, S/S_min and E/E_min, optimizer families and what a summed loss means for each;
  :func:`~trainvitals.lr_scaling.rules.advise` gives the advice from plain numbers (docs/science.md §4);
- :mod:`.groups`: each param group's lr as a user sets it (a scheduler's base lr) and as its steps run now, in
  words — the one reading LRScalingAdvisor advises on and GradNormMonitor's clipping advice names;
- :mod:`.advisor`: :class:`~trainvitals.lr_scaling.advisor.LRScalingAdvisor`, which reads the run's effective
  batch, lrs, loss reduction and noise scale and applies the rules.
"""
