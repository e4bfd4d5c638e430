"""The forwards trainvitals runs for its own purpose, marked so that nothing that observes the user's steps sees them.

LRScalingAdvisor runs the first batch again (and twice over) to read the loss reduction; GraphIntegrityCallback
calls the model on a batch to check that examples do not mix, and re-runs a failing step under its tracer;
TrainingGuard re-runs a batch to find what produced a non-finite value. Each runs inside :func:`extra_forward`
(:func:`~trainvitals.plumbing.rerun.rerun_quietly` enters it), and every hook that reads the user's forward — the
per-example hooks and the layout evidence (:mod:`trainvitals.per_example`), the reachability check's note of the
modules that ran, ActivationMonitor's statistics — returns at once while :func:`in_extra_forward` says so. Inside,
``torch.compile`` is ignored (``torch.compiler.set_stance("force_eager")``): a batch of another size, eval mode or
``no_grad`` would each fail a guard of the compiled graphs and compile new ones; eagerly, they compile nothing.

Torch only: the per-example hooks and the integrity checks import it without Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_depth = 0  # extra forwards entered and not left: a process-wide count, as a checkpointed recomputation in a
# backward may run its forward hooks on autograd's device threads


@contextmanager
def extra_forward() -> Iterator[None]:
    """Run the code inside as trainvitals' own forward: invisible to the hooks that honour :func:`in_extra_forward`,
    and eager under ``torch.compile`` (no graph compiled, none of the run's recompiled). Nests."""
    global _depth
    _depth += 1
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        _depth -= 1


def in_extra_forward() -> bool:
    """Whether the forward running now is trainvitals' own (:func:`extra_forward`), not the user's step."""
    return _depth > 0
