"""The per-example rules on whole architectures (tests/zoo.py): one backward with PerExampleGradients
attached against a brute-force loop over the examples and ALL trainable parameters, in float64 (a model with
dropout: each example's own loss differentiated through one forward of the batch, drawn from the seed the
measured forward draws from)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZOO, ResNet

from trainvitals.noise.estimators import gradient_snr, per_example_estimates
from trainvitals.per_example import PerExampleGradients, plan_sources

B = 4
RTOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()) + 1e-300))


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_statistics_match_brute_force_over_all_parameters(name):
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().double()
    x, y = entry.batch(B)
    x = x.double() if x.is_floating_point() else x
    y = y.double() if y.is_floating_point() else y
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # a tied tensor once

    per_example = {n: [] for n in params}
    if entry.random:  # one forward, its masks; each example's own loss through it
        torch.manual_seed(1)
        out = model(x)
        for i in range(B):
            grads = torch.autograd.grad(
                entry.loss(out[i : i + 1], y[i : i + 1]),
                list(params.values()),
                retain_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            for n, grad in zip(params, grads):
                per_example[n].append(grad)
    else:
        for i in range(B):
            model.zero_grad()
            entry.loss(model(x[i : i + 1]), y[i : i + 1]).backward()
            for n, p in params.items():
                per_example[n].append(p.grad.clone())
    g = {n: torch.stack(v) for n, v in per_example.items()}

    plan = plan_sources(model, groups_available=False, fallback=False)
    measured = plan.parameters("per_example")
    share = sum(p.numel() for p in measured.values()) / sum(p.numel() for p in params.values())
    assert share >= 0.99, plan.describe(model)
    assert set(measured) == set(params), plan.uncovered  # the brute force covers every parameter
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B)
    model.zero_grad()
    torch.manual_seed(1)  # a random entry: the truth's masks
    output = model(x)
    if entry.random:
        assert torch.equal(output, out)
    loss = entry.loss(output, y)
    collector.before_backward(loss)  # a position table: where the add broadcasts it
    loss.backward()
    collector.end_micro_batch(float(B))
    collector.detach()
    step = collector.pop()
    assert step.failed == {} and step.seen == set(plan.per_example)
    flat = torch.cat([v.flatten(1) for v in g.values()], 1)

    # ‖g_i‖² of each example over every measured parameter
    assert close(step.sq_norms[0], flat.square().sum(1))
    # tr(Σ) (Bessel) and ‖G‖², from Σ_i ‖g_i‖² and ‖ḡ‖² of the batch gradient (a mean loss: .grad is ḡ)
    mean_sq = sum(p.grad.square().sum() for p in params.values())
    grad_sq_norm, trace_cov = per_example_estimates(step.sq_norm_sum, mean_sq, B)
    mean = flat.mean(0)
    true_trace = (flat - mean).square().sum() / (B - 1)
    assert close(trace_cov, true_trace) and close(grad_sq_norm, mean.square().sum() - true_trace / B)
    # per-layer GSNR from the per-coordinate sums Σ g and Σ g²
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for n in params:
        ours = gradient_snr(step.grad_sum[n] / B, step.sum_sq[n], B).flatten()
        truth = gradient_snr(g[n].mean(0), g[n].square().sum(0), B).flatten()
        layers.setdefault(n.rpartition(".")[0], []).append((ours, truth))
    for layer, parts in layers.items():
        ours, truth = (torch.cat(p).mean() for p in zip(*parts))
        assert close(ours, truth), layer


def test_a_batchnorm_model_in_training_mode_is_named_as_coupling_the_examples():
    model = ResNet(nn.BatchNorm2d)
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert plan.coupled == ("bn1", "layer1.bn1", "layer1.bn2", "layer2.bn1", "layer2.bn2", "layer2.downsample.1")
    assert all(why.startswith("BatchNorm couples the examples") for why in plan.uncovered.values())
    assert {n.rpartition(".")[0] for n in plan.uncovered} == set(plan.coupled)


def assert_one_step_exact(model, plan, forward, loss_of, out: torch.Tensor, flat: torch.Tensor) -> None:
    """One micro-batch with ``plan``'s layers hooked: ``forward()``, seeded as the truth's forward was, gives ``out``
    again, ``loss_of`` its loss; every planned module is seen, each example's ‖g_i‖² is that of ``flat`` (``(B, P)``,
    the brute force over every parameter), and the per-example gradients add up to ``.grad``."""
    collector = PerExampleGradients(plan.per_example, plan.vmap, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B)
    torch.manual_seed(1)
    output = forward()
    assert torch.equal(output, out)
    loss = loss_of(output)
    collector.before_backward(loss)
    loss.backward()
    collector.end_micro_batch(float(B))
    collector.detach()
    step = collector.pop()
    assert step.failed == {} and step.seen == set(plan.per_example) | set(plan.vmap)
    assert close(step.sq_norms[0], flat.square().sum(1))
    assert collector.unbalanced(step, 1.0 / B) == {}


def test_hf_gpt2_from_config_is_measured_over_all_parameters():
    """transformers' GPT-2 (its Conv1D layers by torch.func, every example kept), dropout after the sum of the token
    and position embeddings ((1, T) position ids) and in every block, the LM head tied to wte: each example's
    ‖g_i‖² over every parameter, the position table's included, is that of its own loss through the same forward."""
    transformers = pytest.importorskip("transformers")
    from zoo import VOCAB, T, token_loss

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).double().train()
    x = torch.randint(0, VOCAB, (B, T))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert model.lm_head.weight is model.transformer.wte.weight
    torch.manual_seed(1)
    out = model(input_ids=x).logits
    flat = torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        token_loss(out[i : i + 1], x[i : i + 1]), list(params.values()), retain_graph=True
                    )
                ]
            )
            for i in range(B)
        ]
    )

    plan = plan_sources(model, groups_available=False, fallback=True)
    assert not plan.uncovered and not plan.micro_batch and "transformer.wpe" in plan.per_example
    assert_one_step_exact(model, plan, lambda: model(input_ids=x).logits, lambda o: token_loss(o, x), out, flat)


@pytest.mark.parametrize("kind", ["vit", "convnext"])
def test_hf_vit_and_convnext_from_config_are_measured_over_all_parameters(kind):
    """transformers' ViT (its embeddings module's bare ``cls_token`` expanded and concatenated, its bare
    ``position_embeddings`` added, dropout after) and ConvNeXt (each layer's bare ``layer_scale_parameter``
    multiplying the residual branch): each example's ‖g_i‖² over every parameter is that of its own loss through
    the same forward, with no micro-batches."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    if kind == "vit":
        config = transformers.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, num_labels=4, hidden_dropout_prob=0.1,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(config)
    else:
        config = transformers.ConvNextConfig(
            num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=2, num_labels=4, image_size=8
        )
        model = transformers.ConvNextForImageClassification(config)
    model = model.double().train()
    x, y = torch.randn(B, 3, 8, 8, dtype=torch.float64), torch.randint(0, 4, (B,))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(1)
    out = model(pixel_values=x).logits
    grads = [
        torch.autograd.grad(F.cross_entropy(out[i : i + 1], y[i : i + 1]), list(params.values()), retain_graph=True)
        for i in range(B)
    ]
    flat = torch.stack([torch.cat([g.flatten() for g in per]) for per in grads])

    plan = plan_sources(model, groups_available=False, fallback=True)
    assert not plan.uncovered and not plan.micro_batch, plan.describe(model)
    assert "parameters broadcast over the batch" in plan.describe(model)
    assert_one_step_exact(model, plan, lambda: model(pixel_values=x).logits, lambda o: F.cross_entropy(o, y), out, flat)
