"""core.per_example against brute force: one forward/backward per example, in float64."""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import Scale
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from trainvitals.noise.estimators import (
    NoiseScaleEMA,
    NoiseScaleError,
    coordinate_variance,
    eb_criterion,
    gradient_snr,
    per_example_estimates,
    sub_batch_estimates,
)
from trainvitals.per_example import (
    PER_EXAMPLE_LAYERS,
    PerExampleGradients,
    Use,
    Workspace,
    detect_loss_reduction,
    per_example_sq_norms,
    per_example_sums,
    plan_sources,
    register_per_example_rule,
    rule_for,
    vmap_per_example_grads,
)
from trainvitals.per_example import tensor_ops as per_example_module
from trainvitals.per_example.rules import conv as conv_module
from trainvitals.plumbing.extra_forward import extra_forward

B = 6


class SequenceModel(nn.Module):
    """Embedding → LayerNorm → Linear on (B, T, 16) (ghost Gram) → Conv1d over T → Linear on (B, T, 4)
    (more multiply-adds in the Gram form: per-example block) → mean over T."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 16, padding_idx=0)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 4, 3, padding="same")
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.norm(self.emb(tokens))))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h).mean(1)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))


def cnn() -> nn.Module:
    """Conv 2→4 on 6×6 (T = 36: per-example blocks), then conv 4→16 with stride 2
    and reflect padding (T = 9, T·(I + O) ≤ I·O: ghost Gram matrices)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 16, 3, stride=2, padding=1, padding_mode="reflect"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, 3),
    )


def make_case(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    target = torch.randint(0, 3, (B,))
    if kind == "mlp":
        return mlp().double(), torch.randn(B, 5, dtype=torch.float64), target
    if kind == "cnn":
        return cnn().double(), torch.randn(B, 2, 6, 6, dtype=torch.float64), target
    tokens = torch.randint(0, 13, (B, 6))
    tokens[0, :3] = 5  # a repeated token: its rows add up inside one example
    tokens[1, -2:] = 0  # padding: no gradient
    return SequenceModel().double(), tokens, target


def brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """{parameter name: (B, *shape)}: the gradient of each example's own loss, one backward each."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


def hooked(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean", coordinates: bool = True):
    modules = {n: m for n, m in model.named_modules() if isinstance(m, PER_EXAMPLE_LAYERS)}
    collector = PerExampleGradients(modules, {}, 2)
    collector.attach(coordinates=coordinates, keep_norms=True)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    collector.end_micro_batch(float(x.shape[0]) if reduction == "mean" else 1.0)
    collector.detach()
    return collector.pop()


def rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max()) + 1e-300))


@pytest.mark.parametrize("scratch_bytes", [None, 1], ids=["one-chunk", "chunks-of-one-example"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "sequence"])
def test_per_example_statistics_match_brute_force(kind, scratch_bytes, monkeypatch):
    if scratch_bytes is not None:
        monkeypatch.setattr(per_example_module, "_SCRATCH_BYTES", scratch_bytes)
    model, x, y = make_case(kind)
    per_example = brute_force(model, x, y)
    step = hooked(model, x, y)
    assert not step.failed
    mean_grad = {n: p.grad.clone() for n, p in model.named_parameters()}  # mean loss: .grad is ḡ

    # ‖g_i‖², and Σ_i g_i² per coordinate
    truth_sq = sum(g.flatten(1).square().sum(1) for g in per_example.values())
    assert rel_close(step.sq_norms[0], truth_sq)
    for n, g in per_example.items():
        assert rel_close(step.grad_sum[n], g.sum(0)) and rel_close(step.sum_sq[n], g.square().sum(0)), n

    # tr Σ̂ (Bessel) and ‖G‖²_est
    flat = torch.cat([g.flatten(1) for g in per_example.values()], 1)
    truth_trace = (flat - flat.mean(0)).square().sum() / (B - 1)
    truth_g2 = flat.mean(0).square().sum() - truth_trace / B
    batch_sq = sum(g.square().sum() for g in mean_grad.values())
    g2, trace = per_example_estimates(step.sq_norm_sum, batch_sq, B)
    assert rel_close(trace, truth_trace) and rel_close(g2, truth_g2)

    # per-layer GSNR and the EB criterion from the examples' own mean and Σg² (the formula: noise/test_estimators.py)
    snr = {n: gradient_snr(g.mean(0), g.square().sum(0), B) for n, g in per_example.items()}
    for n in per_example:
        assert rel_close(gradient_snr(mean_grad[n], step.sum_sq[n], B), snr[n]), n
    truth_eb = 1 - B * sum(s.sum() for s in snr.values()) / sum(s.numel() for s in snr.values())
    eb = eb_criterion(mean_grad.values(), [step.sum_sq[n] for n in mean_grad], [B] * len(mean_grad))
    assert rel_close(eb, truth_eb)


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.Conv2d(3, 5, 3, padding=1), (6, 6)),  # per-example blocks (T·(I + O) > I·O)
        (nn.Conv2d(3, 5, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 1), bias=False), (7, 6)),
        (nn.Conv2d(8, 16, 2, padding=1, padding_mode="circular"), (2, 2)),  # Gram (T·(I + O) ≤ I·O)
        (nn.Conv1d(4, 3, 5, padding="same", padding_mode="replicate"), (9,)),
        (nn.Conv1d(4, 3, 3, stride=2, dilation=2), (11,)),
        # stride 1 with the trailing sizes kept: shifted patches (the first spatial size may change)
        (nn.Conv2d(3, 4, (3, 5), padding=(0, 2)), (6, 5)),
        (nn.Conv2d(2, 3, 4, padding="same", dilation=(1, 2)), (5, 3)),  # uneven padding, shifts past the row
        (nn.Conv3d(2, 3, 3, padding=1), (3, 4, 3)),
        (nn.Conv1d(4, 3, 5, padding=1, dilation=2), (12,)),
    ],
)
@pytest.mark.parametrize("scratch_bytes", [None, 1], ids=["one-chunk", "chunks-of-one-example"])
def test_convolution_paths_match_brute_force(conv, shape, scratch_bytes, monkeypatch):
    if scratch_bytes is not None:
        monkeypatch.setattr(per_example_module, "_SCRATCH_BYTES", scratch_bytes)
    torch.manual_seed(3)
    conv = conv.double()
    x = torch.randn(B, conv.in_channels, *shape, dtype=torch.float64)
    grad_output = torch.randn_like(conv(x))
    grads = {n: [] for n, _ in conv.named_parameters()}
    for i in range(B):  # brute force: each example's own backward
        conv.zero_grad()
        conv(x[i : i + 1]).backward(grad_output[i : i + 1])
        for n, p in conv.named_parameters():
            grads[n].append(p.grad.clone())
    per_example = {n: torch.stack(g) for n, g in grads.items()}
    truth = sum(g.flatten(1).square().sum(1) for g in per_example.values())
    workspace = Workspace()
    for _ in range(2):  # fresh tensors, then buffers of a workspace, then the same buffers again
        for buffers in (None, workspace):
            assert rel_close(per_example_sq_norms(conv, x, grad_output, buffers), truth, 1e-10)
            sums = per_example_sums(conv, x, grad_output, buffers)
            for n, g in per_example.items():
                assert rel_close(sums[n][0], g.sum(0), 1e-10) and rel_close(sums[n][1], g.square().sum(0), 1e-10), n


CONV_FORMS = {
    "conv1d": (lambda: nn.Conv1d(8, 3, 5, padding=2), (8, 13)),
    "conv1d_stride_dilation": (lambda: nn.Conv1d(4, 3, 3, stride=2, dilation=2), (4, 11)),
    "conv2d_same": (lambda: nn.Conv2d(3, 5, 3, padding=1), (3, 6, 6)),
    "conv2d_same_one_channel": (lambda: nn.Conv2d(1, 4, 3, padding=1), (1, 5, 5)),  # 3 columns: the patches
    "conv2d_stride_dilation_padding": (
        lambda: nn.Conv2d(3, 5, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 1), bias=False),
        (3, 7, 6),
    ),
    "conv2d_groups": (lambda: nn.Conv2d(6, 4, 3, padding=1, groups=2), (6, 4, 4)),
    "conv2d_depthwise_circular": (lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4, padding_mode="circular"), (4, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 3, 4, 3)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (3, 5)),
    "conv_transpose2d_groups": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (4, 3, 3)),
}


def conv_brute_force(conv: nn.Module, xs: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """(B,): ‖g_i‖² over all of ``conv``'s parameters, g_i the gradient of Σ_u ⟨conv(x_u[i]), grads_u[i]⟩ (one
    backward per example through every call)."""
    sq = []
    for i in range(xs[0].shape[0]):
        conv.zero_grad()
        sum((conv(x[i : i + 1]) * g[i : i + 1]).sum() for x, g in zip(xs, grads)).backward()
        sq.append(sum(p.grad.square().sum() for p in conv.parameters()))
    conv.zero_grad()
    return torch.stack(sq)


class FormRoles(set):
    """The workspace buffers the rules' batched matmuls took: {"blocks"} or {"gram_a", "gram_g"}."""

    def form(self) -> str:
        return {frozenset({"blocks"}): "blocks", frozenset({"gram_a", "gram_g"}): "gram"}.get(
            frozenset(self & {"blocks", "gram_a", "gram_g"}), f"mixed: {sorted(self)}"
        )


@pytest.fixture
def bmm_roles(monkeypatch):
    """:class:`FormRoles` of every :class:`Workspace` from here on."""
    roles = FormRoles()
    take = Workspace.take

    def recorded(self, role, shape, like):
        roles.add(role)
        return take(self, role, shape, like)

    monkeypatch.setattr(Workspace, "take", recorded)
    return roles


@pytest.mark.parametrize("uses", [1, 2], ids=["one-call", "two-calls"])
@pytest.mark.parametrize("scratch_bytes", [None, 1], ids=["one-chunk", "chunks-of-one-example"])
@pytest.mark.parametrize("form", ["blocks", "gram", "cost"])
@pytest.mark.parametrize("name", list(CONV_FORMS))
def test_each_conv_form_matches_brute_force(name, form, scratch_bytes, uses, bmm_roles, monkeypatch):
    """Either form, forced or chosen by cost, on Conv1d/2d/3d and ConvTranspose with stride, padding,
    dilation and groups, in chunks of examples and on a layer called twice: ‖g_i‖² of brute force."""
    if scratch_bytes is not None:
        monkeypatch.setattr(per_example_module, "_SCRATCH_BYTES", scratch_bytes)
    make, shape = CONV_FORMS[name]
    torch.manual_seed(3)
    conv = make().double()
    rule = type(rule_for(conv))(form=form)
    xs = [torch.randn(B, *shape, dtype=torch.float64) for _ in range(uses)]
    grads = [torch.randn_like(conv(x)) for x in xs]
    workspace = Workspace()
    for buffers in (None, workspace, workspace):
        sq = rule.sq_norms(conv, [Use(x, g) for x, g in zip(xs, grads)], buffers)
        assert rel_close(sq, conv_brute_force(conv, xs, grads), 1e-10)
    if form != "cost" or uses == 1:
        chosen = rule.form_for(conv, xs[0].shape) if form == "cost" else form
        assert bmm_roles.form() == chosen
    if uses == 1:  # an ungrouped zero-padded "same" convolution: the blocks from strided reads, no patches
        rows = chosen == "blocks" and name in ("conv1d", "conv2d_same", "conv3d")  # C·K' ≥ 8 columns
        assert ("patches" in bmm_roles) != rows


@pytest.mark.parametrize(
    "conv, input_shape, form",
    [
        # the digits CNN's conv 2: T 64, I 144, O 32; the Gram matrices 2.4× the blocks' multiply-adds
        (nn.Conv2d(16, 32, 3, padding=1), (64, 16, 8, 8), "blocks"),
        # a late ResNet stage: T 16, I 576, O 128; the Gram matrices 6.5× fewer
        (nn.Conv2d(64, 128, 3, padding=1), (32, 64, 4, 4), "gram"),
        # T 64, I 288, O 32: 2.2× the blocks' (the smaller temporaries, 2T² ≤ I·O, would take the Gram form)
        (nn.Conv2d(32, 32, 3, stride=2, padding=1), (32, 32, 16, 16), "blocks"),
        # T 64, I 576, O 64: 1.11× the blocks', within the Gram matmuls' 1.2× speed
        (nn.Conv2d(64, 64, 3, stride=2, padding=1), (32, 64, 16, 16), "gram"),
        # per group I 288, O 32 decide, not the layer's 1152 and 128 (without groups: Gram)
        (nn.Conv2d(128, 128, 3, padding=1, groups=4), (8, 128, 8, 8), "blocks"),
        (nn.Conv2d(128, 128, 3, padding=1), (8, 128, 8, 8), "gram"),
        (nn.Conv1d(8, 8, 3, padding=1, groups=8), (8, 8, 32), "blocks"),  # depthwise: I 3, O 1
        (nn.Conv1d(256, 256, 3, padding=1), (8, 256, 16), "gram"),
        # transposed: T the input's 16 positions, I = 128·4 of the output gradient's patches, O 256
        (nn.ConvTranspose2d(256, 128, 2, stride=2), (8, 256, 4, 4), "gram"),
    ],
    ids=[
        "digits-conv2",
        "late-stage",
        "stride-2",
        "near-even",
        "groups",
        "no-groups",
        "depthwise",
        "conv1d",
        "transpose",
    ],
)
def test_the_cost_model_picks_the_form_with_fewer_multiply_adds(conv, input_shape, form, bmm_roles):
    """The decision from the layer's shapes, T·I·O against T²·(I + O)/1.2 per group, and the rule computes
    in it, exactly (on 3 examples: the choice does not depend on the batch)."""
    torch.manual_seed(0)
    conv = conv.double()
    rule = rule_for(conv)
    assert rule.form_for(conv, input_shape) == form
    x = torch.randn(3, *input_shape[1:], dtype=torch.float64)
    grad = torch.randn_like(conv(x))
    sq = rule.sq_norms(conv, [Use(x, grad)], Workspace())
    assert bmm_roles.form() == form
    assert rel_close(sq, conv_brute_force(conv, [x], [grad]), 1e-10)


@pytest.fixture
def conv2d_form(request):
    """nn.Conv2d measured by a ConvRule forced into ``request.param``; the built-in rule back afterwards."""
    built_in = rule_for(nn.Conv2d(1, 1, 1))
    register_per_example_rule(nn.Conv2d)(conv_module.ConvRule(form=request.param))
    yield request.param
    register_per_example_rule(nn.Conv2d)(built_in)


@pytest.mark.parametrize("conv2d_form", ["blocks", "gram"], indirect=True)
def test_the_digits_cnn_is_measured_exactly_in_either_forced_form(conv2d_form, bmm_roles):
    """The demo's CNN through the collector, both convolutions in the forced form: ‖g_i‖² and the
    per-coordinate sums over all its parameters, as brute force gives them."""
    torch.manual_seed(0)
    model = nn.Sequential(  # the demo's DigitsCNN, without Lightning
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).double()
    x, y = torch.randn(B, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (B,))
    per_example = brute_force(model, x, y)
    step = hooked(model, x, y)
    assert not step.failed and set(step.grad_sum) == set(per_example)
    assert rel_close(step.sq_norms[0], sum(g.flatten(1).square().sum(1) for g in per_example.values()))
    for n, g in per_example.items():
        assert rel_close(step.grad_sum[n], g.sum(0)) and rel_close(step.sum_sq[n], g.square().sum(0)), n
    assert {"gram_a", "gram_g"} <= bmm_roles if conv2d_form == "gram" else "gram_a" not in bmm_roles


class MatmulFlops(TorchDispatchMode):
    """Multiply-adds of every batched matmul run (``bmm``, into a buffer or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.bmm:
            (b, n, k), m = args[0].shape, args[1].shape[2]
            self.total += b * n * k * m
        return func(*args, **(kwargs or {}))


def _unet_like() -> nn.Sequential:
    """ "Same" convolutions (shifted reads), a strided and a transposed one, a 1×1 and a Linear over positions."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, stride=2, padding=1),
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1),
        nn.Conv2d(8, 8, 1),
        nn.Flatten(2),  # (B, 8, 64): a Linear at 8 positions
        nn.Linear(64, 10),
        nn.Flatten(),
        nn.Linear(80, 10),
    ).double()


def test_a_step_with_per_coordinate_sums_forms_each_block_once():
    """A logging step's norms come from the per-example blocks its sums form: no more matmul work than a step
    without the sums, the norms and sums as brute force gives them."""
    torch.manual_seed(0)
    model = _unet_like()
    x, y = torch.randn(B, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (B,))
    counted = {}
    for coordinates in (False, True):
        with MatmulFlops() as flops:
            step = hooked(model, x, y, coordinates=coordinates)
        counted[coordinates] = flops.total
    assert counted[True] <= counted[False]
    per_example = brute_force(model, x, y)
    assert not step.failed and set(step.grad_sum) == set(per_example)
    assert rel_close(step.sq_norms[0], sum(g.flatten(1).square().sum(1) for g in per_example.values()), 1e-10)
    for n, g in per_example.items():
        assert rel_close(step.grad_sum[n], g.sum(0), 1e-10) and rel_close(step.sum_sq[n], g.square().sum(0), 1e-10), n


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Conv2d(4, 6, 3, padding=1), (B, 4, 5, 7)),
        (nn.Conv1d(4, 6, 5, padding=2), (B, 4, 9)),
        (nn.Conv3d(2, 3, 3, padding=1), (B, 2, 3, 4, 5)),
        (nn.Conv2d(4, 6, 3, stride=2, padding=1), (B, 4, 6, 6)),
        (nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1), (B, 4, 3, 3)),
        (nn.Linear(5, 7), (B, 4, 5)),
    ],
    ids=["same-2d", "same-1d", "same-3d", "strided", "transposed", "linear-positions"],
)
@pytest.mark.parametrize("rows", [None, slice(1, 4)], ids=["all-rows", "rows-1-4"])
def test_measure_gives_the_norms_and_the_rows_sums_of_brute_force(layer, shape, rows):
    """:meth:`PerExampleRule.measure` (a logging step's norms and sums from one pass) against each example's
    gradient, over all rows or a slice of the weight's and the bias's."""
    torch.manual_seed(0)
    layer = layer.double()
    x = torch.randn(shape, dtype=torch.float64)
    g = torch.randn_like(layer(x))
    params = dict(layer.named_parameters())
    per_example = {n: [] for n in params}
    for i in range(B):
        for n, grad in zip(
            params, torch.autograd.grad((layer(x[i : i + 1]) * g[i : i + 1]).sum(), list(params.values()))
        ):
            per_example[n].append(grad)
    truth = {n: torch.stack(v) for n, v in per_example.items()}
    selected = {n: slice(None) if rows is None else rows for n in params}
    sq, sums = rule_for(layer).measure(layer, [Use(x, g)], Workspace(), selected)
    assert rel_close(sq, sum(t.flatten(1).square().sum(1) for t in truth.values()), 1e-10)
    assert set(sums) == set(params)
    for n, t in truth.items():
        t = t[:, selected[n]]
        assert rel_close(sums[n][0], t.sum(0), 1e-10) and rel_close(sums[n][1], t.square().sum(0), 1e-10), n


def test_conv_rule_rejects_an_unknown_form():
    with pytest.raises(ValueError, match="form"):
        conv_module.ConvRule(form="ghost")


@pytest.mark.parametrize(
    "scratch_bytes, row_in_place",
    [(None, None), (1, None), (None, 1)],
    ids=["one-chunk", "chunks-of-one-row", "in-place"],
)
def test_moments_are_float64_sums_of_the_values(scratch_bytes, row_in_place, monkeypatch):
    """Σv and Σv² of float32 values in float64 (their squares exact): from one float64 copy, from chunks of one row,
    or added in place row by row; into a table's rows by index; a float64 input left as it was."""
    for name, value in (("_SCRATCH_BYTES", scratch_bytes), ("_ROW_IN_PLACE", row_in_place)):
        if value is not None:
            monkeypatch.setattr(per_example_module, name, value)
    values = 1 + 1e-4 * torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(0))
    wide = values.double()
    total, total_sq = per_example_module._moments(values)
    assert total.dtype == total_sq.dtype == torch.float64
    torch.testing.assert_close(total, wide.sum(0), rtol=1e-14, atol=0)
    torch.testing.assert_close(total_sq, wide.square().sum(0), rtol=1e-14, atol=0)
    index = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    total, total_sq = per_example_module._moments(values.flatten(1), index, 4)
    zeros = torch.zeros(4, 15, dtype=torch.float64)
    torch.testing.assert_close(total, zeros.index_add(0, index, wide.flatten(1)), rtol=1e-14, atol=0)
    torch.testing.assert_close(total_sq, zeros.index_add(0, index, wide.flatten(1).square()), rtol=1e-14, atol=0)
    kept = wide.clone()
    per_example_module._moments(wide)
    assert torch.equal(wide, kept)


def test_workspace_views_follow_their_buffer():
    """A shape taken again is the same view; after a larger request grows the buffer, every shape is a view
    of the new one (no stale view of the old)."""
    workspace, like = Workspace(), torch.zeros(1)
    small = workspace.take("role", (2, 3), like)
    assert workspace.take("role", (2, 3), like) is small
    large = workspace.take("role", (4, 5), like)
    again = workspace.take("role", (2, 3), like)
    assert again is not small and again.data_ptr() == large.data_ptr()
    assert workspace.take("role", (2, 3), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.Conv2d(3, 4, 3, padding=1), (8, 8)),
        (nn.Conv2d(2, 3, (2, 5), padding="same", dilation=(3, 2)), (7, 3)),  # shifts past the row's end
        (nn.Conv2d(2, 3, (3, 1), padding=(4, 0), dilation=(2, 1)), (1, 5)),  # more output rows than input rows
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shifted_patches_are_im2col(conv, shape, dtype):
    """The stride-1 "same"-width patches, from shifted copies of the input, are F.unfold's bit for bit."""
    x = torch.randn(3, conv.in_channels, *shape)
    assert conv_module._shifted_patches(conv, x, dtype, None) is not None
    expected = F.unfold(
        F.pad(x, conv._reversed_padding_repeated_twice).to(dtype), conv.kernel_size, dilation=conv.dilation
    ).transpose(1, 2)
    workspace = Workspace()
    for buffers in (None, workspace, workspace):
        assert torch.equal(conv_module._conv_patches(conv, x, dtype, buffers), expected)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "sequence"])
def test_coordinate_sums_of_selected_rows_match_brute_force(kind):
    """Sums of a few rows of some parameters (the probe's coordinate budget), over two micro-batches:
    only those parameters get sums, each of the selected rows' shape, equal to brute force's rows."""
    model, x, y = make_case(kind)
    per_example = brute_force(model, x, y)
    names = list(per_example)
    rows = {n: slice(1, min(3, per_example[n].shape[1])) for n in names if n != names[1]}  # Embedding: vocab rows
    modules = {n: m for n, m in model.named_modules() if isinstance(m, PER_EXAMPLE_LAYERS)}
    collector = PerExampleGradients(modules, {}, 2)
    collector.attach(coordinates=rows)
    for half in (slice(0, B // 2), slice(B // 2, B)):
        F.cross_entropy(model(x[half]), y[half]).backward()
        collector.end_micro_batch(float(B // 2))
    collector.detach()
    step = collector.pop()
    assert set(step.grad_sum) == set(step.sum_sq) == set(rows)
    for n, r in rows.items():
        g = per_example[n][:, r]
        assert step.grad_sum[n].shape == g.shape[1:], n
        assert rel_close(step.grad_sum[n], g.sum(0)) and rel_close(step.sum_sq[n], g.square().sum(0)), n


def test_an_extra_forward_is_neither_measured_nor_read_as_layout_evidence():
    """T = B: trainvitals' own forward on the batch twice over, (2B, T), would show the examples on dimension 1
    and add calls to the step's. Run inside ``extra_forward`` (with a backward, even), it is neither: the step's
    per-example norms are brute force's."""
    model, x, y = make_case("sequence")
    assert x.shape[0] == x.shape[1] == B
    per_example = brute_force(model, x, y)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, PER_EXAMPLE_LAYERS)}
    collector = PerExampleGradients(modules, {}, 2)
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B, (x, y))
    with extra_forward():
        F.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])).backward()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    collector.end_micro_batch(float(B))
    collector.detach()
    step = collector.pop()
    truth = sum(g.flatten(1).square().sum(1) for g in per_example.values())
    assert not step.failed and rel_close(step.sq_norms[0], truth)


@pytest.mark.parametrize("kind", ["cnn", "sequence"])
def test_a_backward_that_creates_the_graph_gives_the_same_statistics(kind):
    """A backward with create_graph=True (Hessian-based optimizers, gradient penalties) runs the hooks
    in grad mode, with inputs that require grad."""
    model, x, y = make_case(kind)
    plain = hooked(model, x, y)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, PER_EXAMPLE_LAYERS)}
    collector = PerExampleGradients(modules, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward(create_graph=True)
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert not step.failed and rel_close(step.sq_norms[0], plain.sq_norms[0], 1e-12)
    assert not step.sq_norms[0].requires_grad
    for n in plain.sum_sq:
        assert rel_close(step.sum_sq[n], plain.sum_sq[n], 1e-12), n
        assert rel_close(step.grad_sum[n], plain.grad_sum[n], 1e-12), n


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Linear(5, 3), (5,)),
        (nn.Linear(5, 3), (4, 5)),
        (nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)),
    ],
    ids=["linear", "linear-3d", "conv"],
)
@pytest.mark.parametrize("trainable", [("weight",), ("bias",), ()], ids=["weight", "bias", "neither"])
def test_a_layer_frozen_after_planning_counts_only_its_trainable_parameters(layer, shape, trainable):
    torch.manual_seed(4)
    layer = layer.double()
    for n, p in layer.named_parameters():
        p.requires_grad_(n in trainable)
    x = torch.randn(B, *shape, dtype=torch.float64)
    grad_output = torch.randn_like(layer(x))
    truth = torch.zeros(B, dtype=torch.float64)
    for n in trainable:
        for i in range(B):  # brute force: each example's own gradient of the parameter
            (grad,) = torch.autograd.grad(layer(x[i : i + 1]), getattr(layer, n), grad_output[i : i + 1])
            truth[i] += grad.square().sum()
    sq = per_example_sq_norms(layer, x, grad_output)
    assert sq.shape == (B,) and rel_close(sq, truth, 1e-10)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Linear(5, 3), (5,)),
        (nn.Linear(5, 3), (4, 5)),
        (nn.Conv2d(2, 3, 3), (2, 5, 5)),
        (nn.Conv1d(2, 3, 3), (2, 5)),
        (nn.LayerNorm(5), (4, 5)),
        (nn.Embedding(7, 3), (4,)),
    ],
    ids=["linear", "linear-3d", "conv2d", "conv1d", "layernorm", "embedding"],
)
def test_an_empty_batch_gives_empty_norms_and_zero_sums(layer, shape):
    x = torch.randint(0, 7, (0, *shape)) if isinstance(layer, nn.Embedding) else torch.randn(0, *shape)
    grad_output = torch.zeros_like(layer(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "degrees of freedom <= 0" of a variance over nothing
        assert per_example_sq_norms(layer, x, grad_output, Workspace()).shape == (0,)
        sums = per_example_sums(layer, x, grad_output)
    for n, (total, total_sq) in sums.items():
        assert total.shape == total_sq.shape == getattr(layer, n).shape and not total.any() and not total_sq.any(), n


def test_under_bf16_autocast_the_coordinate_variance_comes_from_one_set_of_operands():
    """Nearly identical examples (per-coordinate SNR ~10⁴): the variance is a difference of two nearly
    equal terms. From Σg and Σg² of the same operands it is right; with ḡ from autograd's bf16 ``.grad``
    it would be rounding noise, ~100× off and clamped to 0 on a third of the coordinates."""
    torch.manual_seed(5)
    layer = nn.Linear(16, 4)
    x = torch.randn(1, 16).repeat(B, 1) + 1e-2 * torch.randn(B, 16)
    target = torch.randn(1, 4).repeat(B, 1)
    collector = PerExampleGradients({"layer": layer}, {}, 2)
    collector.attach(coordinates=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    F.mse_loss(out.float(), target, reduction="sum").backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    # brute force in float64 from the operands the layer's backward had: fp32 input, bf16 output gradient
    delta = (2 * (out.float() - target)).to(torch.bfloat16).double()
    truth = (delta[:, :, None] * x.double()[:, None, :]).var(0)
    mean = step.grad_sum["layer.weight"].double() / B
    variance = coordinate_variance(mean, step.sum_sq["layer.weight"].double(), B)
    assert rel_close(variance, truth, 1e-2)
    from_grad = coordinate_variance(layer.weight.grad.double() / B, step.sum_sq["layer.weight"].double(), B)
    assert ((from_grad - truth).abs() / truth).max() > 10  # what the mean from .grad gave


def test_gsnr_of_nearly_equal_float32_examples_is_that_of_float64_statistics():
    """Float32 per-example gradients that agree to ~1e-3 (GSNR up to ~1e6): each coordinate's GSNR and the EB
    criterion from the collector's sums match float64 statistics of a float32 per-example loop's gradients. The
    operands are dyadic with few bits, so every float32 gradient here is exact, the rules' and autograd's the
    same numbers: a difference can only come from the sums. float32 sums of them are ~10 % off."""
    torch.manual_seed(0)
    n, positions = 8, 3
    emb, lin = nn.Embedding(16, 4), nn.Linear(4, 3)  # a Linear on (n, 3, 4): per-example blocks
    with torch.no_grad():
        emb.weight.copy_(1 + torch.randint(-8, 9, (16, 4)) / 2**12)  # rows nearly equal, 13 bits
        lin.weight.copy_(torch.randint(-8, 9, (3, 4)) / 8)
        lin.bias.copy_(torch.randint(-8, 9, (3,)) / 8)
    model, c = nn.Sequential(emb, lin), torch.randint(-4, 5, (positions, 3)) / 4  # c: ∂(loss)/∂(output)
    tokens = torch.randint(0, 16, (n, positions))
    params = dict(model.named_parameters())
    grads = [torch.autograd.grad((model(tokens[i : i + 1]) * c).sum(), list(params.values())) for i in range(n)]
    per_example = {k: torch.stack([g[j] for g in grads]) for j, k in enumerate(params)}  # float32
    collector = PerExampleGradients({"0": emb, "1": lin}, {}, 2)
    collector.attach(coordinates=True)
    (model(tokens) * c).sum((1, 2)).mean().backward()
    collector.end_micro_batch(float(n))
    step = collector.pop()
    assert not step.failed and all(step.sum_sq[k].dtype == torch.float64 for k in params)

    def snr(total, total_sq):
        return gradient_snr(total / n, total_sq, n, precision=torch.float32)

    truth = {k: snr(g.double().sum(0), g.double().square().sum(0)) for k, g in per_example.items()}
    for k in per_example:
        torch.testing.assert_close(snr(step.grad_sum[k], step.sum_sq[k]), truth[k], rtol=1e-9, atol=0)
    weight = per_example["1.weight"].double()
    floor = torch.finfo(torch.float32).eps * weight.square().sum(0).mean() / (n - 1)
    assert truth["1.weight"][weight.var(0) > floor].min() > 1e5  # high GSNR, not held at the floor
    truth_eb = eb_criterion(
        [g.double().mean(0) for g in per_example.values()],
        [g.double().square().sum(0) for g in per_example.values()],
        [n] * 3,
        torch.float32,
    )
    eb = eb_criterion([step.grad_sum[k] / n for k in params], [step.sum_sq[k] for k in params], [n] * 3, torch.float32)
    assert abs(float(eb) - float(truth_eb)) < 1e-9 * abs(float(truth_eb))
    single = snr(weight.float().sum(0), weight.float().square().sum(0)).double()  # float32 sums
    assert ((single - truth["1.weight"]).abs() / truth["1.weight"]).max() > 1e-2


@pytest.mark.parametrize("kind", ["mlp", "sequence"])
def test_mean_and_sum_reduction_give_the_same_statistics(kind):
    model, x, y = make_case(kind)
    mean_step, sum_step = hooked(model, x, y, "mean"), hooked(model, x, y, "sum")
    assert rel_close(mean_step.sq_norms[0], sum_step.sq_norms[0], 1e-12)
    for n in mean_step.sum_sq:
        assert rel_close(mean_step.sum_sq[n], sum_step.sum_sq[n], 1e-12)
        assert rel_close(mean_step.grad_sum[n], sum_step.grad_sum[n], 1e-12)


def test_vmap_fallback_matches_brute_force():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), Scale(6), nn.PReLU(6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    per_example = brute_force(model, x, y)
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert set(plan.per_example) == {"0", "4"} and set(plan.vmap) == {"1", "2"}
    collector = PerExampleGradients(plan.per_example, plan.vmap, sub_batch=4)
    collector.attach(coordinates=True)
    F.cross_entropy(model(x), y).backward()
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert step.num_sub == 4 and not step.failed
    sub = {n: g[:4] for n, g in per_example.items() if n.startswith(("1.", "2."))}
    for n, g in sub.items():
        assert rel_close(step.sub_grad_sum[n], g.sum(0)) and rel_close(step.sub_sum_sq[n], g.square().sum(0)), n
    assert rel_close(step.sub_sq_norm_sum, sum(g.square().sum() for g in sub.values()))
    direct = vmap_per_example_grads(model[1], (x[:2].new_ones(2, 6),), {}, torch.ones(2, 6, dtype=torch.float64))
    assert torch.allclose(direct["scale"], torch.ones(2, 6, dtype=torch.float64))


@pytest.mark.parametrize("sub_batch", [2, 4, 8])
def test_kept_norms_add_the_vmap_layers_over_every_example(sub_batch):
    """With ``keep_norms`` the kept ‖g_i‖² are over every measured parameter, the torch.func layers' too, for
    every example (in chunks of the sub-batch past it); the sub-batch's statistics and the per-example-norm
    layers' Σ_i ‖g_i‖² stay what they are without."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), Scale(6), nn.PReLU(6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    per_example = brute_force(model, x, y)
    plan = plan_sources(model, groups_available=False, fallback=True)
    steps = []
    for keep in (True, False):
        collector = PerExampleGradients(plan.per_example, plan.vmap, sub_batch=sub_batch)
        collector.attach(coordinates=True, keep_norms=keep)
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        collector.end_micro_batch(1.0)
        collector.detach()
        steps.append(collector.pop())
    kept, plain = steps
    assert not kept.failed and len(kept.sq_norms) == 1 and not plain.sq_norms
    assert rel_close(kept.sq_norms[0], sum(g.flatten(1).square().sum(1) for g in per_example.values()), 1e-10)
    rules = sum(g.square().sum() for n, g in per_example.items() if n.startswith(("0.", "4.")))
    assert rel_close(kept.sq_norm_sum, rules, 1e-10) and rel_close(plain.sq_norm_sum, rules, 1e-10)
    assert kept.num_sub == plain.num_sub == min(sub_batch, B)
    assert rel_close(kept.sub_sq_norm_sum, plain.sub_sq_norm_sum, 1e-12)
    for n in plain.sub_grad_sum:
        assert rel_close(kept.sub_grad_sum[n], plain.sub_grad_sum[n], 1e-12), n


def test_sub_batch_estimates_are_the_per_example_ones_on_the_whole_batch():
    torch.manual_seed(2)
    g = torch.randn(8, 5, dtype=torch.float64) + 1.0
    mean_sq = g.mean(0).square().sum()
    full = per_example_estimates(g.square().sum(), mean_sq, 8)
    sub = sub_batch_estimates(g.square().sum(), mean_sq, 8, mean_sq, 8)
    assert torch.allclose(torch.stack(full), torch.stack(sub))
    with pytest.raises(ValueError, match="num_sub"):
        sub_batch_estimates(g[0].square().sum(), mean_sq, 1, mean_sq, 8)
    with pytest.raises(ValueError, match="batch_size"):
        sub_batch_estimates(g.square().sum(), mean_sq, 8, mean_sq, 4)


def test_module_run_twice_is_measured_from_both_uses():
    """The per-example gradient of a layer used twice is the sum of its uses': its norm has cross terms."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    truth = []
    for i in range(4):
        layer.zero_grad()
        layer(torch.tanh(layer(x[i : i + 1]))).sum().backward()
        truth.append(sum(p.grad.square().sum() for p in layer.parameters()))
    collector = PerExampleGradients({"layer": layer}, {}, 2)
    collector.attach(keep_norms=True)
    layer(torch.tanh(layer(x))).sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed and rel_close(step.sq_norms[0], torch.stack(truth))


class AllocatedBytes(TorchDispatchMode):
    """Bytes of every tensor any op returns (views counted again): an upper bound on what is allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _form_multiply_adds(positions: int, fan_in: int, fan_out: int) -> dict[str, int]:
    """Each form's multiply-adds for one example's ‖Σ_t δ_t a_tᵀ‖²_F, brute force: its matmuls as torch's
    FlopCounterMode counts them (2 FLOPs a multiply-add), run on meta tensors, and one multiply-add per
    element its last reduction reads (the block's I·O entries, the Gram matrices' T²)."""
    a = torch.empty(1, positions, fan_in, device="meta")
    g = torch.empty(1, positions, fan_out, device="meta")
    counted = {}
    for form in ("blocks", "gram"):
        with FlopCounterMode(display=False) as flops:
            if form == "blocks":
                reduced = torch.bmm(g.transpose(1, 2), a).numel()
            else:
                torch.bmm(g, g.transpose(1, 2))
                reduced = torch.bmm(a, a.transpose(1, 2)).numel()
        counted[form] = flops.get_total_flops() // 2 + reduced
    return counted


@pytest.mark.parametrize("positions", [2, 3, 8, 16, 64, 256, 1024])
def test_the_linear_rule_picks_the_form_with_fewer_multiply_adds(positions, bmm_roles):
    """On sequences (T positions), over a grid of I and O: the form LinearRule computes in (its workspace
    buffers, the rule run on meta tensors) is the one with fewer multiply-adds by brute force."""
    for fan_in, fan_out in itertools.product((4, 16, 64, 768, 3072), repeat=2):
        counted = _form_multiply_adds(positions, fan_in, fan_out)
        linear = nn.Linear(fan_in, fan_out, device="meta")
        x = torch.empty(2, positions, fan_in, device="meta")
        bmm_roles.clear()
        rule_for(linear).sq_norms(linear, [Use(x, torch.empty(2, positions, fan_out, device="meta"))], Workspace())
        chosen = bmm_roles.form()
        if counted["gram"] != counted["blocks"]:
            assert chosen == min(counted, key=counted.get), (positions, fan_in, fan_out, counted)
    # GPT-2's MLP on 1024 tokens: the Gram matrices' 1.7× the block's (the earlier rule, 2T² ≤ I·O, took them)
    if positions == 1024:
        counted = _form_multiply_adds(1024, 768, 3072)
        assert counted["gram"] > 1.6 * counted["blocks"]


def test_ghost_norms_materialise_no_per_example_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    batch = 64
    x, y = torch.randn(batch, 128), torch.randint(0, 10, (batch,))

    def allocated(attach: bool, coordinates: bool = False) -> int:
        collector = PerExampleGradients({n: m for n, m in model.named_children() if isinstance(m, nn.Linear)}, {}, 2)
        if attach:
            collector.attach(coordinates=coordinates)
        model.zero_grad(set_to_none=True)
        with AllocatedBytes() as counter:
            F.cross_entropy(model(x), y).backward()
            collector.end_micro_batch(float(batch))
        collector.detach()
        return counter.total

    bare = allocated(False)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < allocated(True) - bare < 0.1 * batch * parameter_bytes
    # Σ_i g_i and Σ_i g_i² for 2-D Linear inputs: ΔᵀA and (Δ²)ᵀ(A²), a few parameter-sized float64 tensors
    # each whatever the batch (this counter also counts views), not the B parameter-sized per-example gradients
    assert allocated(True, coordinates=True) - bare < 0.25 * batch * 2 * parameter_bytes


@pytest.mark.parametrize(
    ("make_loss", "expected"),
    [
        (lambda x, y: F.cross_entropy(x, y), "mean"),
        (lambda x, y: F.cross_entropy(x, y, reduction="sum"), "sum"),
        (lambda x, y: F.cross_entropy(x, y, label_smoothing=0.1), "mean"),
        (lambda x, y: F.cross_entropy(x, torch.softmax(torch.randn(4, 3), 1)), "mean"),
        (
            lambda x, y: F.mse_loss(x, torch.zeros(4, 3)) + 0.1 * x.new_ones(5, 5, requires_grad=True).square().sum(),
            "mean",
        ),
        (lambda x, y: x.square().sum(1).mean(), "mean"),
        (lambda x, y: x.square().mean(1).sum(), "sum"),
        (lambda x, y: F.cross_entropy(x, y) / 2 * torch.tensor(1024.0), "mean"),  # Lightning's /A, an AMP scale
        (lambda x, y: x.square().sum() / 8, "mean"),  # a sum divided by (examples × tokens)
        (lambda x, y: F.cross_entropy(x, y, reduction="none").sum() / 1, "sum"),  # Lightning's /1 without accumulation
        (lambda x, y: F.cross_entropy(x, y, reduction="none").sum() / 2, "sum"),  # Lightning's /A skipped
        (lambda x, y: F.cross_entropy(x, y, reduction="none").sum() / 2 / 2, "scaled"),  # then a ½ factor
        (lambda x, y: F.cross_entropy(x, y, reduction="sum") / 2 / 6 * 3, "scaled"),  # a sum over 2: no mean of 4
        (lambda x, y: F.cross_entropy(x, y, reduction="sum") / 2 / 8, "mean"),  # over 2 × 4 examples
        (lambda x, y: F.cross_entropy(x, y, reduction="sum") / 2 * 0, None),  # nothing reduced
        (lambda x, y: torch.logsumexp(x, 0).sum(), None),
        (lambda x, y: F.cross_entropy(x, y) + x.square().sum(), None),
        # Parts that agree on the kind over different numbers of terms: an auxiliary loss
        (
            lambda x, y: F.cross_entropy(x, y, reduction="sum") + F.mse_loss(x, torch.zeros(4, 3), reduction="sum"),
            "sum",
        ),
        (lambda x, y: F.cross_entropy(x, y) + 0.1 * F.mse_loss(x, torch.zeros(4, 3)), "mean"),
    ],
)
def test_detect_loss_reduction(make_loss, expected):
    x = torch.randn(4, 3, requires_grad=True)
    found = detect_loss_reduction(make_loss(x, torch.tensor([0, 1, 2, 0])), batch_size=4, accumulation=2)
    assert getattr(found, "kind", None) == expected


@pytest.mark.parametrize(
    ("make_loss", "terms"),
    [
        (lambda x, y: F.cross_entropy(x.flatten(0, 1), y.flatten(), reduction="sum"), 4 * 5),  # per token
        (lambda x, y: F.cross_entropy(x.transpose(1, 2), y, reduction="sum"), 4 * 5),  # (N, C, T)
        (lambda x, y: F.cross_entropy(x[:, 0], y[:, 0], reduction="sum"), 4),  # per example
        (lambda x, y: F.mse_loss(x, torch.zeros_like(x), reduction="sum"), 4 * 5 * 3),  # per element
        (lambda x, y: F.cross_entropy(x.flatten(0, 1), y.flatten(), reduction="none").sum(), 4 * 5),
        (lambda x, y: x.square().sum((1, 2)).mean(), 4),
        # Not known: the mean of a (4, 5 · 3) soft-target cross-entropy divides by 4, of a grid by all
        (lambda x, y: F.cross_entropy(x.flatten(1), torch.softmax(x.flatten(1).detach(), 1), reduction="sum"), None),
        (lambda x, y: x.square().sum(), None),
        (
            lambda x, y: (
                F.cross_entropy(x[:, 0], y[:, 0], reduction="sum")  # 4 terms and 20: which mean?
                + F.cross_entropy(x.flatten(0, 1), y.flatten(), reduction="sum")
            ),
            None,
        ),
    ],
)
def test_detect_loss_reduction_counts_the_terms(make_loss, terms):
    """A summed loss has ``terms``× the gradient of the mean over those terms: for a per-token loss that is
    examples × tokens, not the examples alone; where the graph does not say which mean, ``None``."""
    x = torch.randn(4, 5, 3, requires_grad=True)
    found = detect_loss_reduction(make_loss(x, torch.randint(0, 3, (4, 5))), batch_size=4)
    assert found is not None and found.terms == terms


def _padded(lengths: list[int], T: int = 6, V: int = 3, pad: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, T, V) and targets with ``pad`` after each example's length."""
    y = torch.randint(0, V, (len(lengths), T))
    for b, n in enumerate(lengths):
        y[b, n:] = pad
    return torch.randn(len(lengths), T, V, requires_grad=True), y


@pytest.mark.parametrize(
    ("make_loss", "kind"),
    [
        (lambda x, y, m: F.cross_entropy(x[m], y[m]), "mean"),  # a token mean over a padding mask
        (lambda x, y, m: F.cross_entropy(x.flatten(0, 1)[m.flatten()], y.flatten()[m.flatten()]), "mean"),
        (lambda x, y, m: F.cross_entropy(x.transpose(1, 2), y.clamp(min=0), reduction="none")[m].mean(), "mean"),
        (lambda x, y, m: torch.masked_select(x.square().sum(-1), m).mean(), "mean"),
        (lambda x, y, m: F.cross_entropy(x[m], y[m], reduction="sum"), "sum"),
    ],
)
def test_a_loss_over_the_masked_tokens_of_a_batch_reduces_over_the_tokens_kept(make_loss, kind):
    """A loss over ``x[mask]`` reduces a selection of the batch's tokens (its leading dimension is no multiple
    of B): read as a mean or a sum over exactly the tokens the mask keeps, the mean dividing by their number."""
    lengths = [2, 3, 6, 2]  # 13 tokens kept: no multiple of the 4 examples
    x, y = _padded(lengths)
    found = detect_loss_reduction(make_loss(x, y, y != -100) / 2, batch_size=4, accumulation=2)
    assert found is not None and (found.kind, found.terms) == (kind, 13)
    assert (None if found.count is None else float(found.count)) == (13 if kind == "mean" else None)  # /A skipped
    assert detect_loss_reduction(make_loss(x, y, y != -100), batch_size=5) is None  # not selected from a batch of 5


@pytest.mark.parametrize(
    ("make_loss", "count"),
    [
        (lambda x, y, m: F.cross_entropy(x.flatten(0, 1), y.flatten()), 2 + 3 + 6 + 2),  # ignore_index: kept targets
        (lambda x, y, m: F.cross_entropy(x.transpose(1, 2), y), 2 + 3 + 6 + 2),
        (
            lambda x, y, m: (F.cross_entropy(x.transpose(1, 2), y.clamp(min=0), reduction="none") * m).sum() / m.sum(),
            2 + 3 + 6 + 2,
        ),
        (lambda x, y, m: F.cross_entropy(x.transpose(1, 2), y.clamp(min=0)), 4 * 6),  # every token, padding too
        (lambda x, y, m: x.square().mean(), 4 * 6 * 3),
        (lambda x, y, m: x.square().sum((1, 2)).mean(), 4),
        (lambda x, y, m: F.cross_entropy(x.transpose(1, 2), y.clamp(min=0), reduction="sum"), None),  # a sum
        (lambda x, y, m: F.cross_entropy(x.transpose(1, 2), y.clamp(min=0), reduction="sum") / 7, 7),  # divided
    ],
)
def test_a_mean_says_what_it_divides_by(make_loss, count):
    """What a loss divides the sum of its terms by, against the hand count: ``nll_loss``'s kept targets
    (``ignore_index`` left out), a ``mask.sum()`` divisor, a mean's elements; ``None`` for a sum divided by
    nothing. Lightning's /A is not in it."""
    x, y = _padded([2, 3, 6, 2])
    found = detect_loss_reduction(make_loss(x, y, y != -100) / 2, batch_size=4, accumulation=2)
    assert found is not None
    assert (None if found.count is None else float(found.count)) == count


@pytest.mark.parametrize(
    ("make_loss", "count"),
    [
        # transformers' num_items_in_batch: the micro-batch's token sum over the accumulation window's 35 tokens,
        # times the accumulate_grad_batches (2) Lightning divides by
        (lambda x, y, m: F.cross_entropy(x[m], y[m], reduction="sum") / 35 * 2, 35 / 2),
        (lambda x, y, m: 2 * F.cross_entropy(x[m], y[m], reduction="sum") / torch.tensor(35), 35 / 2),
        (lambda x, y, m: F.cross_entropy(x[m], y[m], reduction="sum") / 3, 3),
        (lambda x, y, m: F.cross_entropy(x[m], y[m], reduction="sum") * 0.5, 2),
    ],
)
def test_a_sum_divided_by_a_number_that_is_neither_1_nor_the_examples_is_scaled(make_loss, count):
    """A sum over the 13 kept tokens divided by a number (over its multiplications) that is not a multiple of the 4
    examples is neither a mean nor a sum over them: ``"scaled"``, with the number it divides by. Lightning's /A and
    an AMP scale (a CPU scaler's) are not in it."""
    x, y = _padded([2, 3, 6, 2])
    m = y != -100
    found = detect_loss_reduction(make_loss(x, y, m) / 2, batch_size=4, accumulation=2)
    assert found is not None and (found.kind, found.terms) == ("scaled", 13)
    assert found.count == pytest.approx(count)
    amp = torch.tensor(1024.0)
    scaled = detect_loss_reduction(make_loss(x, y, m) / 2 * amp, batch_size=4, accumulation=2, loss_scale=amp)
    assert scaled == found and scaled.count == pytest.approx(count)
    # The gradient is (terms / count)× that of the mean over the same terms, checked against autograd
    mean = torch.autograd.grad(F.cross_entropy(x[m], y[m]), x)[0]
    grad = torch.autograd.grad(make_loss(x, y, m), x)[0]
    assert float(grad.norm() / mean.norm()) == pytest.approx(13 / count, rel=1e-5)


def test_plan_sources():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Scale(4), nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    model[4].weight = model[3].weight  # tied between two layers with rules: measured together
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert list(plan.per_example) == ["0", "3", "4"] and list(plan.vmap) == ["2"] and plan.coupled == ("1",)
    assert plan.uncovered["1.weight"].startswith("BatchNorm") and set(plan.uncovered) == {"1.weight", "1.bias"}
    assert "3.weight" in plan.parameters("per_example") and "4.weight" not in plan.parameters("per_example")
    assert "not measured" in plan.describe(model)
    grouped = plan_sources(model, groups_available=True, fallback=False)
    assert set(grouped.micro_batch) == {"1.weight", "1.bias", "2.scale"}
    assert not grouped.uncovered
    off = plan_sources(model, groups_available=False, fallback=False, exclude=["0", "3"])
    assert not off.per_example and not off.vmap and off.uncovered["2.scale"].endswith("fallback off")
    assert off.uncovered["4.weight"] == "tied parameter, fallback off"  # its partner failed: neither is measured
    with_no_rule = nn.Sequential(nn.LayerNorm(4), Scale(4))
    with_no_rule[0].weight = with_no_rule[1].scale  # tied to a layer without a rule: neither, nor torch.func
    plan = plan_sources(with_no_rule, groups_available=False, fallback=True)
    assert not plan.per_example and not plan.vmap and set(plan.uncovered.values()) == {"tied parameter"}
    grouped = plan_sources(with_no_rule, groups_available=True, fallback=True)
    assert set(grouped.micro_batch) == {"0.weight", "0.bias"}  # the tied tensor once


class WithPositions(nn.Module):
    """A root-level position table beside layers of its own (a ViT's ``pos_embed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.zeros(4))
        self.body = nn.Sequential(nn.Linear(4, 4), Scale(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.positions)


def test_torch_func_never_re_runs_a_subtree():
    """torch.func re-runs the module that owns a parameter: for the root's position table, the whole model
    on every measured step. Such a parameter is measured where the graph broadcasts it over the batch; excluded
    (its graph showed another use), it is left to micro-batches/ranks, or reported unmeasured."""
    model = WithPositions()
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert list(plan.per_example) == ["", "body.0"] and list(plan.vmap) == ["body.1"]  # a leaf module: re-run alone
    assert not plan.uncovered and "parameters broadcast over the batch×1" in plan.describe(model)
    excluded = plan_sources(model, groups_available=False, fallback=True, exclude=[""])
    assert list(excluded.per_example) == ["body.0"]
    assert excluded.uncovered["positions"].startswith("a parameter of a module whose forward also runs layers with")
    grouped = plan_sources(model, groups_available=True, fallback=True, exclude=[""])
    assert set(grouped.micro_batch) == {"positions", "body.1.scale"} and not grouped.uncovered
    norm_child = nn.Sequential(Scale(4))  # a child without a weight matrix is cheap to re-run
    norm_child.weight = nn.Parameter(torch.ones(4, 4))
    assert list(plan_sources(norm_child, groups_available=False, fallback=True).vmap) == ["", "0"]
    big_table = nn.Sequential(nn.Linear(4, 4))  # a large table of its own does not make the child cheap
    big_table.table = nn.Parameter(torch.ones(1000, 4))
    assert "table" in plan_sources(big_table, groups_available=False, fallback=True, exclude=[""]).uncovered


def test_noise_scale_error_shrinks_with_steps_and_flags_one_update():
    torch.manual_seed(0)
    noise, error = NoiseScaleEMA(0.9), NoiseScaleError(0.9)
    noise.update(torch.tensor(1.0), torch.tensor(10.0))
    error.update(torch.tensor(1.0), torch.tensor(10.0))
    assert torch.isinf(error.relative_error(noise))
    spreads = []
    for _ in range(200):
        g, s = 1.0 + 0.3 * torch.randn(()), 10.0 + 2.0 * torch.randn(())
        noise.update(g, s)
        error.update(g, s)
        spreads.append(float(error.relative_error(noise)))
    # independent steps: Var(ratio)/ratio² ≈ (0.3² + 0.2²)/n_eff, n_eff = (1 + β)/(1 − β) = 19
    assert 0.6 * (0.13 / 19) ** 0.5 < spreads[-1] < 1.6 * (0.13 / 19) ** 0.5
    restored = NoiseScaleError(0.9)
    restored.load_state_dict(error.state_dict())
    assert torch.allclose(restored.relative_error(noise), error.relative_error(noise))


def test_coordinate_variance_never_goes_negative():
    # ḡ rounded (as a bf16 .grad would be) slightly above sqrt(Σg²/B): the raw difference is negative.
    sum_sq = torch.tensor([4.0, 1.0])
    mean_grad = torch.tensor([1.0001, 0.1])
    assert (coordinate_variance(mean_grad, sum_sq, 4) >= 0).all()
    assert coordinate_variance(mean_grad, sum_sq, 4)[1].item() == pytest.approx((1.0 - 4 * 0.01) / 3)


def test_a_tied_parameter_counts_once_in_the_coverage_line():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Scale(4), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    line = plan_sources(model, groups_available=False, fallback=False).describe(model)
    shares = [float(x) for x in re.findall(r"([\d.]+)% of parameters", line)]
    assert shares and all(0 < s <= 100 for s in shares)


class OwnTable(nn.Module):
    """A model's own position table beside a Linear child: torch.func would re-run the child, so excluded (as after
    its graph showed a use other than broadcast), it is not measured."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.proj = nn.Parameter(torch.zeros(4)), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.table)


def test_the_coverage_line_nests_no_parentheses():
    """The unmeasured parameters' reasons hold parentheses of their own: they follow the share, not inside it."""
    model = OwnTable()
    line = plan_sources(model, groups_available=False, fallback=True, exclude=[""]).describe(model)
    depth = deepest = 0
    for char in line:
        depth += {"(": 1, ")": -1}.get(char, 0)
        deepest = max(deepest, depth)
    assert (
        "not measured: 1 tensor (" in line and "not measurable where the graph broadcasts it" in line and deepest == 1
    ), line


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("groups_available", [False, True])
def test_multihead_attention_is_planned_for_per_example_norms(groups_available):
    model = Attention()
    plan = plan_sources(model, groups_available=groups_available, fallback=True)
    assert set(plan.per_example) == {"attn", "head"} and not plan.vmap and not plan.micro_batch
    attention_params = {"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"}
    assert attention_params < set(plan.parameters("per_example")) and not plan.uncovered
    assert "MultiheadAttention×1" in plan.describe(model)


def test_the_coverage_line_names_the_tensors_it_leaves_out():
    """Each reason with the tensors it keeps out, by name: a position table and BatchNorm's affine pair."""
    model = nn.Sequential(OwnTable(), nn.BatchNorm1d(4))
    line = plan_sources(model, groups_available=False, fallback=True, exclude=["0"]).describe(model)
    assert "not measured: 3 tensors" in line, line
    assert "`0.table`: " in line and "`1.weight`, `1.bias`: BatchNorm couples the examples" in line, line
    assert line.count("BatchNorm couples the examples") == 1, line
