"""Per-example gradient statistics computed in the same backward pass, without per-example gradients.

Notation as in :mod:`trainvitals.noise.estimators` and docs/science.md §3: per-example gradient g_i = ∇ℓ_i of
each example's own (un-averaged) loss, B examples, batch gradient ḡ = (1/B) Σ_i g_i.

Each layer type has a rule in the registry (:mod:`.registry`), one file per layer family: Linear
(:mod:`.linear`: ghost norms, Goodfellow 2015, Li et al. 2022), convolutions (:mod:`.conv`: im2col,
Rochette et al. 2019), Embedding (:mod:`.embedding`: a segment sum over repeated tokens) and the
normalisation layers (:mod:`.normalization`: ``(B, D)`` per-example vectors). A rule gives the
per-example squared norms ‖g_i‖² and the per-coordinate sums Σ_i g_{i,d} and Σ_i g_{i,d}² (the mean
and variance of each coordinate) from the saved inputs and output gradients. Both come from the same
operands, so that the variance is not the rounding difference between them and a differently rounded
``.grad``. :func:`register_per_example_rule` adds a rule for a layer of one's own.

Layers without a rule fall back to :func:`vmap_per_example_grads` (:mod:`.fallback`): ``torch.func``
per-example vector-Jacobian products of the module's own forward, seeded with the captured output
gradients. :mod:`.hooks` gathers the statistics during backward; :mod:`.plan` assigns each parameter
its source; :func:`detect_loss_reduction` (:mod:`.loss_reduction`) finds whether the batch loss was a
mean or a sum over examples.

Everything here stays on the device but for the host reads :mod:`.hooks` names. No Lightning import.
"""

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
from trainvitals.per_example.rules import (  # noqa: F401 - register their rules
    attention,
    conv,
    embedding,
    linear,
    normalization,
    recurrent,
)
from trainvitals.per_example.tensor_ops import Workspace

#: The torch layers with a built-in rule, as the family files above registered them.
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
