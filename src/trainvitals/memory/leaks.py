"""Graphs kept alive across steps: saved tensors still held after backward, and who holds them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from trainvitals.memory.recorder import any_alive
from trainvitals.memory.storage import StorageKey, format_bytes, tensors_in


@dataclass(frozen=True)
class HeldGraph:
    """Saved tensors of profiled steps that are still referenced by a graph, at the end of a step.

    Attributes:
        step: the profiled step (optimizer steps) just finished.
        held_bytes: distinct bytes still held, from all tracked steps.
        carried_bytes: the part first saved in an earlier profiled step: a graph that outlived its step.
        step_bytes: the part first saved in ``step``, still held after its backward.
        first_step: the earliest tracked step whose saved tensors are still held (``None``: none).
        growing: ``held_bytes`` exceeds the previous observation's.
    """

    step: int
    held_bytes: int
    carried_bytes: int
    step_bytes: int
    first_step: int | None
    growing: bool

    @property
    def leaking(self) -> bool:
        """A graph is kept alive across steps and grows: saved bytes that neither fall back nor stay flat."""
        return self.carried_bytes > 0 and self.growing


class HeldGraphTracker:
    """Follows, by weak reference, what profiled steps saved and is still held after their backward.

    Args:
        max_steps: how many profiled steps with held tensors to follow; older ones are dropped.

    Raises:
        ValueError: if ``max_steps < 1``.
    """

    def __init__(self, max_steps: int = 256) -> None:
        if max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self._steps: dict[int, dict[StorageKey, tuple[int, list[weakref.ref]]]] = {}
        self._previous_bytes = 0

    def update(self, step: int, held: dict[StorageKey, tuple[int, list[weakref.ref]]]) -> HeldGraph:
        """Add ``held`` (from :meth:`SavedTensorRecorder.held`, after backward) and measure what is alive."""
        if held:
            self._steps[step] = held
        alive: dict[StorageKey, tuple[int, int]] = {}
        for s in sorted(self._steps):
            live = {key: v for key, v in self._steps[s].items() if any_alive(v[1])}
            if live:
                self._steps[s] = live
                for key, (nbytes, _) in live.items():
                    alive.setdefault(key, (s, nbytes))
            else:
                del self._steps[s]
        while len(self._steps) > self.max_steps:
            del self._steps[min(self._steps)]
        held_bytes = sum(nbytes for _, nbytes in alive.values())
        carried = sum(nbytes for s, nbytes in alive.values() if s < step)
        observation = HeldGraph(
            step=step,
            held_bytes=held_bytes,
            carried_bytes=carried,
            step_bytes=held_bytes - carried,
            first_step=min(self._steps) if self._steps else None,
            growing=held_bytes > self._previous_bytes,
        )
        self._previous_bytes = held_bytes
        return observation


@dataclass(frozen=True)
class GraphLeakFinding:
    """A graph kept alive across steps: saved bytes that do not fall back after backward and grow.

    Attributes:
        step: the profiled step (optimizer steps) it was seen at.
        held_bytes: saved bytes of profiled steps still held then.
        bytes_per_step: saved bytes the step kept after its backward.
        since_step: the earliest profiled step whose saved tensors are still held.
        holders: module attributes holding a graph (:func:`graph_holders`), may be empty.
    """

    step: int
    held_bytes: int
    bytes_per_step: int
    since_step: int
    holders: tuple[str, ...]

    @property
    def estimated_bytes(self) -> int:
        """Bytes held if every step since ``since_step`` kept as much as this one (profiled or not)."""
        return self.bytes_per_step * (self.step - self.since_step + 1)

    @property
    def message(self) -> str:
        held_by = (
            f"held by {', '.join(f'`{h}`' for h in self.holders)}: keep a float (`.item()`) or `.detach()` it"
            if self.holders
            else "no module attribute holds a graph: look for a list or variable outside the model, or "
            "`backward(retain_graph=True)`"
        )
        return (
            f"a graph is kept alive across steps: {format_bytes(self.bytes_per_step)} of saved tensors per "
            f"step are still held after backward, held since step {self.since_step} "
            f"(≈ {format_bytes(self.estimated_bytes)} by step {self.step}); {held_by}"
        )


def graph_holders(module: nn.Module, prefix: str = "self") -> list[str]:
    """Attributes of ``module`` and its submodules that hold a tensor attached to an autograd graph.

    Between steps no attribute should: one that does (``self.running_loss = self.running_loss + loss``)
    keeps that step's graph alive. Lists, tuples and dicts in attributes are searched too.

    Returns:
        Names such as ``"self.running_loss"`` or ``"self.encoder.cache"``.
    """
    internal = {"_parameters", "_buffers", "_modules"}
    found = []
    for name, m in module.named_modules():
        base = f"{prefix}.{name}" if name else prefix
        for attr, value in vars(m).items():
            if attr in internal or isinstance(value, nn.Module):
                continue
            if any(t.grad_fn is not None for t in tensors_in(value)):
                found.append(f"{base}.{attr}")
    return found
