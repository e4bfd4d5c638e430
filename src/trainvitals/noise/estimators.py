"""Gradient noise: ‖G‖², tr(Σ), the simple noise scale B_simple and the noise level.

Notation (docs/science.md §3): per-example gradient g_i, batch gradient ḡ_B = (1/B) Σ g_i, true gradient
G = E[g], per-example covariance Σ. McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", App. A.1):

    E‖ḡ_B‖² = ‖G‖² + tr(Σ)/B                                            (Eq. A.1)

so two batch sizes b < B give unbiased estimates of ‖G‖² and tr(Σ) (Eq. A.2). With n equal groups of
b examples each (micro-batches, DDP ranks, or single examples with b = 1) and B = n·b:

    m = mean_j ‖ḡ_j‖²
    ‖G‖²_est = (n‖ḡ_B‖² − m) / (n − 1)
    S_est    = n·b (m − ‖ḡ_B‖²) / (n − 1)   ≈ tr(Σ)

Single-step estimates are noisy (‖G‖²_est is often negative), so they are smoothed with two separate
bias-corrected EMAs and only the ratio of the EMAs is reported: B_simple = EMA(S)/EMA(‖G‖²) (Eq. 2.9).
These are one source's estimates; :mod:`trainvitals.noise.estimate` combines the sources of a run.

Per coordinate d, from ḡ_d and Σ_i g_{i,d}²: the unbiased variance σ̂_d², the gradient signal-to-noise
ratio ḡ_d²/σ̂_d² (Liu et al. 2020) and the evidence-based criterion (Mahsereci et al. 2017, Eq. 7).
Everything here stays on the device; nothing syncs with the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle


def two_batch_size_estimates(
    group_sq_norm_mean: Tensor, batch_sq_norm: Tensor, num_groups: int, group_size: int
) -> tuple[Tensor, Tensor]:
    """Unbiased ‖G‖² and tr(Σ) from n group gradients and their mean (McCandlish et al. 2018, Eq. A.2).

    Args:
        group_sq_norm_mean: ``()`` m = mean_j ‖ḡ_j‖² of the n group-mean gradients.
        batch_sq_norm: ``()`` ‖ḡ_B‖² of the mean over all n·b examples.
        num_groups: n ≥ 2.
        group_size: b ≥ 1 examples per group (b = 1: per-example gradients).

    Returns:
        ``(grad_sq_norm, trace_cov)``: ‖G‖²_est and S_est ≈ tr(Σ), in per-example units. Either can
        be negative in a single step; do not clamp them before averaging.

    Raises:
        ValueError: if ``num_groups < 2`` or ``group_size < 1``.
    """
    if num_groups < 2:
        raise ValueError(f"`num_groups` must be >= 2 for a two-batch-size estimate, got {num_groups}")
    if group_size < 1:
        raise ValueError(f"`group_size` must be >= 1, got {group_size}")
    n = float(num_groups)
    grad_sq_norm = (n * batch_sq_norm - group_sq_norm_mean) / (n - 1)
    trace_cov = n * group_size * (group_sq_norm_mean - batch_sq_norm) / (n - 1)
    return grad_sq_norm, trace_cov


def coordinate_variance(mean_grad: Tensor, sum_sq: Tensor, num_examples: int) -> Tensor:
    """σ̂_d² = (Σ_i g_{i,d}² − B ḡ_d²)/(B − 1), the unbiased per-coordinate variance (Mahsereci et al. 2017, Eq. 7),
    clamped at 0 against rounding.

    Args:
        mean_grad: ḡ, any shape.
        sum_sq: Σ_i g_{i,d}², the shape of ``mean_grad``.
        num_examples: B ≥ 2.
    """
    # A difference of two nearly equal terms: rounding can take it below zero, which would flip the
    # sign of GSNR and the EB criterion (far more so with ḡ from a bf16 ``.grad``: see ``per_example.per_example_sums``).
    return ((sum_sq - num_examples * mean_grad.square()) / (num_examples - 1)).clamp_min(0.0)


def gradient_snr(
    mean_grad: Tensor,
    sum_sq: Tensor,
    num_examples: int,
    level: Tensor | None = None,
    precision: torch.dtype | None = None,
) -> Tensor:
    """Per-coordinate gradient signal-to-noise ratio ḡ_d²/σ̂_d² (Liu et al. 2020), the shape of ``mean_grad``.

    σ̂_d² is the unbiased variance of :func:`coordinate_variance` (Cockpit's MeanGSNR uses the biased one),
    floored at the parameter's rounding level eps · mean_d Σ_i g_{i,d}²/(B − 1) (``level``: that mean, by
    default over ``sum_sq``; eps: that of ``precision``, the dtype the per-example gradients were formed in,
    by default ``sum_sq``'s — float64 sums of float32 gradients, as the per-example rules give, pass
    float32, whose rounding the gradients carry): the ratio stays scale-invariant (a loss multiplied by c
    leaves it as it is, unlike Cockpit's absolute ε = 1e-5), and a coordinate whose gradients are rounding
    noise (a key bias, which softmax makes 0) or that no example reaches has GSNR ≈ 0. Average over a
    layer's coordinates for the layer's GSNR.
    """
    eps = torch.finfo(sum_sq.dtype if precision is None else precision).eps
    level = sum_sq.mean(dtype=torch.float64) if level is None else level
    floor = (level * (eps / (num_examples - 1))).to(sum_sq.dtype).clamp_min(torch.finfo(sum_sq.dtype).tiny)
    return mean_grad.square() / torch.maximum(coordinate_variance(mean_grad, sum_sq, num_examples), floor)


SNR_CHUNK = 2**19  # coordinates per chunk of :func:`gradient_snr_sum`: a few MiB of temporaries at any size


def gradient_snr_sum(
    grad_sum: Tensor, sum_sq: Tensor, num_examples: int, precision: torch.dtype | None = None
) -> Tensor:
    """Σ_d ḡ_d²/σ̂_d² (:func:`gradient_snr`, ``precision`` as there) over the coordinates of Σ_i g_i and
    Σ_i g_i² of B examples: ``()`` float64.

    Computed in chunks of :data:`SNR_CHUNK` coordinates in the sums' own dtype, each chunk's sum in
    float64: temporaries of a few MiB however large the layer. The variance's cancellation (Σg² − Bḡ²)
    is as exact as the sums: float32 sums leave rounding noise of the size of σ̂_d² where the examples
    nearly agree (the per-example rules' sums are float64).
    """
    total = torch.zeros((), dtype=torch.float64, device=grad_sum.device)
    level = sum_sq.mean(dtype=torch.float64)
    for g, s in zip(grad_sum.reshape(-1).split(SNR_CHUNK), sum_sq.reshape(-1).split(SNR_CHUNK)):
        total += gradient_snr(g / num_examples, s, num_examples, level, precision).sum(dtype=torch.float64)
    return total


def eb_criterion_of_snr_sums(snr_sums: Iterable[Tensor], num_examples: Iterable[int], num_coordinates: int) -> Tensor:
    """The evidence-based stopping criterion 1 − (1/D) Σ_d B ḡ_d²/σ̂_d² (Mahsereci et al. 2017, Eq. 7)
    from each part's :func:`gradient_snr_sum` and its B; D = ``num_coordinates`` of all parts. ``()`` float64."""
    total = functools.reduce(torch.add, (n * s for s, n in zip(snr_sums, num_examples)))
    return 1.0 - total / num_coordinates


def eb_criterion(
    mean_grads: Iterable[Tensor],
    sum_sqs: Iterable[Tensor],
    num_examples: Iterable[int],
    precision: torch.dtype | None = None,
) -> Tensor:
    """The evidence-based stopping criterion 1 − (1/D) Σ_d B ḡ_d²/σ̂_d² (Mahsereci et al. 2017, Eq. 7), σ̂_d² floored
    as in :func:`gradient_snr` (``precision`` as there).

    Positive: the batch gradient is indistinguishable from noise, stop. Parts may come from different numbers
    of examples B.

    Args:
        mean_grads, sum_sqs: per parameter, ḡ and Σ_i g_i², matching shapes.
        num_examples: per parameter, the B its statistics come from.
        precision: the dtype the per-example gradients were formed in (default: each ``sum_sq``'s).

    Returns:
        ``()`` float64.
    """
    parts = [
        (gradient_snr_sum(mean_grad * n, sum_sq, n, precision), n, mean_grad.numel())
        for mean_grad, sum_sq, n in zip(mean_grads, sum_sqs, num_examples)
    ]
    if not parts:
        raise ValueError("`mean_grads` must not be empty")
    snr_sums, counts, sizes = zip(*parts)
    return eb_criterion_of_snr_sums(snr_sums, counts, sum(sizes))


def sub_batch_estimates(
    sq_norm_sum: Tensor, sub_mean_sq_norm: Tensor, num_sub: int, batch_sq_norm: Tensor, batch_size: int
) -> tuple[Tensor, Tensor]:
    """‖G‖² and tr(Σ) from per-example gradients of a sub-batch of n examples out of a batch of B.

    S_est = (Σ_i ‖g_i‖² − n‖ḡ_n‖²)/(n − 1), the Bessel-corrected sample variance of the sub-batch
    (docs/science.md §3, b = 1), and ‖G‖²_est = ‖ḡ_B‖² − S_est/B, unbiased by McCandlish et al. 2018,
    Eq. A.1. With n = B this is :func:`two_batch_size_estimates` with b = 1.

    Args:
        sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the n sub-batch examples.
        sub_mean_sq_norm: ``()`` ‖ḡ_n‖² of their mean.
        num_sub: n ≥ 2.
        batch_sq_norm: ``()`` ‖ḡ_B‖² of the whole batch.
        batch_size: B ≥ n.

    Returns:
        ``(grad_sq_norm, trace_cov)``, per-example units.

    Raises:
        ValueError: if ``num_sub < 2`` or ``batch_size < num_sub``.
    """
    if num_sub < 2:
        raise ValueError(f"`num_sub` must be >= 2, got {num_sub}")
    if batch_size < num_sub:
        raise ValueError(f"`batch_size` must be >= `num_sub` ({num_sub}), got {batch_size}")
    trace_cov = (sq_norm_sum - num_sub * sub_mean_sq_norm) / (num_sub - 1)
    return batch_sq_norm - trace_cov / batch_size, trace_cov


def sub_batch_mean_sq_norm(grad_sums: list[Tensor], num_sub: int) -> Tensor:
    """``()`` float64 ‖ḡ_n‖² = ‖(1/n) Σ_i g_i‖² over parameters, from each parameter's Σ_i g_i over the n
    examples of a sub-batch (any dtypes): one fused norm kernel over the list, accumulated in float64."""
    if not grad_sums:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(grad_sums, 2, dtype=torch.float64)).square().sum() / num_sub**2


def per_example_estimates(sq_norm_sum: Tensor, batch_sq_norm: Tensor, num_examples: int) -> tuple[Tensor, Tensor]:
    """‖G‖² and tr(Σ) from Σ_i ‖g_i‖² and ‖ḡ‖² of the same B examples (McCandlish et al. 2018, Eq. A.2, b = 1)."""
    return two_batch_size_estimates(sq_norm_sum / num_examples, batch_sq_norm, num_examples, 1)


def _as_mask(valid: Tensor | bool, x: Tensor) -> Tensor:
    """``valid & isfinite(x)`` on x's device; a Python bool never becomes a host-to-device copy. ``x − x == 0`` is
    isfinite's answer for a floating ``x`` in two kernels, not its four."""
    finite = (x - x) == 0 if x.is_floating_point() else torch.isfinite(x)
    if isinstance(valid, Tensor):
        return finite & valid.to(x.device)
    return finite if valid else torch.zeros_like(finite)


class BiasCorrectedEMA:
    """An exponential moving average with Adam-style bias correction, kept on the device.

    ``update(x, valid)`` skips the step where ``valid`` is false (a non-finite or skipped step)
    without a host sync. ``value`` is ``ema / (1 - beta**t)`` with t the number of valid updates;
    it is NaN-free: before the first valid update it is 0 and :attr:`count` is 0.

    Args:
        beta: decay per update, in [0, 1).
        shape: the shape of ``x``; a vector of quantities is averaged with one kernel per operation
            for all of them, and a step with any of them non-finite is skipped for all (one
            :attr:`count`).
    """

    def __init__(self, beta: float, shape: tuple[int, ...] = ()) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"`beta` must be in [0, 1), got {beta}")
        self.beta = beta
        self._ema = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.long)

    def update(self, x: Tensor, valid: Tensor | bool = True) -> None:
        x = x.detach().to(torch.float64)
        if self._ema.device != x.device:
            self._ema, self.count = self._ema.to(x.device), self.count.to(x.device)
        valid_t = _as_mask(valid, x).all()
        # An invalid step lerps towards the EMA itself, i.e. leaves it unchanged: no branch, no sync.
        self._ema = torch.lerp(self._ema, torch.where(valid_t, x, self._ema), 1.0 - self.beta)
        self.count = self.count + valid_t

    @property
    def value(self) -> Tensor:
        correction = 1.0 - torch.pow(self.beta, self.count.to(self._ema.dtype))  # an integer power would be float32
        return torch.where(self.count > 0, self._ema / correction, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "ema": self._ema.tolist(), "count": int(self.count.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self._ema.device
        self._ema = torch.tensor(state.get("ema", 0.0), dtype=torch.float64, device=device)
        self.count = torch.tensor(int(state.get("count", 0)), dtype=torch.long, device=device)


def update_together(feeds: list[tuple[Tensor, list[BiasCorrectedEMA]]], valid: Tensor | bool = True) -> None:
    """:meth:`BiasCorrectedEMA.update` of each EMA of ``feeds`` (each value with the EMAs it feeds, of its shape), in
    a few fused kernels for all of them: the same numbers, a fixed number of kernels however many EMAs (a
    :class:`~trainvitals.noise.estimate.NoiseSource`'s windows are fed at every step). No sync.

    An invalid step lerps towards 0 with weight 0 (not towards the EMA itself with weight 1 − β): the EMA is left
    exactly as it was all the same."""
    emas: list[BiasCorrectedEMA] = []
    targets, oks, masks = [], [], []
    for x, fed in feeds:
        x = x.detach().to(torch.float64)
        ok = _as_mask(valid, x).all()
        safe, mask = torch.where(ok, x, 0.0), ok.to(torch.float64)
        for ema in fed:
            if ema._ema.device != x.device:
                ema._ema, ema.count = ema._ema.to(x.device), ema.count.to(x.device)
            emas.append(ema)
            targets.append(safe)
            oks.append(ok)
            masks.append(mask)
    weights = torch._foreach_mul(masks, [1.0 - ema.beta for ema in emas])
    values = torch._foreach_lerp([ema._ema for ema in emas], targets, weights)
    for ema, value, count in zip(emas, values, torch._foreach_add([e.count for e in emas], oks)):
        ema._ema, ema.count = value, count


def stacked_values(emas: list[BiasCorrectedEMA], betas: Tensor) -> Tensor:
    """``(L, *shape)``: the :attr:`BiasCorrectedEMA.value` of L EMAs of one shape, their decays ``betas`` ``(L,)`` on
    their device, in one bias correction (the same numbers as each one's)."""
    raw = torch.stack([ema._ema for ema in emas])
    count = torch.stack([ema.count for ema in emas]).reshape(-1, *[1] * (raw.dim() - 1))
    correction = 1.0 - torch.pow(betas.reshape(count.shape), count.to(raw.dtype))
    return torch.where(count > 0, raw / correction, 0.0)


class NoiseScaleEMA:
    """Separate bias-corrected EMAs of ‖G‖²_est and tr(Σ)_est, and what follows from them.

    Feed it one (‖G‖²_est, S_est) pair per optimizer step, from any source (micro-batches, ranks,
    per-example norms). All outputs are 0-d tensors on the device of the inputs.

    Args:
        beta: EMA decay per update, in [0, 1).
    """

    def __init__(self, beta: float = 0.98) -> None:
        self._ema = BiasCorrectedEMA(beta, (2,))  # of the pair (‖G‖²_est, S_est)

    @property
    def beta(self) -> float:
        """The decay per update."""
        return self._ema.beta

    def update(self, grad_sq_norm: Tensor, trace_cov: Tensor, valid: Tensor | bool = True) -> None:
        self._ema.update(
            torch.stack([grad_sq_norm.to(torch.float64), trace_cov.to(grad_sq_norm.device, torch.float64)]), valid
        )

    @property
    def count(self) -> Tensor:
        """Number of valid updates so far (``()`` long tensor)."""
        return self._ema.count

    @property
    def values(self) -> Tensor:
        """``(2,)`` float64: the EMAs of (‖G‖²_est, S_est), in one bias correction."""
        return self._ema.value

    @property
    def grad_sq_norm(self) -> Tensor:
        """EMA of ‖G‖²_est (squared gradient units). Can be ≤ 0 when the signal is lost in noise."""
        return self._ema.value[0]

    @property
    def trace_cov(self) -> Tensor:
        """EMA of tr(Σ)_est, per-example units."""
        return self._ema.value[1]

    @property
    def b_simple(self) -> Tensor:
        """B_simple = tr(Σ)/‖G‖² in examples (McCandlish et al. 2018, Eq. 2.9); ``inf`` when ‖G‖² ≤ 0."""
        g, s = self._ema.value.unbind()
        return torch.where(g > 0, s / g.clamp_min(1e-300), torch.full_like(g, float("inf")))

    def noise_floor(self, batch_size: int) -> Tensor:
        """sqrt(tr(Σ)/B): the norm a batch gradient of B examples keeps when ‖G‖ = 0 (gradient units)."""
        return torch.sqrt(self.trace_cov.clamp_min(0.0) / batch_size)

    def in_noise_band(self, batch_size: int, margin: float) -> Tensor:
        """True when ‖G‖² ≤ margin · tr(Σ)/B, i.e. E‖ḡ_B‖² ≤ (1 + margin) × the noise level² (``()`` bool).

        ``margin = 1`` is B ≤ B_simple. With Cockpit's norm test θ² = tr Σ/(B‖G‖² + tr Σ) the band is
        θ ≥ 1/sqrt(1 + margin): B ≤ B_simple is θ ≥ 1/√2, not θ ≥ 1 (which is ‖G‖² ≤ 0). False before the
        first update.
        """
        g, s = self._ema.value.unbind()
        return (self.count > 0) & (s > 0) & (g <= margin * s / batch_size)

    def state_dict(self) -> dict[str, Any]:
        return _split_state(self._ema, ("grad_sq_norm", "trace_cov"))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _join_state(self._ema, state, ("grad_sq_norm", "trace_cov"))


def _split_state(ema: BiasCorrectedEMA, names: tuple[str, ...]) -> dict[str, Any]:
    """A vector EMA's state as one scalar EMA state per named entry (the checkpoint format)."""
    state = ema.state_dict()
    return {name: {**state, "ema": value} for name, value in zip(names, state["ema"])}


def _join_state(ema: BiasCorrectedEMA, state: dict[str, Any], names: tuple[str, ...]) -> None:
    parts = [state.get(name, {}) for name in names]
    ema.load_state_dict({"ema": [float(p.get("ema", 0.0)) for p in parts], "count": int(parts[0].get("count", 0))})


class MicroBatchSquaredNorms:
    """Squared norms of each micro-batch's own gradient, seen before it is added into ``.grad``.

    ``p.grad`` only ever holds the running sum of the micro-batches, so the per-micro-batch gradient
    is read with a tensor hook on each parameter, which autograd calls with the incoming gradient
    before ``AccumulateGrad`` adds it (and, under DDP, before the all-reduce: it is the rank's local
    gradient). Each hook takes one norm (fp32 at least) on the device, and the end of the micro-batch
    adds their squares in one kernel; nothing is copied or synced.

    Use: :meth:`attach` once; after each backward call :meth:`end_micro_batch`; at the optimizer step
    :meth:`pop` returns (sum_j ‖g_j‖², n) for the n micro-batches since the last pop. The gradients are
    whatever backward produced (loss-scaled under AMP, divided by the number of accumulation steps
    under Lightning): the caller converts units.

    Limitation: a tensor hook also fires for ``torch.autograd.grad`` taken with respect to the
    parameters (a gradient penalty, SAM, MAML-style inner steps); such gradients are counted into the
    current micro-batch and bias the estimate.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._norms: list[Tensor] = []  # this micro-batch's, one per parameter so far
        self._total: Tensor | None = None
        self._count = 0

    def attach(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.detach()
        self._handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, grad: Tensor) -> None:
        # Half-precision grads are reduced in fp32; fp32/fp64 ones in their own dtype.
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else None
        self._norms.append(torch.linalg.vector_norm(grad, 2, dtype=wide))

    def end_micro_batch(self) -> None:
        norms, self._norms = self._norms, []
        if not norms:
            return
        first = norms[0]
        if any(n.device != first.device or n.dtype != first.dtype for n in norms):  # a model over devices
            norms = [n.to(first.device, torch.float64) for n in norms]
        sq = torch.stack(norms).to(torch.float64).square().sum()
        self._total = sq if self._total is None else self._total + sq
        self._count += 1

    def pop(self) -> tuple[Tensor | None, int]:
        """(Σ_j ‖g_j‖² over the micro-batches since the last pop, their number); resets."""
        total, count = self._total, self._count
        self._norms, self._total, self._count = [], None, 0
        return total, count


def t_quantile(z: Tensor | float, dof: Tensor) -> Tensor:
    """Student's t quantile with ``dof`` degrees of freedom at the normal quantile ``z`` (Cornish–Fisher, three
    terms: Abramowitz & Stegun 26.7.5; within 1% of the exact value for dof ≥ 3 at z = 1.645): an interval from
    a variance estimated over few effective measurements widens as it should. ``inf`` for dof ≤ 0."""
    dof = torch.as_tensor(dof, dtype=torch.float64)
    nu = dof.clamp_min(1e-300)
    if isinstance(z, Tensor):
        z = z.to(dof.device, torch.float64)
        z3, z5 = z**3, z**5
        t = z + (z3 + z) / (4 * nu) + (5 * z5 + 16 * z3 + 3 * z) / (96 * nu**2)
    else:  # a constant quantile: its terms on the host (as torch takes them: z·z·z, pow(z, 5)), no copy to the device
        z3, z5 = z * z * z, math.pow(z, 5)
        first, second = torch.full_like(nu, z3 + z), torch.full_like(nu, 5 * z5 + 16 * z3 + 3 * z)
        t = z + first / (4 * nu) + second / (96 * nu**2)  # tensor by tensor: a float over a tensor rounds otherwise
    return torch.where(dof > 0, t, torch.full_like(t, float("inf")))


def fieller_interval(
    num: Tensor, den: Tensor, var_num: Tensor, var_den: Tensor, cov: Tensor, z: Tensor | float
) -> tuple[Tensor, Tensor]:
    """Fieller's interval for a ratio num/den ≥ 0 of two estimates with normal errors (Fieller 1954, *J. R.
    Stat. Soc. B* 16; for B_simple = tr Σ/‖G‖², McCandlish et al. 2018, Eq. 2.9): the θ ≥ 0 with
    (num − θ·den)² ≤ z²·(var_num − 2θ·cov + θ²·var_den).

    Unlike the delta method it stays right where den is within its error of 0: then the set is unbounded
    above and the interval is one-sided, ``[low, inf)`` — the lower bound is still news ("B_simple ≥ low") —,
    and ``[0, inf)`` when num is not resolved from 0 either. With a = den² − z²·var_den, b = num·den − z²·cov,
    q = num² − z²·var_num and d = b² − a·q, the ends are q/(b + √d) (the stable form of (b − √d)/a) and, when
    a > 0, (b + √d)/a. Both ends ``()`` float64 (any shape, elementwise); no host sync.
    """
    z2 = torch.as_tensor(z, dtype=torch.float64, device=num.device) ** 2
    a = den * den - z2 * var_den
    b = num * den - z2 * cov
    q = num * num - z2 * var_num
    root = (b * b - a * q).clamp_min(0.0).sqrt()  # d < 0 (an empty set, rare): its hull's centre b/a
    inf = torch.full_like(num, float("inf"))
    upper = b + root
    # Both ends below 0 (num and den of opposite signs beyond their errors): no information on θ ≥ 0.
    informative = upper > 0
    low = torch.where(informative & (q > 0), q / upper.clamp_min(1e-300), torch.zeros_like(num))
    high = torch.where(informative & (a > 0), upper / a.clamp_min(1e-300), inf)
    return low, torch.maximum(high, low)


def effective_count(beta: float, count: Tensor) -> Tensor:
    """n_eff = 1/Σ w_k² of a bias-corrected EMA of decay ``beta`` after ``count`` updates:
    (1 − βᵗ)²(1 + β)/((1 − β)(1 − β²ᵗ)), → (1 + β)/(1 − β); 0 before the first update. ``()`` float64."""
    t = count.to(torch.float64)
    b = torch.full_like(t, beta)
    return (1 - b**t).square() * (1 + b) / ((1 - b) * (1 - b ** (2 * t))).clamp_min(1e-300)


def window_overlap(betas: Tensor, count: Tensor) -> Tensor:
    """K_ab = Σ_k w_a,k·w_b,k ``(L, L)`` float64 for bias-corrected EMAs of decays ``betas`` ``(L,)`` over the same
    ``count`` updates, w_a,k = (1 − a)·a^(t−k)/(1 − aᵗ): (1 − a)(1 − b)(1 − (ab)ᵗ)/((1 − aᵗ)(1 − bᵗ)(1 − ab)).
    For one stream of per-step variance v, Cov(EMA_a, EMA_b) = v·K_ab; K_aa = 1/n_eff (:func:`effective_count`)."""
    t = count.to(torch.float64)
    a, b = betas.to(t.device)[:, None], betas.to(t.device)[None, :]
    ab = a * b
    num = (1 - a) * (1 - b) * (1 - ab**t)
    return num / ((1 - a**t) * (1 - b**t) * (1 - ab)).clamp_min(1e-300)


def mean_covariance(values: Tensor, moments: Tensor, n_eff: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(Var S̄, Var Ḡ, Cov(S̄, Ḡ))`` of two EMA means ``values`` = (Ḡ, S̄) ``(2, ...)``, from the EMAs ``moments`` of
    (S², ‖G‖²², S·‖G‖²) ``(3, ...)`` over ``count`` updates of ``n_eff`` effective measurements
    (:class:`NoiseScaleError`): the weighted sample (co)variances over n_eff − 1; ``inf`` variances (and a 0
    covariance) with fewer than two updates."""
    g, s = values.unbind()
    trace_sq, grad_sq, cross = moments.unbind()
    denom = (n_eff - 1).clamp_min(1e-300)
    ok = count >= 2
    inf = torch.full_like(s, float("inf"))
    var_s = torch.where(ok, (trace_sq - s * s).clamp_min(0.0) / denom, inf)
    var_g = torch.where(ok, (grad_sq - g * g).clamp_min(0.0) / denom, inf)
    cov = torch.where(ok, (cross - s * g) / denom, torch.zeros_like(s))
    return var_s, var_g, cov


class NoiseScaleError:
    """Relative standard error of B_simple = EMA(S)/EMA(‖G‖²) from the spread of the per-step estimates.

    Keeps bias-corrected EMAs of S², ‖G‖²² and S·‖G‖² (the first moments come from the
    :class:`NoiseScaleEMA` fed the same pairs). With t valid updates the EMA weights w_k give an
    effective sample count n_eff = 1/Σ w_k² = (1 − βᵗ)²(1 + β) / ((1 − β)(1 − β²ᵗ)); the variance of
    each EMA mean is (E[x²] − E[x]²)/(n_eff − 1) (the weighted sample variance over n_eff), and the
    delta method gives the ratio's relative variance Var(S̄)/S̄² + Var(Ḡ)/Ḡ² − 2 Cov(S̄, Ḡ)/(S̄ Ḡ).
    Consecutive steps are treated as independent, so this is a lower bound when they are correlated.

    Args:
        beta: the same EMA decay as the :class:`NoiseScaleEMA`, in [0, 1).
    """

    def __init__(self, beta: float = 0.98) -> None:
        self.beta = beta
        self._moments = BiasCorrectedEMA(beta, (3,))  # of (S², ‖G‖²², S·‖G‖²)

    def update(self, grad_sq_norm: Tensor, trace_cov: Tensor, valid: Tensor | bool = True) -> None:
        g = grad_sq_norm.detach().double()
        s = trace_cov.detach().to(g.device, torch.float64)
        self._moments.update(torch.stack([s * s, g * g, s * g]), valid)

    @property
    def moments(self) -> Tensor:
        """``(3,)`` float64: the EMAs of (S², ‖G‖²², S·‖G‖²), bias-corrected."""
        return self._moments.value

    def mean_covariance(self, noise: NoiseScaleEMA) -> tuple[Tensor, Tensor, Tensor]:
        """``(Var S̄, Var Ḡ, Cov(S̄, Ḡ))`` of the two EMA means of ``noise``, each ``()`` float64; ``inf``
        variances (and a 0 covariance) with fewer than two updates (:func:`mean_covariance`)."""
        count = self._moments.count
        return mean_covariance(noise.values, self.moments, effective_count(self.beta, count), count)

    def relative_error(self, noise: NoiseScaleEMA) -> Tensor:
        """``()`` relative standard error of ``noise.b_simple``; ``inf`` with fewer than two updates or ‖G‖² ≤ 0."""
        s, g = noise.trace_cov, noise.grad_sq_norm
        var_s, var_g, cov = self.mean_covariance(noise)
        rel_var = (
            var_s / (s * s).clamp_min(1e-300) + var_g / (g * g).clamp_min(1e-300) - 2 * cov / (s * g).clamp_min(1e-300)
        )
        ok = (self._moments.count >= 2) & (g > 0) & (s > 0)
        return torch.where(ok, rel_var.clamp_min(0.0).sqrt(), torch.full_like(s, float("inf")))

    def state_dict(self) -> dict[str, Any]:
        return _split_state(self._moments, ("trace_sq", "grad_sq", "cross"))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _join_state(self._moments, state, ("trace_sq", "grad_sq", "cross"))
