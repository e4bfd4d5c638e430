"""The memory categories of a profiled step, in one table, and the step record they are read from.

Each row of :data:`MEMORY_CATEGORIES` names a category once: its logged tag (``memory/<key>_bytes``,
or ``memory/<key>`` for a count), its label in the markdown table, how to read it from a
:class:`StepMemory` (the step's numbers, and the profiled model for whatever they do not hold), and
whether it is part of the step's footprint — fixed (independent of the batch) or growing with it — for
the largest-batch advice and the CUDA temporaries. A category is one :func:`register_category` call: in a
file of this package (every one is imported here, so a new file is all it takes; :mod:`.cuda` is one), or
in a user's own module. The profiler's scalars, its table, the report's rows and the dashboard's
``memory/*_bytes`` charts follow. A ``measure`` that raises is warned about once, naming the category,
and left out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pkgutil import iter_modules
from typing import Literal

import torch
from torch import nn

from trainvitals.memory.recorder import SavedTensorReport
from trainvitals.memory.storage import ModelStateBytes, format_bytes
from trainvitals.text.markdown import markdown_table


@dataclass(frozen=True)
class AllocatorStats:
    """What CUDA's caching allocator reports for a profiled step (``torch.cuda.memory_stats``).

    Attributes:
        peak_allocated_bytes: peak bytes allocated to tensors since the step's peaks were reset.
        peak_reserved_bytes: peak bytes the allocator held from the device over that time.
        alloc_retries: allocations that failed once and succeeded after freeing cached blocks
            (cumulative).
        ooms: out-of-memory errors the allocator raised (cumulative).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int
    ooms: int

    @classmethod
    def read(cls, device: torch.device) -> AllocatorStats:
        stats = torch.cuda.memory_stats(device)
        return cls(
            stats["allocated_bytes.all.peak"],
            stats["reserved_bytes.all.peak"],
            stats["num_alloc_retries"],
            stats["num_ooms"],
        )


def largest_batch(budget_bytes: int, fixed_bytes: int, scaling_bytes: int, batch_size: int) -> int:
    """The largest batch that fits ``budget_bytes`` when ``scaling_bytes`` grow in proportion to the batch.

    ``floor((budget − fixed) · B / scaling)`` examples, 0 when the fixed part alone does not fit.

    Args:
        budget_bytes: the memory to fit in.
        fixed_bytes: bytes that do not depend on the batch (parameters, gradients, optimizer state).
        scaling_bytes: bytes at batch ``batch_size`` that are proportional to it (activations, inputs).
        batch_size: the batch the bytes were measured at.

    Raises:
        ValueError: if ``scaling_bytes`` or ``batch_size`` is not positive.
    """
    if scaling_bytes <= 0:
        raise ValueError(f"`scaling_bytes` must be > 0, got {scaling_bytes}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    return max(0, (budget_bytes - fixed_bytes) * batch_size // scaling_bytes)


Footprint = Literal["fixed", "batch", ""]
"""Part of the step's footprint: independent of the batch, proportional to it, or neither (a peak, a
counter, bytes already counted elsewhere)."""


@dataclass(frozen=True)
class StepMemory:
    """Where the bytes of one profiled step go, and the budget they must fit.

    Attributes:
        state: parameters, buffers, gradients, optimizer state.
        inputs_bytes: the batch (one micro-batch).
        activations: the saved tensors of one micro-batch's forward.
        batch_size: examples in the batch.
        budget_bytes: the memory to fit in, ``None`` for no batch advice.
        step_seconds: wall time of the profiled optimizer step, all its micro-batches, for the cost
            of checkpointing.
        micro_batches: forwards in that time (gradient accumulation): checkpointing recomputes a
            module in each.
        held_bytes: saved tensors of profiled steps still held after this step's backward
            (:class:`~trainvitals.memory.leaks.HeldGraph`).
        allocator: the CUDA allocator's peaks and counters, ``None`` off CUDA.
        model: the profiled model, after the step's backward: where a category the step's numbers do not hold
            reads its tensors (a KV cache kept on a module); ``None`` outside a fit.
    """

    state: ModelStateBytes
    inputs_bytes: int
    activations: SavedTensorReport
    batch_size: int
    budget_bytes: int | None = None
    step_seconds: float | None = None
    micro_batches: int = 1
    held_bytes: int = 0
    allocator: AllocatorStats | None = None
    model: nn.Module | None = None

    def footprint_bytes(self, footprint: Literal["fixed", "batch"]) -> int:
        """The sum of the measured categories of that footprint (negative values count as 0)."""
        values = (_measure(category, self) for category in MEMORY_CATEGORIES if category.footprint == footprint)
        return sum(max(0, value) for value in values if value is not None)

    @property
    def temporaries_bytes(self) -> int:
        """CUDA's peak allocated minus the footprint categories (0 off CUDA): workspaces and other
        temporaries; negative when the categories do not all coexist at the peak."""
        if self.allocator is None:
            return 0
        return self.allocator.peak_allocated_bytes - self.footprint_bytes("fixed") - self.footprint_bytes("batch")

    @property
    def fixed_bytes(self) -> int:
        """Bytes independent of the batch: the model state and autocast's parameter copies."""
        return self.footprint_bytes("fixed")

    @property
    def scaling_bytes(self) -> int:
        """Bytes proportional to the batch: activations, inputs and (non-negative) temporaries."""
        return self.footprint_bytes("batch") + max(0, self.temporaries_bytes)

    def largest_batch(self, fixed_freed: int = 0, scaling_freed: int = 0, activations_peak: int = 0) -> int | None:
        """The largest batch under the budget once ``fixed_freed`` / ``scaling_freed`` bytes are freed and
        with saved activations of at least ``activations_peak`` bytes at some point of the step (a
        checkpointed module's recompute, :func:`~trainvitals.memory.checkpointing.checkpoint_peak`);
        ``None`` without a budget or a batch size."""
        scaling = max(
            self.scaling_bytes - scaling_freed, self.scaling_bytes - self.activations.total_bytes + activations_peak
        )
        if self.budget_bytes is None or scaling <= 0 or self.batch_size < 1:
            return None
        return largest_batch(self.budget_bytes, self.fixed_bytes - fixed_freed, scaling, self.batch_size)


@dataclass(frozen=True)
class MemoryCategory:
    """One row of :data:`MEMORY_CATEGORIES`.

    Attributes:
        key: the tag's name: ``memory/<key>_bytes`` for bytes, ``memory/<key>`` for a count.
        label: the row's label in the markdown table.
        measure: its value on a step, ``None`` when the step does not measure it (CUDA only).
        footprint: see :data:`Footprint`; the fixed and batch rows sum to the step's footprint.
        unit: ``"bytes"`` or ``"count"``.
    """

    key: str
    label: str
    measure: Callable[[StepMemory], float | None]
    footprint: Footprint = ""
    unit: Literal["bytes", "count"] = "bytes"

    @property
    def tag(self) -> str:
        return f"memory/{self.key}_bytes" if self.unit == "bytes" else f"memory/{self.key}"

    def markdown_cells(self, value: float) -> tuple[str, str, str]:
        """Its row of the table: label, value, value in binary units (bytes rows only)."""
        return self.label, f"{value:,.0f}", format_bytes(value) if self.unit == "bytes" else ""


MEMORY_CATEGORIES: list[MemoryCategory] = [
    MemoryCategory("parameters", "parameters", lambda m: m.state.parameters, "fixed"),
    # Part of the parameters row, so not a footprint row; left out for a model without frozen parameters.
    MemoryCategory(
        "frozen_parameters",
        "of which frozen (no gradient, no optimizer state)",
        lambda m: m.state.frozen_parameters or None,
    ),
    MemoryCategory("buffers", "buffers", lambda m: m.state.buffers, "fixed"),
    MemoryCategory("gradients", "gradients", lambda m: m.state.gradients, "fixed"),
    MemoryCategory("optimizer_state", "optimizer state", lambda m: m.state.optimizer_state, "fixed"),
    MemoryCategory("inputs", "inputs (batch)", lambda m: m.inputs_bytes, "batch"),
    MemoryCategory("activations", "saved activations", lambda m: m.activations.total_bytes, "batch"),
    MemoryCategory(
        "parameter_copies", "parameter copies (autocast)", lambda m: m.activations.parameter_copy_bytes, "fixed"
    ),
    MemoryCategory("held_saved", "held after backward", lambda m: m.held_bytes),
]
"""The memory categories, in the order of the markdown table: the step record's own, then those registered
(:func:`register_category`), each where it asked to be."""


def register_category(category: MemoryCategory, before: str | None = None) -> MemoryCategory:
    """Add ``category`` to :data:`MEMORY_CATEGORIES` (again: nothing changes), at the end of the table or
    ``before`` the category of that key.

    Example: the keys and values a model keeps from its last batch (``self.kv_cache``), a row of their own
    that grows with the batch::

        register_category(
            MemoryCategory(
                "kv_cache",
                "KV cache",
                lambda m: unique_storage_bytes(m.model.kv_cache) if hasattr(m.model, "kv_cache") else None,
                "batch",
            ),
            before="held_saved",
        )

    Raises:
        ValueError: if another category has its key (its tag would overwrite that one's), or no category has
            the key ``before``.
    """
    if category in MEMORY_CATEGORIES:
        return category
    keys = [c.key for c in MEMORY_CATEGORIES]
    if category.key in keys:
        raise ValueError(f"`category`: a memory category with key {category.key!r} exists already")
    if before is not None and before not in keys:
        raise ValueError(f"`before`: no memory category has the key {before!r}")
    MEMORY_CATEGORIES.insert(len(keys) if before is None else keys.index(before), category)
    return category


_FAILED: set[str] = set()  # categories and remedy rules whose failure was warned about


def warn_failure_once(what: str, error: Exception) -> None:
    """Warn, once per ``what`` (a category or remedy rule) in the process, that it raised and is left out."""
    if what not in _FAILED:
        _FAILED.add(what)
        warnings.warn(
            f"trainvitals MemoryTopologyProfiler: {what} raised {error!r}; left out, the profiler carries on.",
            RuntimeWarning,
            stacklevel=3,
        )


def _measure(category: MemoryCategory, memory: StepMemory) -> float | None:
    """``category.measure(memory)``, ``None`` (not measured) when it raises."""
    try:
        return category.measure(memory)
    except Exception as error:  # a user's category: a diagnostic never kills the run
        warn_failure_once(f"memory category {category.key!r}", error)
        return None


def measured_categories(memory: StepMemory) -> list[tuple[MemoryCategory, float]]:
    """Every category ``memory`` measures, with its value, in table order."""
    values = ((category, _measure(category, memory)) for category in MEMORY_CATEGORIES)
    return [(category, value) for category, value in values if value is not None]


def category_metrics(memory: StepMemory) -> dict[str, float]:
    """The categories as scalars: tag → value."""
    return {category.tag: value for category, value in measured_categories(memory)}


def category_markdown(memory: StepMemory) -> list[str]:
    """The categories as a markdown table: label, value, value in binary units (bytes rows)."""
    rows = [category.markdown_cells(value) for category, value in measured_categories(memory)]
    return markdown_table(("category", "bytes", "binary units"), rows, align="lrr")


for _module in sorted(m.name for m in iter_modules(__path__)):
    import_module(f"{__name__}.{_module}")  # each registers its categories
