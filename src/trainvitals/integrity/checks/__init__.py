"""GraphIntegrityCallback's checks, one class each (:class:`~trainvitals.integrity.checks.base.Check`).

Each check owns the hooks it needs, its state and the messages of its finding kinds; the callback
runs the check windows and calls every check's hooks in turn. The kinds themselves, with their
counters and what the report makes of them, are one table: :class:`~trainvitals.integrity.findings.FindingKind`.

=================================  ===================================================================
check (module)                     finds
=================================  ===================================================================
``LossCheck`` (loss)               a loss without ``grad_fn`` or reaching no parameter, not a scalar,
                                   not finite
``ReachabilityCheck``              parameters the walked loss cannot reach (and why), parameters
(reachability)                     without / with a zero gradient all window long, what DDP makes of them
``StaleGraphCheck`` (stale_graph)  a loss that reaches nodes of an earlier step
``UnoptimizedLeavesCheck``,        leaves in no optimizer (unregistered?), frozen parameters in an
``FrozenParamsCheck``,             optimizer, and those it still changes; parameters in more than one
``SharedByOptimizersCheck``        optimizer
(optimizer)
``GradLeakCheck``,                 manual optimization: leftover gradients, a step before the
``StepOrderCheck`` (manual)        backward of its gradients
``ZeroLrCheck`` (zero_lr)          a param group at lr 0 whose parameters require grad (silently frozen)
``BatchMixingCheck``               examples mixed across the batch (``check_batch_independence``)
``AutogradErrorCheck``             diagnoses of autograd's three classic errors, on an exception
``AnomalyModeCheck`` (anomaly)     no finding: anomaly mode for the first ``detect_anomaly_steps``
=================================  ===================================================================
"""
