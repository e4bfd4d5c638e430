"""Per-example gradient statistics computed in the same backward pass, without per-example gradients.

Notation as in :mod:`trainvitals.noise.estimators` and docs/science.md §3: per-example gradient g_i = ∇ℓ_i of
each example's own (un-averaged) loss, B examples, batch gradient ḡ = (1/B) Σ_i g_i. A rule gives the
per-example squared norms ‖g_i‖² and the per-coordinate sums Σ_i g_{i,d} and Σ_i g_{i,d}² (the mean and
variance of each coordinate) from a layer's saved inputs and output gradients, both from the same operands.

For a layer of one's own, the registry (:mod:`.registry`) is the public interface: :func:`register_per_example_rule`
(a function giving one call's per-example gradients, or a :class:`PerExampleRule` with cheaper norms),
:func:`unregister_per_example_rule`, what a rule sees of a call (:class:`Use`, :class:`Call`) and keeps from
inside its forward (:class:`Capture`), and :func:`per_example_sq_norms` / :func:`per_example_sums` to run one.

- :mod:`.rules`: the built-in rules, one file a layer family — linear (ghost norms, Goodfellow 2015, Li et al.
  2022), conv (im2col, Rochette et al. 2019), embedding (a segment sum over repeated tokens), normalization,
  attention and recurrent (factored: their outer-product blocks); :data:`PER_EXAMPLE_LAYERS` lists the layers;
- :mod:`.hooks`: the forward/backward hooks that gather the statistics during backward, module by module;
- :mod:`.plan`: which source measures each parameter (per example, micro-batches/ranks, ``torch.func``);
- :mod:`.fallback`: ``torch.func`` per-example gradients of any module (:func:`vmap_per_example_grads`);
- :mod:`.batch_dim`: which dimension holds the examples where T = B; :mod:`.tied`: modules sharing a
  parameter; :mod:`.broadcast`: a position table shared by the batch, measured at the add that broadcasts
  it, and a module's own bare parameters, at the nodes that broadcast them over the batch;
  :mod:`.checkpoint_hooks`: hooks under ``torch.utils.checkpoint``; :mod:`.sums_check`: per-example
  gradients that must add up to ``.grad``; :mod:`.loss_reduction`: a mean or a sum over the examples, read
  from the loss's graph (:func:`detect_loss_reduction`); :mod:`.tensor_ops`: shared buffers and dtypes.

Everything here stays on the device but for the host reads :mod:`.hooks` names. No Lightning import.
"""

from trainvitals.per_example import rules  # noqa: F401 - each of its files registers its rules
from trainvitals.per_example.batch_dim import Layouts
from trainvitals.per_example.fallback import vmap_per_example_grads
from trainvitals.per_example.hooks import PerExampleGradients, PerExampleStep
from trainvitals.per_example.loss_reduction import LossReduction, detect_loss_reduction
from trainvitals.per_example.plan import SourcePlan, plan_sources
from trainvitals.per_example.registry import (
    Call,
    Capture,
    PerExampleRule,
    Use,
    per_example_sq_norms,
    per_example_sums,
    register_per_example_rule,
    registered_types,
    rule_for,
    unregister_per_example_rule,
    unsupported_reason,
)
from trainvitals.per_example.tensor_ops import Workspace

#: The torch layers with a built-in rule, as the family files of :mod:`.rules` registered them.
PER_EXAMPLE_LAYERS = tuple(t for t in registered_types() if t.__module__.startswith("torch."))

__all__ = [
    "PER_EXAMPLE_LAYERS",
    "Call",
    "Capture",
    "Layouts",
    "LossReduction",
    "PerExampleGradients",
    "PerExampleRule",
    "PerExampleStep",
    "SourcePlan",
    "Use",
    "Workspace",
    "detect_loss_reduction",
    "per_example_sq_norms",
    "per_example_sums",
    "plan_sources",
    "register_per_example_rule",
    "registered_types",
    "rule_for",
    "unregister_per_example_rule",
    "unsupported_reason",
    "vmap_per_example_grads",
]
