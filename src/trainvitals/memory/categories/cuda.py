"""What CUDA's caching allocator says of a profiled step: its peaks, the temporaries they leave beside the
footprint categories, its retries and OOMs (``None`` off CUDA: left out of the table and the scalars)."""

from __future__ import annotations

from collections.abc import Callable

from trainvitals.memory.categories import AllocatorStats, MemoryCategory, StepMemory, register_category


def _allocator(read: Callable[[AllocatorStats], int]) -> Callable[[StepMemory], float | None]:
    return lambda m: None if m.allocator is None else read(m.allocator)


for _category in (
    MemoryCategory("peak_allocated", "CUDA peak allocated", _allocator(lambda a: a.peak_allocated_bytes)),
    MemoryCategory("peak_reserved", "CUDA peak reserved", _allocator(lambda a: a.peak_reserved_bytes)),
    # The rest of the peak: not a footprint row, since it is what the footprint rows leave out.
    MemoryCategory("temporaries", "CUDA temporaries", lambda m: None if m.allocator is None else m.temporaries_bytes),
    MemoryCategory("alloc_retries", "CUDA allocator retries", _allocator(lambda a: a.alloc_retries), unit="count"),
    MemoryCategory("ooms", "CUDA OOMs", _allocator(lambda a: a.ooms), unit="count"),
):
    register_category(_category)
