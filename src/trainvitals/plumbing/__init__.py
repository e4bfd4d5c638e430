"""The Lightning glue every trainvitals callback shares; no feature's math lives here.

- :mod:`.base`: :class:`~trainvitals.plumbing.base.TrainvitalsCallback` — the state key, declared state, messages;
- :mod:`.state`: :class:`~trainvitals.plumbing.state.DeclaredState` — state declared with ``add_state`` (reset,
  ``state_dict``, reduction over ranks), torch only, so that the integrity checks use it without Lightning;
- :mod:`.sharing`: what the callbacks share in a fit, declared (``provides``, ``reads``) and resolved at
  setup — the step's gradient norms taken once, the run's noise estimate —, the one place that searches
  the Trainer's callback list;
- :mod:`.writers`: scalars to every logger (and ``trainer.callback_metrics``) in one transfer a step,
  histograms, text and images to TensorBoard;
- :mod:`.cadence`: which optimizer steps log; :mod:`.stopping`: when a stop request ends the fit;
- :mod:`.amp`: what the GradScaler has done to the gradients; :mod:`.sharding`: norms of the whole model
  under FSDP;
- :mod:`.batch`: a batch's size as Lightning counts it, and its dataset rows;
- :mod:`.loss_progress`: how far the training loss has fallen since the start (torch only); :mod:`.wide`: the
  float a state on the device accumulates in (float64, float32 on MPS);
- :mod:`.rerun`: an extra ``training_step`` or forward that logs nothing and restores RNG, buffers and modes;
  :mod:`.extra_forward`: the mark that keeps such a forward from the hooks observing the user's steps and from
  ``torch.compile`` (torch only).
"""
