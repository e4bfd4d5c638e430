"""Each registered per-example rule against brute force (one backward per example, float64), and the
registry's extension point: a rule for a layer of one's own."""

from __future__ import annotations

import pytest
import torch
from _models import Scale
from conftest import HostReads
from torch import nn

from trainvitals.per_example import (
    PER_EXAMPLE_LAYERS,
    Capture,
    PerExampleGradients,
    PerExampleRule,
    PerExampleStep,
    SourcePlan,
    plan_sources,
    register_per_example_rule,
    registered_types,
    rule_for,
    unregister_per_example_rule,
    unsupported_reason,
)

B = 5


def per_example_truth(model: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: (B, *shape)}: ∇ of ℓ_i = ⟨model(x_i), weights_i⟩, one backward per example."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for i in range(x.shape[0]):
        model.zero_grad()
        (model(x[i : i + 1]) * weights[i : i + 1]).sum().backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


def measured(model: nn.Module, x: torch.Tensor, weights: torch.Tensor):
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    (model(x) * weights).sum().backward()
    collector.end_micro_batch(1.0)
    collector.detach()
    return plan, collector.pop()


def assert_step_is(plan: SourcePlan, step: PerExampleStep, truth: dict[str, torch.Tensor]) -> None:
    """Every parameter measured per example, and ‖g_i‖², Σ_i g_i and Σ_i g_i² those of ``truth`` ({name: (B, *shape)})."""
    assert not plan.uncovered and not step.failed
    assert set(plan.parameters("per_example")) == set(truth)
    expected = sum(g.flatten(1).square().sum(1) for g in truth.values())
    torch.testing.assert_close(step.sq_norms[0], expected, rtol=1e-9, atol=1e-12)
    for name, g in truth.items():
        torch.testing.assert_close(step.grad_sum[name], g.sum(0), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step.sum_sq[name], g.square().sum(0), rtol=1e-9, atol=1e-12)


def assert_matches(model: nn.Module, x: torch.Tensor) -> None:
    torch.manual_seed(1)
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    weights = torch.randn_like(model(x))
    truth = per_example_truth(model, x, weights)
    plan, step = measured(model, x, weights)
    assert_step_is(plan, step, truth)


def same_graph_truth(model: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: (B, *shape)}: ∇ of ℓ_i = ⟨model(x)_i, weights_i⟩ through ONE forward of the whole batch, so that
    each example's gradient sees that forward's own dropout masks."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = model(x)
    per_example = [
        torch.autograd.grad(
            (out[i] * weights[i]).sum(),
            list(params.values()),
            retain_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )
        for i in range(x.shape[0])
    ]
    return {n: torch.stack([g[k] for g in per_example]) for k, n in enumerate(params)}


def assert_matches_same_graph(model: nn.Module, x: torch.Tensor, seed: int = 3) -> None:
    """As :func:`assert_matches`, for a model that draws random masks in training: the truth and the measured
    forward draw them from the same seed (the outputs are compared), and the generator is left as the
    forward left it."""
    torch.manual_seed(1)
    model = model.double().train()
    x = x.double() if x.is_floating_point() else x
    weights = torch.randn_like(model(x))
    torch.manual_seed(seed)
    truth = same_graph_truth(model, x, weights)
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    torch.manual_seed(seed)
    out = model(x)
    state = torch.get_rng_state()
    (out * weights).sum().backward()
    collector.end_micro_batch(1.0)
    collector.detach()
    step = collector.pop()
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(seed)
    assert torch.equal(model(x), out)  # the truth's forward drew these masks too
    assert_step_is(plan, step, truth)


def eval_mode(module: nn.Module) -> nn.Module:
    """Running statistics that are not the defaults (0 and 1), then eval mode."""
    with torch.no_grad():
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    return module.eval()


LAYERS = {
    "conv3d": (lambda: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1, dilation=(1, 1, 2)), (B, 2, 4, 5, 5)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (B, 3, 5)),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        (B, 3, 4, 4),
    ),
    "conv_transpose3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False), (B, 2, 2, 3, 2)),
    "conv2d_depthwise": (lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4), (B, 4, 5, 5)),
    "conv1d_groups_stride": (
        lambda: nn.Conv1d(6, 4, 3, stride=2, groups=2, padding_mode="circular", padding=1),
        (B, 6, 9),
    ),
    "conv_transpose2d_groups": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (B, 4, 3, 3)),
    "group_norm": (lambda: nn.GroupNorm(2, 6), (B, 6, 3, 3)),
    "group_norm_2d": (lambda: nn.GroupNorm(2, 6), (B, 6)),
    "instance_norm1d": (lambda: nn.InstanceNorm1d(3, affine=True), (B, 3, 7)),
    "instance_norm2d_running_stats_eval": (
        lambda: eval_mode(nn.InstanceNorm2d(3, affine=True, track_running_stats=True)),
        (B, 3, 4, 4),
    ),
    "instance_norm3d": (lambda: nn.InstanceNorm3d(2, affine=True), (B, 2, 3, 3, 2)),
    "rms_norm": (lambda: nn.RMSNorm(6), (B, 4, 6)),
    "rms_norm_eps_2d_shape": (lambda: nn.RMSNorm((3, 4), eps=1e-3), (B, 2, 3, 4)),
    "batch_norm2d_eval": (lambda: eval_mode(nn.BatchNorm2d(3)), (B, 3, 4, 4)),
    "batch_norm1d_eval": (lambda: eval_mode(nn.BatchNorm1d(4)), (B, 4)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_matches_brute_force(name):
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = make()
    assert_matches(nn.Sequential(layer, nn.Tanh()), torch.randn(shape))


def test_batchnorm_in_training_mode_is_named_as_coupling_the_examples():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert plan.coupled == ("1",) and plan.uncovered["1.weight"].startswith("BatchNorm couples")
    model.eval()
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert plan.coupled == () and set(plan.per_example) == {"0", "1"}


def test_batchnorm_put_in_training_mode_after_planning_fails_not_measures():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval()
    collector = PerExampleGradients(plan_sources(model, False, False).per_example, {}, 2)
    collector.attach()
    model.train()
    model(torch.randn(4, 3)).sum().backward()
    collector.end_micro_batch(1.0)
    assert "couple the examples" in collector.pop().failed["1"]


class ScaledScale(Scale):
    """Keeps Scale's forward: Scale's rule serves it."""


class Shifted(Scale):
    """A forward of its own: Scale's rule would be wrong for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1.0) * self.scale


@pytest.fixture
def scale_rule():
    yield
    unregister_per_example_rule(Scale, ScaledScale)


def test_a_rule_for_a_layer_of_ones_own_is_registered_without_editing_trainvitals(scale_rule):
    model = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 2))
    assert unsupported_reason(model[1]) == "Scale has no per-example identity"

    @register_per_example_rule(Scale)
    def scale_grads(module, inputs, grad_output):
        return {"scale": (inputs * grad_output).reshape(len(inputs), -1, inputs.shape[-1]).sum(1)}

    assert rule_for(ScaledScale(4)) is rule_for(Scale(4)) and rule_for(Shifted(4)) is None
    assert_matches(model, torch.randn(B, 3, 4))  # (B, T, D): summed over T
    assert_matches(nn.Sequential(ScaledScale(4), nn.Linear(4, 2)), torch.randn(B, 4))


def test_a_rule_class_with_a_ghost_norm_of_its_own(scale_rule):
    calls = []

    @register_per_example_rule(Scale)
    class ScaleRule(PerExampleRule):
        def grads(self, module, uses):
            return {"scale": sum((u.inputs * u.grad_output).reshape(len(u.inputs), -1, 3).sum(1) for u in uses)}

        def sq_norms(self, module, uses, workspace=None):
            calls.append(len(uses))
            return super().sq_norms(module, uses, workspace)

    assert_matches(nn.Sequential(Scale(3), nn.Tanh(), nn.Linear(3, 2)), torch.randn(B, 3))
    assert calls == [1]


def test_register_rejects_what_is_not_a_module_type_or_a_rule():
    with pytest.raises(TypeError, match="module_types"):
        register_per_example_rule(int)
    with pytest.raises(TypeError, match="PerExampleRule or a function"):
        register_per_example_rule(Scale)(3)
    with pytest.raises(TypeError, match="`whole_call`.*set `whole_call = True` on the class"):
        register_per_example_rule(Scale, whole_call=True)(PerExampleRule)  # was ignored: the rule saw the first input
    assert Scale not in registered_types()


class SharedLayers(nn.Module):
    """Each layer called twice in a forward, the second output of ``unused`` left out of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.unused = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.emb(tokens.flip(1))  # (B, T, 4)
        h = self.norm(torch.tanh(self.proj(self.norm(h))))
        h = self.proj(h)
        c = self.conv(torch.tanh(self.conv(h.transpose(1, 2)))).transpose(1, 2)
        self.unused(h)
        return self.unused(c)


def test_layers_called_several_times_are_measured_from_all_their_uses():
    torch.manual_seed(0)
    assert_matches(SharedLayers(), torch.randint(0, 7, (B, 5)))


class TiedDecoder(nn.Module):
    """A language model whose output layer is its token embedding (GPT-2, T5)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(9, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.tokens(tokens))))


def test_tied_embedding_and_output_layer_are_measured_together():
    torch.manual_seed(0)
    model = TiedDecoder()
    plan = plan_sources(model, groups_available=False, fallback=False)
    assert set(plan.per_example) == {"tokens", "block", "head"} and "head.weight" not in plan.parameters("per_example")
    tokens = torch.randint(0, 9, (B, 4))
    tokens[0, :2] = 3  # a repeated token
    assert_matches(model, tokens)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layer_recomputed_by_checkpointing_is_measured_once(reentrant):
    torch.manual_seed(0)
    x = torch.randn(B, 4)
    if reentrant:
        x.requires_grad_()  # reentrant checkpointing back-propagates only into inputs that require grad
    assert_matches(Checkpointed(reentrant), x)


def test_a_forward_without_backward_leaves_the_next_micro_batch_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    collector = PerExampleGradients(plan_sources(model, False, False).per_example, {}, 2)
    collector.attach(keep_norms=True)
    x = torch.randn(B, 3, dtype=torch.float64)
    collector.begin_micro_batch()
    model(x)  # a training step that returns None: no backward
    collector.begin_micro_batch()
    model(x).sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed and step.sq_norms[0].shape == (B,)


class Attention(nn.Module):
    """Self- or cross-attention on batch-first ``(B, T, 6)`` inputs, whatever the layer's layout."""

    def __init__(
        self,
        batch_first: bool = True,
        bias: bool = True,
        use_weights: bool = False,
        masks: bool = False,
        kdim: int | None = None,
        dropout: float = 0.0,
        add_zero_attn: bool = False,
    ) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(
            6, 2, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim, dropout=dropout, add_zero_attn=add_zero_attn
        )
        self.memory = nn.Linear(6, kdim) if kdim else None
        self.use_weights, self.masks = use_weights, masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.memory(x[:, :3]) if self.memory is not None else x
        kwargs = {}
        if self.masks:
            t = x.shape[1]
            kwargs["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(1)  # causal
            kwargs["key_padding_mask"] = torch.zeros(x.shape[0], t).index_fill_(1, torch.tensor([t - 1]), -1e4)
        q, kv = (x, kv) if self.attn.batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
        out, weights = self.attn(q, kv, kv, need_weights=self.use_weights, **kwargs)
        out = out if self.attn.batch_first else out.transpose(0, 1)
        return out + weights.square().sum(-1, keepdim=True) if self.use_weights else out


ATTENTION_OPTIONS = {
    "default": {},
    "sequence-first": {"batch_first": False},
    "no-bias": {"bias": False},
    "weights-in-the-loss": {"use_weights": True},
    "masks": {"masks": True, "batch_first": False},
    "kdim-vdim": {"kdim": 4},
    "zero-attention": {"add_zero_attn": True},
}


@pytest.mark.parametrize("options", list(ATTENTION_OPTIONS.values()), ids=list(ATTENTION_OPTIONS))
def test_multihead_attention_matches_brute_force(options):
    torch.manual_seed(0)
    model = Attention(**options)
    assert rule_for(model.attn) is not None and unsupported_reason(model.attn) is None
    assert_matches(model, torch.randn(B, 4, 6))


def assert_matches_in_one_graph(model: nn.Module, x: torch.Tensor) -> None:
    """Against each example's gradient through the batch's own graph (one forward, its dropout masks drawn
    once): ∇ of ℓ_i = ⟨model(x)_i, weights_i⟩ by ``torch.autograd.grad`` per example, in float64."""
    torch.manual_seed(1)
    model = model.double().train()
    x = x.double()
    assert not torch.equal(model(x), model(x))  # dropout draws masks: one forward per example would not do
    weights = torch.randn_like(model(x))
    plan = plan_sources(model, groups_available=False, fallback=False)
    assert not plan.uncovered
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.expect_batch(len(x))  # sequence-first layers: the examples on dimension 1
    terms = (model(x) * weights).flatten(1).sum(1)
    terms.sum().backward(retain_graph=True)
    collector.end_micro_batch(1.0)
    collector.detach()
    step = collector.pop()
    assert not step.failed
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(plan.parameters("per_example")) == set(params)
    per_example = [torch.autograd.grad(terms[i], list(params.values()), retain_graph=True) for i in range(len(x))]
    truth = {n: torch.stack([g[j] for g in per_example]) for j, n in enumerate(params)}
    expected = sum(g.flatten(1).square().sum(1) for g in truth.values())
    torch.testing.assert_close(step.sq_norms[0], expected, rtol=1e-9, atol=1e-12)
    for name, g in truth.items():
        torch.testing.assert_close(step.grad_sum[name], g.sum(0), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step.sum_sq[name], g.square().sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("options", list(ATTENTION_OPTIONS.values()), ids=list(ATTENTION_OPTIONS))
def test_multihead_attention_with_dropout_matches_each_examples_gradient_in_its_graph(options):
    torch.manual_seed(0)
    assert_matches_in_one_graph(Attention(dropout=0.3, **options), torch.randn(B, 4, 6))


class Transformer(nn.Module):
    """nn.TransformerEncoderLayer or nn.TransformerDecoderLayer at their defaults (dropout 0.1, sequence-first)
    on batch-first ``(B, T, 8)`` inputs; the decoder's memory is a Linear of the first positions."""

    def __init__(self, decoder: bool, norm_first: bool = False) -> None:
        super().__init__()
        kind = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
        self.layer = kind(8, 2, dim_feedforward=16, norm_first=norm_first)
        self.memory = nn.Linear(8, 8) if decoder else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        if self.memory is None:
            return self.layer(x).transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[0], dtype=x.dtype)
        return self.layer(x, self.memory(x[:3]), tgt_mask=causal).transpose(0, 1)


@pytest.mark.parametrize(
    "decoder, norm_first",
    [(False, False), (False, True), (True, False)],
    ids=["encoder", "encoder-norm-first", "decoder"],
)
def test_transformer_layers_at_their_defaults_match_each_examples_gradient_in_its_graph(decoder, norm_first):
    torch.manual_seed(0)
    assert_matches_in_one_graph(Transformer(decoder, norm_first), torch.randn(B, 6, 8))  # T ≠ B: see feature_dims


class SelfThenCross(nn.Module):
    """One layer called twice: self-attention (q, k, v in one F.linear), then cross-attention to the first
    positions (q and k = v in two), so its uses' blocks of in_proj_weight are split at other rows."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True, dropout=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x, x, x, need_weights=False)[0]
        return self.attn(h, x[:, :2], x[:, :2], need_weights=False)[0]


def test_attention_called_as_self_and_cross_attention_is_measured_from_both_uses():
    torch.manual_seed(0)
    assert_matches_in_one_graph(SelfThenCross(), torch.randn(B, 4, 6))


class CheckpointedAttention(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant, self.inner = reentrant, Attention(dropout=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def test_attention_with_dropout_recomputed_by_checkpointing_is_measured_from_its_masks():
    """Checkpointing recomputes the masks from the saved RNG state; the non-reentrant kind is measured from the
    first run, the reentrant kind from the recomputation (the first ran without a graph): the same numbers."""
    torch.manual_seed(0)
    x = torch.randn(B, 4, 6)
    assert_matches_in_one_graph(CheckpointedAttention(reentrant=False), x)  # autograd.grad: non-reentrant only
    steps = []
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = CheckpointedAttention(reentrant).double()
        plan = plan_sources(model, groups_available=False, fallback=False)
        collector = PerExampleGradients(plan.per_example, {}, 2)
        collector.attach(keep_norms=True)
        torch.manual_seed(1)
        model(x.double().requires_grad_()).square().sum().backward()
        collector.end_micro_batch(1.0)
        steps.append(collector.pop())
    assert not steps[0].failed and not steps[1].failed
    torch.testing.assert_close(steps[1].sq_norms[0], steps[0].sq_norms[0], rtol=1e-12, atol=0)


def test_the_capture_reads_nothing_on_the_host(monkeypatch):
    """A step of a TransformerEncoderLayer with dropout, measured and added up (no pop): the collector adds no
    host read (a sync on a device) to those the layer's own forward and backward make."""
    torch.manual_seed(0)
    model = Transformer(decoder=False).double()
    x = torch.randn(B, 6, 8, dtype=torch.float64)
    collector = PerExampleGradients(plan_sources(model, groups_available=False, fallback=False).per_example, {}, 2)
    host = HostReads(monkeypatch)
    counts = []
    for attached in (False, True):
        if attached:
            collector.attach(coordinates=True, keep_norms=True)
            collector.expect_batch(B)
        host.watching, host.reads = "step", []
        model(x).square().sum().backward()
        if attached:
            collector.end_micro_batch(1.0)
        host.watching = None
        counts.append(len(host.reads))
    assert counts[1] == counts[0] and collector.pop().sq_norms[0].shape == (B,)


def test_multihead_attention_with_bias_kv_is_named_with_its_reason():
    model = nn.Sequential(nn.MultiheadAttention(4, 2, add_bias_kv=True))
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert not plan.per_example and not plan.vmap  # torch.func would not see a tuple output either
    assert set(plan.uncovered) == {
        "0.in_proj_weight",
        "0.in_proj_bias",
        "0.bias_k",
        "0.bias_v",
        "0.out_proj.weight",
        "0.out_proj.bias",
    }
    assert "add_bias_kv" in plan.uncovered["0.in_proj_weight"]


def test_without_redispatch_function_attention_is_named_not_measured(monkeypatch):
    from trainvitals.per_example.rules import attention

    monkeypatch.setattr(attention, "_redispatch", None)  # a torch before torch.overrides.redispatch_function
    assert "redispatch_function" in unsupported_reason(nn.MultiheadAttention(4, 2))


def test_a_forward_that_raises_inside_a_capture_leaves_no_mode_behind():
    model = Attention(dropout=0.1).double()
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # inside F.multi_head_attention_forward
        model.attn(
            torch.randn(B, 4, 6, dtype=torch.float64),
            torch.randn(B, 4, 5, dtype=torch.float64),
            torch.randn(B, 4, 5, dtype=torch.float64),
        )
    assert torch._C._len_torch_function_stack() == 0
    x = torch.randn(B, 4, 6, dtype=torch.float64)
    model(x).sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed and step.sq_norms == [] and step.sq_norm_sum is not None


def initial_states(rnn: nn.Module, x: torch.Tensor, states: int):
    """Initial states that depend on each example's input (an LSTM's h of its projection's size)."""

    def state(size: int) -> torch.Tensor:
        return x[:, 0, :1].expand(-1, size).unsqueeze(0).expand(states, -1, -1).contiguous()

    if isinstance(rnn, nn.LSTM):
        return state(rnn.proj_size or rnn.hidden_size), 0.5 * state(rnn.hidden_size)
    return state(rnn.hidden_size)


class Recurrent(nn.Module):
    """A recurrent layer on batch-first ``(B, T, 3)``, the loss on its output and final states."""

    def __init__(self, kind: type[nn.Module], batch_first: bool, initial_state: bool, **options) -> None:
        super().__init__()
        self.rnn = kind(3, 4, batch_first=batch_first, **options)
        self.initial_state = initial_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        hx = None
        if self.initial_state:
            hx = initial_states(self.rnn, x, states)
        out, final = self.rnn(seq, hx)
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        states = final if isinstance(final, tuple) else (final,)  # an LSTM's h (of its projection's size), c
        return torch.cat([out[:, -2], *(state.sum(0) for state in states)], 1)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU], ids=["rnn", "lstm", "gru"])
@pytest.mark.parametrize(
    "options",
    [
        {"batch_first": True, "initial_state": False},
        {"batch_first": False, "initial_state": True, "num_layers": 2, "bidirectional": True},
        {"batch_first": True, "initial_state": True, "bias": False, "num_layers": 2},
    ],
    ids=["one-layer", "two-layer-bidirectional-sequence-first", "no-bias"],
)
def test_recurrent_layers_match_brute_force(kind, options):
    torch.manual_seed(0)
    assert_matches(Recurrent(kind, **options), torch.randn(B, 4, 3))


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU], ids=["rnn", "lstm", "gru"])
@pytest.mark.parametrize(
    "options",
    [
        {"batch_first": True, "initial_state": False, "num_layers": 3},
        {"batch_first": False, "initial_state": True, "num_layers": 2, "bidirectional": True},
    ],
    ids=["three-layer", "two-layer-bidirectional-sequence-first"],
)
def test_recurrent_layers_with_dropout_between_layers_match_the_same_forward(kind, options):
    torch.manual_seed(0)
    assert_matches_same_graph(Recurrent(kind, dropout=0.4, **options), torch.randn(B, 4, 3))


class CheckpointedRecurrent(nn.Module):
    """A recurrent layer checkpointed alone: the segment returns its outputs, so under reentrant checkpointing they
    are the roots of the backward that recomputes it (the LSTM's output alone; a GRU's or RNN's output and final
    state, two roots). ``reentrant=None``: not checkpointed (the truth's forward)."""

    def __init__(self, kind: type[nn.Module], dropout: float) -> None:
        super().__init__()
        self.rnn = kind(3, 4, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(4, 2)
        self.reentrant: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            out, final = self.rnn(x)
        else:
            out, final = torch.utils.checkpoint.checkpoint(self.rnn, x, use_reentrant=self.reentrant)
        y = self.head(out).flatten(1)
        return y if isinstance(final, tuple) else torch.cat([y, final.sum(0)], 1)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU], ids=["rnn", "lstm", "gru"])
@pytest.mark.parametrize("dropout", [0.0, 0.4], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recurrent_layers_recomputed_by_checkpointing_match_the_same_forward(kind, dropout, reentrant):
    """Measured from the first run (non-reentrant) or the recomputation (reentrant), whose dropout masks are the
    first run's (checkpointing restores the generator): the gradients of one forward without checkpointing
    from the same seed (reentrant checkpointing does not take ``torch.autograd.grad``)."""
    torch.manual_seed(0)
    model = CheckpointedRecurrent(kind, dropout).double().train()
    x = torch.randn(B, 4, 3, dtype=torch.float64, requires_grad=True)  # reentrant: only into inputs with grad
    weights = torch.randn_like(model(x))
    torch.manual_seed(3)
    truth = same_graph_truth(model, x, weights)
    model.reentrant = reentrant
    torch.manual_seed(3)
    plan, step = measured(model, x, weights)
    assert_step_is(plan, step, truth)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recurrent_dropout_recomputed_with_other_masks_is_caught_or_exact(reentrant):
    """``preserve_rng_state=False``: the recomputation draws other masks than the forward. Reentrant checkpointing
    differentiates the recomputation alone, measured with its own masks: the sums add up to ``.grad``. The
    non-reentrant kind is measured from the forward's masks, the gradient has the recomputation's: named."""
    torch.manual_seed(0)
    rnn = nn.LSTM(3, 4, 2, dropout=0.4, batch_first=True).double()
    model = nn.ModuleDict({"rnn": rnn})
    collector = PerExampleGradients(plan_sources(model, groups_available=False, fallback=False).per_example, {}, 2)
    collector.attach(coordinates=True)
    x = torch.randn(B, 4, 3, dtype=torch.float64, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(rnn, x, use_reentrant=reentrant, preserve_rng_state=False)[0]
    out.square().sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed and step.seen == {"rnn"}
    unbalanced = collector.unbalanced(step, 1.0)
    assert unbalanced == {} if reentrant else "preserve_rng_state=False" in unbalanced["rnn"]


def float32_dropout_sums(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    """What the sums check says of a float32 step: whether the per-example gradients add up to ``.grad``."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True)
    model.zero_grad()
    model(x).square().sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed
    return collector.unbalanced(step, 1.0)


def test_recurrent_dropout_in_float32_draws_the_forward_masks(monkeypatch):
    """float32 takes other kernels (oneDNN for the LSTM); masks from another state do not add up."""
    from trainvitals.per_example.rules import recurrent

    torch.manual_seed(0)
    x = torch.randn(B, 6, 3)
    for kind in (nn.LSTM, nn.GRU):
        model = Recurrent(kind, batch_first=True, initial_state=False, num_layers=3, dropout=0.5)
        assert float32_dropout_sums(model, x) == {}

    def wrong_state(capture):  # the generator's state of another forward
        capture.inputs = capture._call._replace(state=torch.Generator().manual_seed(123).get_state())
        return capture

    monkeypatch.setattr(recurrent._GeneratorState, "__enter__", wrong_state)
    assert set(float32_dropout_sums(model, x)) == {"rnn"}


def test_recurrent_dropout_without_the_generator_state_says_so():
    from trainvitals.per_example import per_example_sq_norms
    from trainvitals.per_example.registry import Call

    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    out, (h, c) = lstm(torch.randn(B, 4, 3))
    with pytest.raises(RuntimeError, match="state before the forward was not kept"):
        per_example_sq_norms(lstm, Call((torch.randn(B, 4, 3),), {}), (torch.ones_like(out), None, None))
    assert per_example_sq_norms(
        lstm.eval(), Call((torch.randn(B, 4, 3),), {}), (torch.ones_like(out), None, None)
    ).shape == (B,)


@pytest.mark.parametrize(
    "options",
    [
        {"batch_first": True, "initial_state": False},
        {"batch_first": False, "initial_state": True, "num_layers": 2, "bidirectional": True},
        {"batch_first": True, "initial_state": True, "bias": False, "num_layers": 3, "dropout": 0.3},
    ],
    ids=["one-layer", "two-layer-bidirectional-sequence-first", "dropout"],
)
def test_lstm_with_projections_matches_brute_force(options):
    torch.manual_seed(0)
    model = Recurrent(nn.LSTM, proj_size=2, **options)
    check = assert_matches_same_graph if options.get("dropout") else assert_matches
    check(model, torch.randn(B, 4, 3))
    packed = Packed(nn.LSTM, [4, 2, 4, 1, 3], initial_state=True, num_layers=2, bidirectional=True, proj_size=3)
    assert_packed_matches(packed, torch.randn(B, 4, 3))


class PaddedTiedDecoder(TiedDecoder):
    """A padding row, an output bias, and the embedding called twice (its uses add up)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(9, 6, padding_idx=0)
        self.head = nn.Linear(6, 9)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.tokens(tokens) + self.tokens(tokens.flip(1)))))


def test_a_tied_embedding_and_output_layer_form_no_per_example_table(monkeypatch):
    from trainvitals.per_example.rules.embedding import EmbeddingRule
    from trainvitals.per_example.rules.linear import LinearRule

    def formed(*_):
        raise AssertionError("a per-example V×D gradient was formed")

    monkeypatch.setattr(EmbeddingRule, "grads", formed)
    monkeypatch.setattr(LinearRule, "grads", formed)
    torch.manual_seed(0)
    tokens = torch.randint(0, 9, (B, 4))
    tokens[0, :2], tokens[1, -1] = 3, 0
    assert_matches(PaddedTiedDecoder(), tokens)


def test_other_tied_layers_add_their_per_example_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    model[2].weight = model[0].weight  # a weight shared by two layers, each with a bias of its own
    assert_matches(model, torch.randn(B, 3, 4))


class Packed(nn.Module):
    """A recurrent layer on sequences of their own ``lengths``, padded ``(B, T, 3)`` and packed as a text
    classifier packs them; the loss on the padded output and the final states."""

    def __init__(
        self,
        kind: type[nn.Module],
        lengths: list[int],
        enforce_sorted: bool = False,
        batch_first: bool = True,
        initial_state: bool = False,
        **options,
    ) -> None:
        super().__init__()
        self.rnn = kind(3, 4, batch_first=batch_first, **options)
        self.lengths, self.enforce_sorted, self.initial_state = lengths, enforce_sorted, initial_state

    def _initial(self, x: torch.Tensor):
        if not self.initial_state:
            return None
        states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        return initial_states(self.rnn, x, states)

    def _head(self, out: torch.Tensor, final, steps: int) -> torch.Tensor:
        out = nn.functional.pad(out, (0, 0, 0, steps - out.shape[1]))  # (B, T, D), zeros past the end
        states = final if isinstance(final, tuple) else (final,)
        return torch.cat([out.flatten(1), *(state.sum(0) for state in states)], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.rnn.batch_first
        packed = nn.utils.rnn.pack_padded_sequence(
            x if first else x.transpose(0, 1), self.lengths, batch_first=first, enforce_sorted=self.enforce_sorted
        )
        out, final = self.rnn(packed, self._initial(x))
        return self._head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0], final, x.shape[1])

    def alone(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Example ``i`` alone, a plain sequence of its own length: no packing."""
        first, seq = self.rnn.batch_first, x[i : i + 1, : self.lengths[i]]
        out, final = self.rnn(seq if first else seq.transpose(0, 1), self._initial(x[i : i + 1]))
        return self._head(out if first else out.transpose(0, 1), final, x.shape[1])


def assert_packed_matches(model: Packed, x: torch.Tensor) -> None:
    """As :func:`assert_matches`, the truth each example alone at its own length."""
    torch.manual_seed(1)
    model, x = model.double(), x.double()
    weights = torch.randn_like(model(x))
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for i in range(x.shape[0]):
        model.zero_grad()
        (model.alone(x, i) * weights[i : i + 1]).sum().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    truth = {n: torch.stack(g) for n, g in grads.items()}
    plan, step = measured(model, x, weights)
    assert not plan.uncovered and not step.failed
    expected = sum(g.flatten(1).square().sum(1) for g in truth.values())
    torch.testing.assert_close(step.sq_norms[0], expected, rtol=1e-9, atol=1e-12)  # in the batch's order
    for name, g in truth.items():
        torch.testing.assert_close(step.grad_sum[name], g.sum(0), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step.sum_sq[name], g.square().sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU], ids=["rnn", "lstm", "gru"])
@pytest.mark.parametrize(
    "options",
    [
        {"lengths": [4, 2, 4, 1, 3]},
        {
            "lengths": [4, 4, 3, 2, 1],
            "enforce_sorted": True,
            "batch_first": False,
            "initial_state": True,
            "num_layers": 2,
            "bidirectional": True,
        },
        {"lengths": [2, 4, 1, 3, 3], "initial_state": True, "num_layers": 3, "bias": False},
    ],
    ids=["unsorted", "sorted-two-layer-bidirectional-sequence-first", "three-layer-no-bias"],
)
def test_packed_sequences_match_each_sequence_alone(kind, options):
    torch.manual_seed(0)
    assert_packed_matches(Packed(kind, **options), torch.randn(B, 4, 3))


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_packed_sequences_with_dropout_between_layers_match_the_same_forward(kind):
    torch.manual_seed(0)
    model = Packed(kind, [4, 2, 4, 1, 3], initial_state=True, num_layers=3, bidirectional=True, dropout=0.4)
    assert_matches_same_graph(model, torch.randn(B, 4, 3))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_torch_func_fallback_measures_a_checkpointed_layer_once(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh()).double()
    x = torch.randn(B, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(B, 4, dtype=torch.float64)
    truth = per_example_truth(model, x.detach(), weights)["1.scale"]
    collector = PerExampleGradients({}, {"1": model[1]}, sub_batch=B)
    collector.attach(coordinates=True)
    (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant) * weights).sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed and step.seen == {"1"} and step.num_sub == B
    torch.testing.assert_close(step.sub_sum_sq["1.scale"], truth.square().sum(0))


class SequenceFirst(nn.Module):
    """PyTorch's word-language-model layout: the model runs on ``(T, B)``, its data is batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.norm = nn.Embedding(7, 4), nn.LayerNorm(4)
        self.rnn, self.decoder = nn.GRU(4, 5), nn.Linear(5, 7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.norm(self.encoder(tokens.t())))  # (T, B, 5)
        return self.decoder(output).transpose(0, 1)


def test_sequence_first_layers_are_measured_with_the_examples_on_dimension_1():
    torch.manual_seed(0)
    model = SequenceFirst().double()
    tokens = torch.randint(0, 7, (B, 3))
    weights = torch.randn(B, 3, 7, dtype=torch.float64)
    truth = per_example_truth(model, tokens, weights)
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.expect_batch(B)  # told, as the probe tells it: the first layer's first dimension is T
    (model(tokens) * weights).sum().backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert not step.failed
    torch.testing.assert_close(step.sq_norms[0], sum(g.flatten(1).square().sum(1) for g in truth.values()))
    for name, g in truth.items():
        torch.testing.assert_close(step.sum_sq[name], g.square().sum(0))


# ------------------------------------------------------------- a two-input layer of one's own (whole_call)


class Bilinear2(nn.Module):
    """y_k = x1ᵀ W_k x2 + b_k over (B, *, D1) and (B, *, D2): two inputs, so its rule needs the whole call."""

    def __init__(self, d1: int, d2: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, d1, d2) / (d1 * d2) ** 0.5)
        self.bias = nn.Parameter(torch.randn(out))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,kij,...j->...k", x1, self.weight, x2) + self.bias


class TwoTowers(nn.Module):
    """Two towers mixed by a Bilinear2 that runs twice, its inputs swapped: its per-example gradient is the
    sum of both calls', cross terms included. ``x`` is (B, D) or (B, T, D)."""

    def __init__(self, d: int = 4, h: int = 3) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(d, h), nn.Linear(d, h)
        self.mix = Bilinear2(h, h, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.tanh(self.left(x)), torch.tanh(self.right(x))
        return self.mix(a, b) + torch.tanh(self.mix(b, a))


def _flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, T, D): the examples first, every position between, the features last."""
    return tuple(t.reshape(len(t), -1, t.shape[-1]) for t in tensors)


def bilinear_grads(module, call, grad_outputs):
    x1, x2, (g,) = *call.args, grad_outputs
    x1, x2, g = _flat(x1, x2, g)
    return {"weight": torch.einsum("btk,bti,btj->bkij", g, x1, x2), "bias": g.sum(1)}


class BilinearGhostRule(PerExampleRule):
    """‖Σ_t g_t ⊗ x1_t ⊗ x2_t‖² = Σ_{t,s} (g_t·g_s)(x1_t·x1_s)(x2_t·x2_s), the positions of every use together:
    Gram matrices of (B, T, T), no (B, out, d1, d2) per-example gradient."""

    whole_call = True
    norm_calls = 0

    def grads(self, module, uses):
        total = [bilinear_grads(module, u.inputs, u.grad_output) for u in uses]
        return {name: sum(t[name] for t in total) for name in ("weight", "bias")}

    def sq_norms(self, module, uses, workspace=None):
        type(self).norm_calls += 1
        x1, x2, g = (torch.cat(parts, 1) for parts in zip(*(_flat(*u.inputs.args, u.grad_output[0]) for u in uses)))
        gram = lambda t: t @ t.transpose(1, 2)  # noqa: E731
        return (gram(g) * gram(x1) * gram(x2)).sum((1, 2)) + g.sum(1).square().sum(1)


@pytest.fixture
def bilinear_rule():
    yield
    unregister_per_example_rule(Bilinear2)


@pytest.mark.parametrize("shape", [(B, 4), (B, 3, 4)], ids=["per-example", "per-position"])
def test_a_two_input_layer_of_ones_own_gets_a_whole_call_function_rule(bilinear_rule, shape):
    assert unsupported_reason(Bilinear2(3, 3, 2)) == "Bilinear2 has no per-example identity"
    register_per_example_rule(Bilinear2, whole_call=True)(bilinear_grads)
    torch.manual_seed(0)
    assert_matches(TwoTowers(), torch.randn(shape))


@pytest.mark.parametrize("shape", [(B, 4), (B, 3, 4)], ids=["per-example", "per-position"])
def test_a_two_input_layer_with_a_ghost_norm_rule_class(bilinear_rule, shape):
    register_per_example_rule(Bilinear2)(BilinearGhostRule)
    calls = BilinearGhostRule.norm_calls
    torch.manual_seed(0)
    assert_matches(TwoTowers(), torch.randn(shape))
    assert BilinearGhostRule.norm_calls == calls + 1  # one call, both uses together


def test_unregistering_a_rule_sends_the_layer_to_the_base_types_rule():
    class Wide(nn.Linear):
        """Keeps Linear's forward: Linear's rule serves it until it has its own."""

    own = PerExampleRule()
    register_per_example_rule(Wide)(own)
    try:
        assert rule_for(Wide(2, 2)) is own and Wide in registered_types()
    finally:
        unregister_per_example_rule(Wide)
    assert Wide not in registered_types() and rule_for(Wide(2, 2)) is rule_for(nn.Linear(2, 2))
    assert nn.Linear in PER_EXAMPLE_LAYERS and Wide not in PER_EXAMPLE_LAYERS


class Gate(nn.Module):
    """y = x ⊙ tanh(F.linear(x, W)): the weight's gradient is that of a linear inside the forward, which the
    layer's input and output gradient do not give."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(torch.nn.functional.linear(x, self.weight))


class Linears(torch.overrides.TorchFunctionMode, Capture):
    """Every ``F.linear`` of the call: its input and its output."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs, self.tensors = [], ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            self.inputs.append(args[0])
            self.tensors = (*self.tensors, out)
        return out


class GateRule(PerExampleRule):
    whole_call = True

    def capture(self, module, call):
        return Linears()

    def grads(self, module, uses):
        return {
            "weight": sum(
                torch.einsum("bto,bti->boi", g, a) for use in uses for a, g in zip(use.inputs, use.grad_output)
            )
        }


def test_a_rule_of_ones_own_measures_from_a_capture_of_its_forward():
    register_per_example_rule(Gate)(GateRule)
    try:
        torch.manual_seed(0)
        assert_matches(nn.Sequential(Gate(3), nn.Tanh(), Gate(3)), torch.randn(B, 4, 3))
    finally:
        unregister_per_example_rule(Gate)
