"""core.noise: the two-batch-size estimators, EMAs and micro-batch hooks against brute force."""

import copy
import math

import pytest
import torch

from trainvitals.noise import estimators as noise_module
from trainvitals.noise.estimators import (
    BiasCorrectedEMA,
    MicroBatchSquaredNorms,
    NoiseScaleEMA,
    eb_criterion_of_snr_sums,
    gradient_snr,
    gradient_snr_sum,
    two_batch_size_estimates,
)


def test_per_example_estimate_is_the_bessel_corrected_variance():
    g = torch.randn(32, 50, dtype=torch.float64) + 0.3
    mean = g.mean(0)
    grad_sq, trace = two_batch_size_estimates((g**2).sum(1).mean(), mean.square().sum(), num_groups=32, group_size=1)
    torch.testing.assert_close(trace, ((g - mean) ** 2).sum() / 31)
    torch.testing.assert_close(grad_sq, mean.square().sum() - trace / 32)


def test_group_estimates_are_unbiased_on_a_known_distribution():
    # g_i ~ N(G, diag(s²)): ‖G‖² and tr(Σ) are known exactly.
    gen = torch.Generator().manual_seed(0)
    d, n, b, trials = 20, 4, 16, 4000
    G = torch.linspace(-0.2, 0.2, d, dtype=torch.float64)
    s = torch.linspace(0.5, 1.5, d, dtype=torch.float64)
    g = G + s * torch.randn(trials, n, b, d, generator=gen, dtype=torch.float64)
    micro = g.mean(2)  # (trials, n, d)
    m = micro.square().sum(-1).mean(-1)
    big = micro.mean(1).square().sum(-1)
    grad_sq, trace = two_batch_size_estimates(m, big, n, b)
    assert grad_sq.mean().item() == pytest.approx(G.square().sum().item(), rel=0.03)
    assert trace.mean().item() == pytest.approx(s.square().sum().item(), rel=0.02)


def test_estimator_rejects_a_single_group():
    with pytest.raises(ValueError, match="num_groups"):
        two_batch_size_estimates(torch.tensor(1.0), torch.tensor(1.0), 1, 8)
    with pytest.raises(ValueError, match="group_size"):
        two_batch_size_estimates(torch.tensor(1.0), torch.tensor(1.0), 2, 0)


def test_bias_corrected_ema_and_invalid_steps():
    ema = BiasCorrectedEMA(0.9)
    assert ema.value.item() == 0.0 and ema.count.item() == 0
    ema.update(torch.tensor(3.0))
    assert ema.value.item() == pytest.approx(3.0, rel=1e-15)  # bias correction: exact after one update, in float64
    ema.update(torch.tensor(float("nan")))
    ema.update(torch.tensor(100.0), valid=torch.tensor(False))
    assert ema.count.item() == 1 and ema.value.item() == pytest.approx(3.0)
    ema.update(torch.tensor(5.0))
    expected = (0.9 * 0.1 * 3 + 0.1 * 5) / (1 - 0.9**2)
    assert ema.value.item() == pytest.approx(expected, rel=1e-15)
    restored = BiasCorrectedEMA(0.9)
    restored.load_state_dict(ema.state_dict())
    assert restored.value.item() == pytest.approx(expected) and restored.count.item() == 2
    with pytest.raises(ValueError, match="beta"):
        BiasCorrectedEMA(1.0)


def test_a_vector_ema_averages_its_entries_together_and_skips_them_together():
    ema = BiasCorrectedEMA(0.5, (2,))
    assert ema.value.tolist() == [0.0, 0.0]
    ema.update(torch.tensor([1.0, 2.0]))
    ema.update(torch.tensor([float("nan"), 10.0]))  # one entry non-finite: the whole step is skipped
    assert ema.count.item() == 1 and ema.value.tolist() == pytest.approx([1.0, 2.0])
    ema.update(torch.tensor([3.0, 4.0]))
    assert ema.value.tolist() == pytest.approx([(0.25 * 1 + 0.5 * 3) / 0.75, (0.25 * 2 + 0.5 * 4) / 0.75])


def test_noise_scale_ema_state_round_trips_in_one_entry_per_average():
    noise = NoiseScaleEMA(0.9)
    for g, s in [(2.0, 256.0), (1.0, 300.0), (float("inf"), 1.0)]:
        noise.update(torch.tensor(g), torch.tensor(s))
    state = noise.state_dict()
    assert set(state) == {"grad_sq_norm", "trace_cov"} and state["trace_cov"]["count"] == 2
    restored = NoiseScaleEMA(0.9)
    restored.load_state_dict(state)
    assert restored.count.item() == 2
    assert restored.grad_sq_norm.item() == pytest.approx(noise.grad_sq_norm.item())
    assert restored.trace_cov.item() == pytest.approx(noise.trace_cov.item())


def test_noise_scale_ema_outputs():
    noise = NoiseScaleEMA(0.5)
    assert not noise.in_noise_band(64, 1.0)
    noise.update(torch.tensor(2.0), torch.tensor(256.0))
    assert noise.b_simple.item() == pytest.approx(128.0)
    assert noise.noise_floor(64).item() == pytest.approx(2.0)
    assert noise.in_noise_band(64, 1.0)  # B < B_simple: ‖G‖² = 2 ≤ tr(Σ)/B = 4, noise-dominated
    assert noise.in_noise_band(128, 1.0)  # B = B_simple: signal equals noise
    assert not noise.in_noise_band(256, 1.0)  # B > B_simple: ‖G‖² = 2 > 1
    assert not noise.in_noise_band(64, 0.2)  # a tighter margin: 2 > 0.2·4
    noise.update(torch.tensor(-10.0), torch.tensor(256.0))
    assert math.isinf(noise.b_simple.item())  # ‖G‖² ≤ 0: the signal is lost in the noise


def test_micro_batch_hooks_see_each_micro_batch_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    micro = MicroBatchSquaredNorms()
    micro.attach(model.parameters())
    reference = copy.deepcopy(model)  # its parameters carry no hooks
    xs = [torch.randn(5, 4) for _ in range(3)]
    expected = 0.0
    for x in xs:
        model(x).sum().backward()
        micro.end_micro_batch()
        ref = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
        expected += sum(r.double().square().sum() for r in ref).item()
    total, count = micro.pop()
    assert count == 3
    assert total.item() == pytest.approx(expected, rel=1e-6)
    assert micro.pop() == (None, 0)
    micro.detach()
    model(xs[0]).sum().backward()
    micro.end_micro_batch()
    assert micro.pop() == (None, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_micro_batch_hooks_take_any_float_dtype(dtype):
    w = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    micro = MicroBatchSquaredNorms()
    micro.attach([w])
    (w * torch.tensor([1.0, 2.0, 2.0], dtype=dtype)).sum().backward()
    micro.end_micro_batch()
    total, count = micro.pop()
    assert count == 1 and total.dtype == torch.float64 and total.item() == pytest.approx(9.0)


def test_gradient_snr_sum_in_chunks_matches_the_whole_tensor(monkeypatch):
    """Σ_d GSNR_d in chunks of a few coordinates, in float32, against the float64 formula on the whole
    tensor; and the EB criterion of those sums against Mahsereci et al.'s Eq. 7 written out."""
    g = torch.Generator().manual_seed(0)
    per_example = torch.randn(8, 5, 7, generator=g, dtype=torch.float64) + torch.linspace(-1, 1, 7, dtype=torch.float64)
    grad_sum, sum_sq = per_example.sum(0), per_example.square().sum(0)
    snr = per_example.mean(0).square() / per_example.var(0)
    monkeypatch.setattr(noise_module, "SNR_CHUNK", 3)
    total = gradient_snr_sum(grad_sum.float(), sum_sq.float(), 8)
    assert total.dtype == torch.float64 and math.isclose(float(total), float(snr.sum()), rel_tol=1e-5)
    exact = gradient_snr_sum(grad_sum, sum_sq, 8)
    assert math.isclose(float(exact), float(snr.sum()), rel_tol=1e-12)
    eb = eb_criterion_of_snr_sums([exact, exact], [8, 8], 2 * snr.numel())
    assert math.isclose(float(eb), 1 - 8 * float(snr.mean()), rel_tol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "sums_dtype"),
    [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float32, torch.float64)],
)
def test_gradient_snr_is_unchanged_by_the_loss_scale_and_bounded_where_examples_agree(dtype, sums_dtype):
    """GSNR_d = ḡ_d²/σ̂_d² is scale-free: per-example gradients × 1e-4 (a loss × 1e-4) give the same ratios. A
    coordinate no example reaches has GSNR 0; one where all examples agree exactly is bounded by ≈ 1/eps; one
    whose gradients are rounding noise against the rest of the parameter's has GSNR ≈ 0. The eps is that of
    the gradients' ``dtype``, also with float64 sums of float32 gradients (the per-example rules')."""
    g = torch.Generator().manual_seed(1)
    per_example = torch.randn(8, 6, generator=g, dtype=torch.float64) + 0.3
    per_example[:, 4] = 0.0  # a dead unit
    per_example[:, 5] = 0.25  # every example's gradient the same
    eps = torch.finfo(dtype).eps
    per_example = torch.cat([per_example, eps * torch.randn(8, 1, generator=g, dtype=torch.float64)], 1)
    truth = per_example[:, :4].mean(0).square() / per_example[:, :4].var(0)
    for scale in (1.0, 1e-4):
        scaled = (per_example * scale).to(dtype).to(sums_dtype)
        snr = gradient_snr(scaled.mean(0), scaled.square().sum(0), 8, precision=dtype).double()
        assert torch.allclose(snr[:4], truth, rtol=1e-12 if dtype == torch.float64 else 1e-4)
        assert snr[4] == 0 and 0.01 / eps < snr[5] <= 10 / eps and snr[6] < 1e-6
        if sums_dtype != dtype:  # the sums' eps would leave the agreeing coordinate ~1e9 times higher
            assert gradient_snr(scaled.mean(0), scaled.square().sum(0), 8)[5] > 1e6 / eps


def test_the_sub_batch_mean_squared_norm_is_the_norm_of_the_concatenated_mean():
    """‖(1/n) Σ_i g_i‖² over parameters of mixed dtypes, against the float64 concatenation."""
    torch.manual_seed(0)
    sums = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(2, 2).bfloat16()]
    flat = torch.cat([s.double().flatten() for s in sums]) / 6
    result = noise_module.sub_batch_mean_sq_norm(sums, 6)
    assert result.dtype == torch.float64 and result.dim() == 0
    assert float(result) == pytest.approx(float(flat.square().sum()), rel=1e-12)
    assert float(noise_module.sub_batch_mean_sq_norm([], 6)) == 0.0
