"""The per-step noise estimate under random reshuffling against a closed form (issue #24; docs/science.md, "Under
random reshuffling").

SGD without momentum on ℓ_i(θ) = ½(θ − x_i)ᵀH(θ − x_i), H diagonal, N examples, batches of B = n·b: g_i = H(θ − x_i),
G(θ) = H(θ − x̄), and the noise ξ_i = g_i − G(θ) = H(x̄ − x_i) does not depend on θ. Over many independent chains
(one tensor), the mean over the chains of one step's estimate (``two_batch_size_estimates`` at b = 1, per-example,
and b = 2, micro-batches; then rule 6's :func:`finite_population`) less a truth at that step's θ is compared with
its prediction, within 4.5 standard errors of the chains' spread:

- ‖G(θ)‖², drawn with replacement (no correction), or reshuffled with θ frozen: 0;
- ‖G(θ)‖², reshuffled, at the k-th step of an epoch (k = 0 its first): 2·E[G·ξ̄_R] = (2/N)·Σ_d S_d·(1 − (1 − ηh_d)^k),
  ξ̄_R the noise's mean over the n_R = N − kB examples not yet drawn, S_d the Bessel variance of coordinate d of ξ;
- ‖G_R(θ)‖² = ‖G + ξ̄_R‖², the remaining set's: −tr S·(1/n_R − 1/N); corrected with n_R in place of N: 0.
"""

from __future__ import annotations

import pytest
import torch

from trainvitals.noise.estimate import finite_population
from trainvitals.noise.estimators import two_batch_size_estimates

N, B, D = 32, 8, 3
K = N // B  # steps per epoch
CHAINS = 20_000
H = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
Z = 4.5


def _chains(lr: float, sampler: str, group: int) -> dict[str, torch.Tensor]:
    """Two epochs of SGD at ``lr`` over :data:`CHAINS` chains, ``sampler`` ``"shuffle"`` or ``"replace"``; per
    quantity ``(K, CHAINS)`` over the second epoch's steps: the estimates (corrected with N and with n_R, and not at
    all) and the truths ‖G‖², ‖G_R‖²."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    theta = torch.full((CHAINS, D), 1.0, dtype=torch.float64)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("raw", "n", "n_r", "full", "remaining")}
    for epoch in range(2):
        if sampler == "shuffle":
            order = torch.rand(CHAINS, N, generator=gen).argsort(1)
        else:
            order = torch.randint(N, (CHAINS, N), generator=gen)
        for k in range(K):
            g = H * (theta[:, None, :] - x[order[:, k * B : (k + 1) * B]])  # (CHAINS, B, D)
            mean = g.mean(1)
            groups = g.view(CHAINS, B // group, group, D).mean(2)
            est, trace = two_batch_size_estimates(
                groups.square().sum(-1).mean(1), mean.square().sum(-1), B // group, group
            )
            if epoch == 1:
                n_r = N - k * B
                remaining = H * (theta - x[order[:, k * B :]].mean(1))
                for key, value in (
                    ("raw", est),
                    ("n", finite_population(est, trace, N)[0]),
                    ("n_r", finite_population(est, trace, n_r)[0]),
                    ("full", (H * (theta - x.mean(0))).square().sum(-1)),
                    ("remaining", remaining.square().sum(-1)),
                ):
                    out[key].append(value)
            theta = theta - lr * mean
    s = (H * x).var(0)  # S_d: the Bessel variance of ξ's coordinate d
    return {k: torch.stack(v) for k, v in out.items()} | {"S": s}


def _mean_and_error(diff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, the chains' mean of ``diff`` ``(K, CHAINS)`` and its standard error."""
    return diff.mean(1), diff.std(1) / CHAINS**0.5


def _assert_near(diff: torch.Tensor, expected: torch.Tensor) -> None:
    mean, se = _mean_and_error(diff)
    assert torch.all((mean - expected).abs() <= Z * se), f"means {mean.tolist()}, expected {expected.tolist()}"


@pytest.mark.fast
@pytest.mark.parametrize("group", [1, 2], ids=["per-example", "micro-batch"])
def test_with_replacement_the_estimate_is_unbiased_for_the_full_gradient(group):
    got = _chains(0.4, "replace", group)
    _assert_near(got["raw"] - got["full"], torch.zeros(K, dtype=torch.float64))


@pytest.mark.fast
@pytest.mark.parametrize("group", [1, 2], ids=["per-example", "micro-batch"])
def test_reshuffled_with_the_weights_frozen_the_estimate_is_unbiased(group):
    got = _chains(0.0, "shuffle", group)
    _assert_near(got["n"] - got["full"], torch.zeros(K, dtype=torch.float64))
    # the remaining set's own mean is then off by its sampling: E‖ξ̄_R‖² = tr S·(1/n_R − 1/N)
    n_r = N - B * torch.arange(K, dtype=torch.float64)
    _assert_near(got["n"] - got["remaining"], -got["S"].sum() * (1 / n_r - 1 / N))


@pytest.mark.fast
@pytest.mark.parametrize("group", [1, 2], ids=["per-example", "micro-batch"])
def test_reshuffled_while_training_the_estimate_reads_the_remaining_set(group):
    lr = 0.4
    got = _chains(lr, "shuffle", group)
    k = torch.arange(K, dtype=torch.float64)
    bias = 2 / N * (got["S"] * (1 - (1 - lr * H) ** k[:, None])).sum(1)
    mean, se = _mean_and_error(got["n"] - got["full"])
    assert torch.all(bias[1:] > 10 * se[1:]), "the bias must stand out of the test's noise"
    assert bias[0] == 0  # an epoch's first step: its batch is independent of θ
    _assert_near(got["n"] - got["full"], bias)
    n_r = N - B * k
    _assert_near(got["n"] - got["remaining"], -got["S"].sum() * (1 / n_r - 1 / N))
    _assert_near(got["n_r"] - got["remaining"], torch.zeros(K, dtype=torch.float64))
