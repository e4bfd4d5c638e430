"""What one optimizer step did to the weights: Δθ, its norm, its direction, and Adam's step per unit lr.

Torch only. The caller keeps a copy of the parameters taken before the step (:func:`snapshot`); after
the step :func:`step_change` turns that copy into −Δθ in place (one fused subtraction), so the
transient memory of a measured step is one copy of the parameters — their bytes — and a few ``(P,)``
rows. :func:`adam_unit_step_norms` reuses the same buffer, so it adds nothing to that bound. Every
result stays on the device (float64 rows); nothing here reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from trainvitals.fused_norms import is_dtensor, per_tensor_norms


def snapshot(params: Sequence[Tensor]) -> list[Tensor]:
    """A detached copy of each of ``params`` (θ before the step): their bytes, once."""
    return [p.detach().clone() for p in params]


def step_change(before: list[Tensor], params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(P,)`` ‖θ_before‖₂ and ``(P,)`` ‖Δθ‖₂ (float64) of each parameter; ``before`` becomes −Δθ = θ_before − θ_after.

    Two fused norms and one fused in-place subtraction (``torch._foreach_sub_``); no new tensor of the
    parameters' size.
    """
    weight = per_tensor_norms(before)
    torch._foreach_sub_(before, [p.detach() for p in params])
    return weight, per_tensor_norms(before)


def descent_dots(neg_delta: Sequence[Tensor], grads: Sequence[Tensor | None]) -> Tensor:
    """``(P,)`` float64 ⟨−Δθ, g⟩ of each parameter (0 without a gradient): the numerators of the cosine
    between the step taken and the steepest-descent direction. One ``torch.dot`` per tensor, no temporary;
    a ``DTensor`` (FSDP2, tensor parallelism) gets the dot of its whole tensor: its shards' dots summed over
    the mesh, one collective per such parameter (on a logging step only)."""
    device = neg_delta[0].device if neg_delta else None
    dots = [
        torch.zeros((), dtype=torch.float64, device=getattr(d, "device", device))
        if g is None
        else _whole_dot(d, g.detach())
        for d, g in zip(neg_delta, grads)
    ]
    return torch.stack(dots) if dots else torch.zeros(0, dtype=torch.float64)


def _whole_dot(d: Tensor, g: Tensor) -> Tensor:
    if is_dtensor(d):  # no dot over a sharded dim: the elementwise product's sum, reduced over the mesh
        return (d * g.to(d.dtype)).sum().full_tensor().to(torch.float64)
    return torch.dot(d.reshape(-1), g.reshape(-1).to(d.dtype)).to(torch.float64)


def is_noise_scaled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update is lr × an affine function of this step's gradient, its past fixed:
    ``torch.optim.SGD`` (momentum, Nesterov, dampening, weight decay: Δθ = −lr · (a + c · g)), so that a batch of b
    examples below the usual B raises E‖Δθ‖² by at most B / b, as it does E‖g‖², and the spike rule's √(B / b) holds
    for ‖Δθ‖ (docs/callbacks/update-monitor.md). Adam's update is divided by √v̂, which a noisier gradient raises too:
    no such bound."""
    return type(getattr(optimizer, "optimizer", optimizer)) is torch.optim.SGD


def is_adam_like(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps Adam's moments: ``betas``/``eps`` in its groups, ``exp_avg``/``exp_avg_sq``
    in its state (Adam, AdamW, NAdam, RAdam, and their fused and foreach forms)."""
    return all("betas" in g and "eps" in g for g in optimizer.param_groups) and any(
        "exp_avg" in s and "exp_avg_sq" in s for s in optimizer.state.values()
    )


def adam_unit_step_norms(
    optimizer: torch.optim.Optimizer, params: Sequence[Tensor], buffer: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """``(P,)`` ‖m‖₂ (Adam's first moment) and ``(P,)`` ‖m̂ / (√v̂ + ε)‖₂: the step Adam takes per unit lr,
    before weight decay (Kingma & Ba 2015, Algorithm 1: m̂ = m/(1−β₁ᵗ), v̂ = v/(1−β₂ᵗ); AMSGrad's
    running maximum of v when the group sets ``amsgrad``); 0 for a parameter without moments.

    ``buffer`` (one tensor per parameter, of its shape: the copy :func:`step_change` used) is overwritten;
    the computation is in place in it (a few elementwise ops per parameter), so it needs no further memory.
    Reads each moment's step count, a CPU tensor unless the optimizer is ``capturable``.
    """
    position = {id(p): i for i, p in enumerate(params)}
    first = [None] * len(params)
    unit = [None] * len(params)
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        taken = [
            (i, optimizer.state[p])
            for p in group["params"]
            if (i := position.get(id(p))) is not None and "exp_avg" in optimizer.state.get(p, {})
        ]
        if not taken:
            continue
        idx = [i for i, _ in taken]
        states = [s for _, s in taken]
        second_key = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
        out = [buffer[i] for i in idx]
        for state, dst in zip(states, out):
            t = float(state["step"])
            dst.copy_(state[second_key]).div_(1.0 - beta2**t).sqrt_().add_(group["eps"])
            dst.reciprocal_().mul_(state["exp_avg"]).div_(1.0 - beta1**t)
        moments = per_tensor_norms([s["exp_avg"] for s in states])
        steps = per_tensor_norms(out)
        for k, i in enumerate(idx):
            first[i], unit[i] = moments[k], steps[k]
    device = buffer[0].device if buffer else None
    zero = torch.zeros((), dtype=torch.float64, device=device)
    pick = lambda row: torch.stack([zero if v is None else v.to(zero.device) for v in row])  # noqa: E731
    return pick(first), pick(unit)
