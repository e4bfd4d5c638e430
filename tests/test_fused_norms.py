"""core.norms against torch.linalg.vector_norm on flattened tensors."""

import math

import pytest
import torch

from trainvitals.fused_norms import (
    NormGroups,
    combine_norms,
    group_name,
    grouped_norms,
    per_tensor_norms,
    validate_norm_type,
)


def _grads():
    g = torch.Generator().manual_seed(1)
    shapes = [(7, 5), (5,), (3, 4, 2), (11,), (2, 2)]
    names = ["enc.0.weight", "enc.0.bias", "enc.1.weight", "head.bias", "scale"]
    return names, [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, math.inf])
def test_per_tensor_and_total_equal_vector_norm(p):
    _, grads = _grads()
    norms = per_tensor_norms(grads, p)
    for n, g in zip(norms, grads):
        torch.testing.assert_close(n, torch.linalg.vector_norm(g.double(), p), rtol=1e-6, atol=0)
    flat = torch.cat([g.reshape(-1) for g in grads]).double()
    # The p-th root is taken once: the total of the parts equals the norm of the concatenation.
    torch.testing.assert_close(combine_norms(norms, p), torch.linalg.vector_norm(flat, p), rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, math.inf])
def test_groups_combine_to_the_total(p):
    names, grads = _grads()
    groups = NormGroups.from_names(names, "module")
    assert groups.names == ("enc.0", "enc.1", "head", "scale")
    group_norms = grouped_norms(per_tensor_norms(grads, p), groups, p)
    torch.testing.assert_close(
        group_norms[0], torch.linalg.vector_norm(torch.cat([grads[0].reshape(-1), grads[1]]).double(), p)
    )
    torch.testing.assert_close(
        combine_norms(group_norms, p), combine_norms(per_tensor_norms(grads, p), p), rtol=1e-6, atol=0
    )
    if p == 2.0:
        total = combine_norms(group_norms, 2.0)
        assert torch.isclose(total**2, (group_norms**2).sum(), rtol=1e-6)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_rows_of_steps_are_grouped_independently(p):
    names, grads = _grads()
    groups = NormGroups.from_names(names, "module")
    rows = torch.stack([per_tensor_norms([g * (step + 1) for g in grads], p) for step in range(3)])  # (3, P)
    batched = grouped_norms(rows, groups, p)
    assert batched.shape == (3, len(groups.names))
    for step in range(3):
        torch.testing.assert_close(batched[step], grouped_norms(rows[step], groups, p), rtol=1e-12, atol=0)
        torch.testing.assert_close(combine_norms(batched, p)[step], combine_norms(rows[step], p), rtol=1e-12, atol=0)


def test_float64_huge_gradient_stays_finite():
    grads = [torch.tensor([8e23, -8e23], dtype=torch.float64), torch.ones(3)]
    total = combine_norms(per_tensor_norms(grads, 2.0), 2.0)
    assert torch.isfinite(total)
    assert total.item() == pytest.approx(8e23 * math.sqrt(2), rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_grads_are_reduced_in_fp32(dtype):
    # 1000 entries of 300: the sum of squares (9e7) overflows float16 (max 65504).
    g = torch.full((1000,), 300.0, dtype=dtype)
    norm = per_tensor_norms([g], 2.0)
    assert norm.item() == pytest.approx(300.0 * math.sqrt(1000), rel=1e-3)
    tiny = torch.full((100,), 1e-4, dtype=dtype)  # 1e-8 squared underflows float16
    assert per_tensor_norms([tiny], 2.0).item() == pytest.approx(tiny.double().norm().item(), rel=1e-2)


def test_group_names():
    assert group_name("encoder.layers.0.weight", "parameter") == "encoder.layers.0.weight"
    assert group_name("encoder.layers.0.weight", "module") == "encoder.layers.0"
    assert group_name("encoder.layers.0.weight", "block") == "encoder"
    assert group_name("temperature", "module") == "temperature"
    assert group_name("encoder._orig_mod.layers.0.weight", "module") == "encoder.layers.0"  # a compiled submodule
    assert group_name("_orig_mod.weight", "module") == "weight"
    with pytest.raises(ValueError, match="grouping"):
        group_name("a.b", "layer")


@pytest.mark.parametrize("bad", [0, -1, "two", float("nan")])
def test_bad_norm_type(bad):
    with pytest.raises(ValueError, match="norm_type"):
        validate_norm_type(bad)


def test_mixed_dtypes_keep_their_order():
    grads = [torch.randn(4, dtype=torch.float64), torch.randn(3), torch.randn(5, dtype=torch.bfloat16), torch.randn(2)]
    norms = per_tensor_norms(grads, 2.0)
    assert norms.dtype == torch.float64
    expected = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)
