"""Memory of the computation graph: saved tensors per module, model-state bytes, graphs held across
steps, and the arithmetic of the remedies (docs/science.md §5).

Categories, all in bytes and all counted by storage, so that views and tied weights count once:

- parameters (and, of them, the frozen ones: no gradient, no optimizer state), buffers, gradients and
  optimizer state (every tensor in ``optimizer.state``);
- inputs: the tensors of the batch, their own elements (a batch sliced from a dataset that lives on
  the device is the slice, not the dataset);
- saved activations: what autograd keeps for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``. Each saved tensor is attributed to the innermost module
  whose forward is running (module forward pre/post hooks keep the stack), deduplicated by storage
  (``untyped_storage().data_ptr()``, ``nbytes()``), and left out when its storage belongs to a
  parameter, a buffer or the batch: ``Linear`` saves ``weight.t()``, a view of a parameter, and the
  first layer saves the batch, but neither is an activation. A storage whose every saving node was
  freed before the recorder closes (a metric computed with grad on, then dropped) is not counted:
  nothing holds it at backward. This works on any device;
- parameter copies: saved casts of parameters, of slices of them (a packed weight's chunks) or of
  whole frozen parameters (recognised by shape and value: autograd does not link them to the
  parameter) — autocast's 16-bit weights above all. Their size does not depend on the batch:
  fixed bytes, not activations. Autocast caches the casts of trainable parameters until its region
  ends, so checkpointing does not free those.

A graph kept alive across steps (``total = total + loss`` with ``retain_graph=True``, a hidden state
that is never detached) shows as saved tensors that are still referenced after backward and whose
bytes grow step by step. The recorder keeps only weak references to what it saw, so it never keeps a
graph alive itself.

Nothing here imports Lightning; nothing here syncs with the device except
:meth:`SavedTensorRecorder.report` when it times modules on CUDA.

Layout: :mod:`.storage` (bytes by storage, model state, units), :mod:`.recorder` (the saved-tensor
recorder), :mod:`.checkpointing` (what checkpointing a module frees and holds again), :mod:`.leaks`
(graphs held across steps), :mod:`.categories` (the table of memory categories, the step record and
the budget), :mod:`.remedies` (the registered remedies, ranked); the callback,
:class:`~trainvitals.memory.profiler.MemoryTopologyProfiler`, in :mod:`.profiler` (not imported here: it
imports Lightning).
"""

from trainvitals.memory.categories import (
    MEMORY_CATEGORIES,
    AllocatorStats,
    MemoryCategory,
    StepMemory,
    category_markdown,
    category_metrics,
    largest_batch,
    measured_categories,
    register_category,
)
from trainvitals.memory.checkpointing import (
    checkpoint_peak,
    checkpoint_savings,
    transformer_layer_activation_bytes,
    whole_forward_modules,
)
from trainvitals.memory.leaks import GraphLeakFinding, HeldGraph, HeldGraphTracker, graph_holders
from trainvitals.memory.recorder import (
    OUTSIDE,
    ROOT,
    SavedStorage,
    SavedTensorRecorder,
    SavedTensorReport,
    compiled_modules,
)
from trainvitals.memory.remedies import (
    REMEDY_RULES,
    Remedy,
    mixed_precision_savings,
    rank_remedies,
    register_remedy,
)
from trainvitals.memory.storage import (
    ModelStateBytes,
    StorageKey,
    byte_unit,
    element_bytes,
    format_bytes,
    model_state_bytes,
    storage_key,
    storage_keys,
    storage_nbytes,
    tensors_in,
    unique_storage_bytes,
)

__all__ = [
    "AllocatorStats",
    "GraphLeakFinding",
    "HeldGraph",
    "HeldGraphTracker",
    "MEMORY_CATEGORIES",
    "MemoryCategory",
    "ModelStateBytes",
    "OUTSIDE",
    "REMEDY_RULES",
    "ROOT",
    "Remedy",
    "SavedStorage",
    "SavedTensorRecorder",
    "SavedTensorReport",
    "StepMemory",
    "StorageKey",
    "byte_unit",
    "category_markdown",
    "category_metrics",
    "checkpoint_peak",
    "checkpoint_savings",
    "compiled_modules",
    "element_bytes",
    "format_bytes",
    "graph_holders",
    "largest_batch",
    "measured_categories",
    "mixed_precision_savings",
    "model_state_bytes",
    "rank_remedies",
    "register_category",
    "register_remedy",
    "storage_key",
    "storage_keys",
    "storage_nbytes",
    "tensors_in",
    "transformer_layer_activation_bytes",
    "unique_storage_bytes",
    "whole_forward_modules",
]
