"""Per-example squared gradient norms ‖g_i‖², layer by layer and end to end: trainvitals' rules against
the layer's own forward + backward, Opacus and BackPACK, in one process.

Tools, each on its own copy of the layer or model, timed interleaved (bare, forward, trainvitals,
Opacus, Opacus ghost, BackPACK, bare, ...):

- ``bare``: forward + backward (the input requires grad, as inside a network), ``.grad`` set to None;
- ``forward``: the forward alone (with its graph), so that the layer's own backward = bare − forward;
- ``trainvitals``: + :class:`~trainvitals.per_example.PerExampleGradients` (the squared norms of
  every step, no per-coordinate sums), as ``BatchVarianceProbe`` runs it;
- ``opacus``: Opacus' ``GradSampleModule`` (per-example gradients ``p.grad_sample``, their squared
  norms summed over parameters); layers without an Opacus grad sampler go through its functorch path,
  except nn.MultiheadAttention, RNN, LSTM and GRU, which Opacus does not support (its
  ``ModuleValidator`` asks for its drop-in replacements): those are swapped for DPMultiheadAttention,
  DPRNN, DPLSTM and DPGRU with the same weights, as ``ModuleValidator.fix`` would;
- ``opacus_ghost``: Opacus' ``GradSampleModuleFastGradientClipping`` with ghost clipping: the norms
  only (ghost norms for Linear and Embedding, per-example gradients reduced at once for the others);
- ``backpack``: BackPACK's ``BatchL2Grad`` on ``extend``-ed modules, where BackPACK has the layer.

Per layer: the median over repetitions of each tool's CPU time per step (``time.process_time``, one
torch thread) as a ratio to the same repetition's bare step, and its extra time as a ratio to the
layer's own backward. Exactness: the largest relative difference of the tool's ‖g_i‖² from a
brute-force loop (one backward per example through one forward of the batch, from the same RNG state as
the tool's forward: dropout's masks are the same where the tool's forward computes as the layer's does),
everything in float64.

End to end: a plain training loop (forward, mean loss, backward, Adam step) on the demo's digits CNN,
small models of the layer families and the test zoo's architectures (tests/zoo.py: GPT, BERT, ResNets,
LSTM, GRU, ViT, MLP-Mixer, U-Net; their position tables frozen, which trainvitals names as not
measured), the per-example norms of every parameter. Last, the
digits CNN's conv path: its second convolution's rule by part against its weight-gradient floor (and
a candidate form), and a measured step's extra time by part of the collector.

Opacus and BackPACK are not dependencies of trainvitals (the ``bench`` extra lists them):
``pip install --no-deps opacus backpack-for-pytorch einops unfoldNd opt_einsum`` keeps one's torch,
which BackPACK's torchvision requirement would replace. A tool that is not installed is left out.

    python benchmarks/bench_per_example_rules.py --out per_example_rules.json   # ~5 min on one core
    python benchmarks/bench_per_example_rules.py --quick                        # smoke run, < 1 min
    python benchmarks/bench_per_example_rules.py --only LSTM --only digits      # rows whose label has either
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import machine_line, markdown_table, median, write_json
from torch import Tensor, nn

from trainvitals.per_example import PerExampleGradients, Use, Workspace, plan_sources, rule_for
from trainvitals.per_example.rules.conv import _GRAM_SPEED, _conv_patches, _shifted_source
from trainvitals.per_example.rules.linear import OuterProductRule
from trainvitals.per_example.tensor_ops import _bmm, _sq_norms, gram_is_cheaper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from zoo import ZOO  # noqa: E402 - the test zoo's architectures, end to end

try:
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
except ImportError:  # the table says "not installed"
    GradSampleModule = GradSampleModuleFastGradientClipping = None
try:
    from backpack import backpack as backpack_context
    from backpack import extend
    from backpack.extensions import BatchL2Grad
except ImportError:
    extend = None

TOOLS = ("bare", "forward", "trainvitals", "opacus", "opacus_ghost", "backpack")
PEERS = ("trainvitals", "opacus", "opacus_ghost", "backpack")


# ----------------------------------------------------------------------------------------------------
# Layers and models


class SelfAttention(nn.Module):
    """``attention(x, x, x)``'s output on a batch-first ``x`` (transposed for a sequence-first layer)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor) -> Tensor:
        if not self.attention.batch_first:
            x = x.transpose(0, 1)
        out = self.attention(x, x, x, need_weights=False)[0]
        return out if self.attention.batch_first else out.transpose(0, 1)


class Outputs(nn.Module):
    """A recurrent layer's output sequence (its first output)."""

    def __init__(self, recurrent: nn.Module) -> None:
        super().__init__()
        self.recurrent = recurrent

    def forward(self, x: Tensor) -> Tensor:
        return self.recurrent(x)[0]


class PackedOutputs(Outputs):
    """A recurrent layer on its input packed at each example's own length (8 to T steps, a function of the
    example's first value, so that an example alone gets its length too), the output padded back."""

    def forward(self, x: Tensor) -> Tensor:
        lengths = 8 + (x[:, 0, 0].detach().abs() * 1000).long().cpu() % (x.shape[1] - 7)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.recurrent(packed)[0], batch_first=True, total_length=x.shape[1])[0]


#: name: (make the layer, input shape, integer inputs below this bound or None). Shapes of small real
#: layers: the digits CNN's second convolution, a ResNet stage at 16×16, a stride-2 one and a late one at
#: 4×4 (the form of the conv rule's weight norms by cost: per-example blocks, ghost Gram matrices), a
#: decoder's upsampling, a transformer block's projections, attention and norms on 64 tokens, recurrent
#: layers on 32 steps.
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int | None]] = {
    "Linear 4→4, (64, 4): the per-step constant": (lambda: nn.Linear(4, 4), (64, 4), None),
    "Linear 256→256, (64, 256)": (lambda: nn.Linear(256, 256), (64, 256), None),
    "Linear 128→512, tokens (32, 64, 128)": (lambda: nn.Linear(128, 512), (32, 64, 128), None),
    "Conv1d 16→32 k5, (32, 16, 128)": (lambda: nn.Conv1d(16, 32, 5, padding=2), (32, 16, 128), None),
    "Conv2d 16→32 k3, (64, 16, 8, 8) (digits CNN conv 2)": (
        lambda: nn.Conv2d(16, 32, 3, padding=1),
        (64, 16, 8, 8),
        None,
    ),
    "Conv2d 32→64 k3, (32, 32, 16, 16)": (lambda: nn.Conv2d(32, 64, 3, padding=1), (32, 32, 16, 16), None),
    "Conv2d 32→32 k3 s2, (32, 32, 16, 16): blocks": (
        lambda: nn.Conv2d(32, 32, 3, stride=2, padding=1),
        (32, 32, 16, 16),
        None,
    ),
    "Conv2d 64→128 k3, (32, 64, 4, 4): Gram": (lambda: nn.Conv2d(64, 128, 3, padding=1), (32, 64, 4, 4), None),
    "Conv3d 8→16 k3, (16, 8, 8, 8, 8)": (lambda: nn.Conv3d(8, 16, 3, padding=1), (16, 8, 8, 8, 8), None),
    "ConvTranspose1d 32→16 k4 s2, (32, 32, 64)": (
        lambda: nn.ConvTranspose1d(32, 16, 4, stride=2, padding=1),
        (32, 32, 64),
        None,
    ),
    "ConvTranspose2d 32→16 k4 s2, (32, 32, 8, 8)": (
        lambda: nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1),
        (32, 32, 8, 8),
        None,
    ),
    "ConvTranspose3d 16→8 k4 s2, (8, 16, 4, 4, 4)": (
        lambda: nn.ConvTranspose3d(16, 8, 4, stride=2, padding=1),
        (8, 16, 4, 4, 4),
        None,
    ),
    "GroupNorm 8×64, (32, 64, 16, 16)": (lambda: nn.GroupNorm(8, 64), (32, 64, 16, 16), None),
    "InstanceNorm2d 64 affine, (32, 64, 16, 16)": (lambda: nn.InstanceNorm2d(64, affine=True), (32, 64, 16, 16), None),
    "LayerNorm 256, (32, 64, 256)": (lambda: nn.LayerNorm(256), (32, 64, 256), None),
    "RMSNorm 256, (32, 64, 256)": (lambda: nn.RMSNorm(256), (32, 64, 256), None),
    "Embedding 10000×128, (32, 64) tokens": (lambda: nn.Embedding(10000, 128), (32, 64), 10000),
    "MultiheadAttention 128, 4 heads, batch-first, (32, 64, 128)": (
        lambda: SelfAttention(nn.MultiheadAttention(128, 4, batch_first=True)),
        (32, 64, 128),
        None,
    ),
    "MultiheadAttention 128, 4 heads, sequence-first, (64, 32, 128)": (
        lambda: SelfAttention(nn.MultiheadAttention(128, 4)),
        (32, 64, 128),
        None,
    ),
    "MultiheadAttention 128, 4 heads, dropout 0.1, batch-first, (32, 64, 128)": (
        lambda: SelfAttention(nn.MultiheadAttention(128, 4, dropout=0.1, batch_first=True)),
        (32, 64, 128),
        None,
    ),
    "RNN tanh 64→128, (32, 32, 64)": (lambda: Outputs(nn.RNN(64, 128, batch_first=True)), (32, 32, 64), None),
    "LSTM 64→128, (32, 32, 64)": (lambda: Outputs(nn.LSTM(64, 128, batch_first=True)), (32, 32, 64), None),
    "GRU 64→128, (32, 32, 64)": (lambda: Outputs(nn.GRU(64, 128, batch_first=True)), (32, 32, 64), None),
    "LSTM 64→128, 2 layers, dropout 0.2 between, (32, 32, 64)": (
        lambda: Outputs(nn.LSTM(64, 128, 2, batch_first=True, dropout=0.2)),
        (32, 32, 64),
        None,
    ),
    "LSTM 64→128, packed (32, 8 to 32, 64)": (
        lambda: PackedOutputs(nn.LSTM(64, 128, batch_first=True)),
        (32, 32, 64),
        None,
    ),
}
QUICK_LAYERS = (
    "Linear 256→256, (64, 256)",
    "Conv2d 16→32 k3, (64, 16, 8, 8) (digits CNN conv 2)",
    "ConvTranspose2d 32→16 k4 s2, (32, 32, 8, 8)",
    "GroupNorm 8×64, (32, 64, 16, 16)",
    "Embedding 10000×128, (32, 64) tokens",
    "MultiheadAttention 128, 4 heads, sequence-first, (64, 32, 128)",
    "LSTM 64→128, (32, 32, 64)",
)


def digits_cnn() -> nn.Module:
    """The demo's DigitsCNN as a plain module (the same layers, without Lightning)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def groupnorm_cnn() -> nn.Module:
    """A small ResNet-like stem for 32×32 images with GroupNorm (the per-example-friendly BatchNorm)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.GroupNorm(8, 64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1),
        nn.GroupNorm(8, 64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


class TokenMLP(nn.Module):
    """Token classifier: Embedding → (LayerNorm, Linear 4× MLP, residual) ×2 → RMSNorm → mean → Linear."""

    def __init__(self, vocab: int = 2000, width: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(2)
        )
        self.norm, self.head = nn.RMSNorm(width), nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h).mean(1))


class ConvAutoencoder(nn.Module):
    """16×16 images: Conv1d/2d down with InstanceNorm, ConvTranspose2d up; a 10-way head on the output."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1),
            nn.InstanceNorm2d(16, affine=True),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.decode = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 4, 4, stride=2, padding=1),
        )
        self.head = nn.Linear(4 * 16 * 16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.decode(self.encode(x)).flatten(1))


#: A batch of ``examples`` (None: the benchmark's batch) with float inputs in ``dtype``, from ``seed``:
#: the input and the loss's target.
Data = Callable[[int | None, torch.dtype, int], tuple[Tensor, Tensor]]


def make_input(shape: tuple[int, ...], vocab: int | None, dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if vocab is not None:
        return torch.randint(vocab, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=dtype)


def layer_data(make: Callable[[], nn.Module], shape: tuple[int, ...], vocab: int | None) -> Data:
    """Inputs of ``shape`` and weights w_i of the layer's loss Σ_i ⟨y_i, w_i⟩, of its output's shape."""

    def data(examples, dtype, seed):
        x = make_input((examples or shape[0], *shape[1:]), vocab, dtype, seed)
        torch.manual_seed(3)
        with torch.no_grad():
            probe = make().to(x.dtype if x.is_floating_point() else torch.float32)
            return x, torch.randn_like(probe(x))

    return data


def labelled(shape: tuple[int, ...], vocab: int | None = None) -> Data:
    """Inputs of ``shape`` and one of 10 labels each."""

    def data(examples, dtype, seed):
        x = make_input((examples or shape[0], *shape[1:]), vocab, dtype, seed)
        return x, torch.randint(10, (x.shape[0],), generator=torch.Generator().manual_seed(4))

    return data


def zoo_model(name: str) -> Callable[[], nn.Module]:
    """The zoo's model, its position table frozen if it has one looked up with ids shared by the batch, and the
    bare parameters of modules without a layer rule (a ViT's ``pos_embed``, a layer-scale ``gamma``): the peers
    have no per-example rule for them; frozen, every tool measures the same parameters."""
    entry = ZOO[name]

    def make() -> nn.Module:
        model = entry.make()
        if entry.shared_lookup:
            model.get_submodule(entry.shared_lookup).requires_grad_(False)
        for module in model.modules():
            if rule_for(module) is None:
                for p in module.parameters(recurse=False):
                    p.requires_grad_(False)
        return model

    return make


def zoo_data(name: str, batch: int) -> Data:
    def data(examples, dtype, seed):
        torch.manual_seed(seed)
        return tuple(
            t.to(dtype) if t.is_floating_point() else t  # type: ignore[return-value]
            for t in ZOO[name].batch(examples or batch)
        )

    return data


ZOO_BATCH = 32

#: name: (make the model, its data, its loss: a mean over the examples of their own losses).
MODELS: dict[str, tuple[Callable[[], nn.Module], Data, Callable[[Tensor, Tensor], Tensor]]] = {
    "digits CNN (demo), batch 64": (digits_cnn, labelled((64, 1, 8, 8)), F.cross_entropy),
    "GroupNorm CNN 32×32, batch 32": (groupnorm_cnn, labelled((32, 3, 32, 32)), F.cross_entropy),
    "token MLP, Embedding/LayerNorm/RMSNorm, (32, 64) tokens": (TokenMLP, labelled((32, 64), 2000), F.cross_entropy),
    "conv autoencoder, InstanceNorm/ConvTranspose2d, batch 32": (
        ConvAutoencoder,
        labelled((32, 1, 16, 16)),
        F.cross_entropy,
    ),
    **{
        f"zoo {name}, batch {ZOO_BATCH}": (zoo_model(name), zoo_data(name, ZOO_BATCH), entry.loss)
        for name, entry in ZOO.items()
    },
}


# ----------------------------------------------------------------------------------------------------
# Tools: each turns (module, reduction) into a step ``run(x, target) -> (B,) ‖g_i‖² or None``

Loss = Callable[[Tensor, Tensor], Tensor]


def dot_loss(out: Tensor, weights: Tensor) -> Tensor:
    """Σ_i ℓ_i with ℓ_i = ⟨out_i, weights_i⟩: a layer's own backward seeded with ``weights``."""
    return (out * weights).sum()


class Tool:
    """One way of getting the per-example squared norms (or, for ``bare`` and ``forward``, none)."""

    name = ""

    def prepare(self, module: nn.Module, loss: Loss, mean: bool) -> Callable[[Tensor, Tensor], Tensor | None] | str:
        """A step function, or why this tool has none for ``module``."""
        raise NotImplementedError


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _requiring_grad(x: Tensor) -> Tensor:
    return x.detach().requires_grad_(True) if x.is_floating_point() else x


class Bare(Tool):
    name = "bare"

    def prepare(self, module, loss, mean):
        def run(x, target):
            _clear(module)
            loss(module(_requiring_grad(x)), target).backward()

        return run


class Forward(Tool):
    name = "forward"

    def prepare(self, module, loss, mean):
        def run(x, target):
            loss(module(_requiring_grad(x)), target)  # the graph is built and freed, not run

        return run


class TrainVitals(Tool):
    name = "trainvitals"

    def prepare(self, module, loss, mean):
        plan = plan_sources(module, groups_available=False, fallback=False)
        if plan.uncovered:
            return "not covered: " + "; ".join(sorted(set(plan.uncovered.values())))
        collector = PerExampleGradients(plan.per_example, {}, 2)
        collector.attach(keep_norms=True)

        def run(x, target):
            _clear(module)
            collector.begin_micro_batch()
            collector.expect_batch(x.shape[0])  # as the probe does: a sequence-first layer's batch is dim 1
            loss(module(_requiring_grad(x)), target).backward()
            collector.end_micro_batch(float(x.shape[0]) if mean else 1.0)
            step = collector.pop()
            if step.failed:
                raise RuntimeError(f"trainvitals failed: {step.failed}")
            return step.sq_norms[0]

        return run


def opacus_layers(module: nn.Module) -> bool:
    """Swap in Opacus' drop-in replacements (same weights) for the layers its ``ModuleValidator`` rejects:
    nn.MultiheadAttention, LSTM, GRU (``ModuleValidator.fix``'s) and RNN (DPRNN, which it has no fixer
    for); whether the batch is then first (Opacus' ``batch_first``: no sequence-first layer)."""
    batch_first = True
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.MultiheadAttention):
            new = DPMultiheadAttention(
                child.embed_dim,
                child.num_heads,
                dropout=child.dropout,
                bias=child.in_proj_bias is not None,
                add_bias_kv=child.bias_k is not None,
                add_zero_attn=child.add_zero_attn,
                kdim=child.kdim,
                vdim=child.vdim,
                batch_first=child.batch_first,
            )
        elif isinstance(child, (nn.RNN, nn.LSTM, nn.GRU)):
            kind = {nn.RNN: DPRNN, nn.LSTM: DPLSTM, nn.GRU: DPGRU}[type(child)]
            extra = {"nonlinearity": child.nonlinearity} if isinstance(child, nn.RNN) else {}
            new = kind(
                child.input_size,
                child.hidden_size,
                num_layers=child.num_layers,
                bias=child.bias,
                batch_first=child.batch_first,
                dropout=child.dropout,
                bidirectional=child.bidirectional,
                **extra,
            )
        else:
            continue
        batch_first &= child.batch_first
        new.to(next(child.parameters()).dtype).load_state_dict(child.state_dict())
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, new)
    return batch_first


class Opacus(Tool):
    name = "opacus"

    def prepare(self, module, loss, mean):
        if GradSampleModule is None:
            return "not installed"
        batch_first = opacus_layers(module)
        wrapped = GradSampleModule(
            module, batch_first=batch_first, loss_reduction="mean" if mean else "sum", strict=False
        )

        def run(x, target):
            wrapped.zero_grad(set_to_none=True)
            loss(wrapped(_requiring_grad(x)), target).backward()
            # A norm straight from the operand (as trainvitals' rules take theirs): a squared copy of a
            # (B, *shape) gradient costs more than Opacus' own work on a wide Linear.
            return sum(_sq_norms(p.grad_sample) for p in module.parameters() if p.requires_grad)

        return run


class OpacusGhost(Tool):
    name = "opacus_ghost"

    def prepare(self, module, loss, mean):
        if GradSampleModuleFastGradientClipping is None:
            return "not installed"
        batch_first = opacus_layers(module)
        wrapped = GradSampleModuleFastGradientClipping(
            module,
            batch_first=batch_first,
            loss_reduction="mean" if mean else "sum",
            strict=False,
            use_ghost_clipping=True,
        )

        def run(x, target):
            wrapped.zero_grad(set_to_none=True)
            loss(wrapped(_requiring_grad(x)), target).backward()
            return wrapped.get_norm_sample().square()

        return run


class BackPACK(Tool):
    name = "backpack"

    def prepare(self, module, loss, mean):
        if extend is None:
            return "not installed"
        extended = extend(module)
        params = [p for p in module.parameters() if p.requires_grad]

        def run(x, target):
            _clear(module)
            with backpack_context(BatchL2Grad()):
                loss(extended(_requiring_grad(x)), target).backward()
            missing = [p for p in params if not hasattr(p, "batch_l2")]
            if missing:
                raise RuntimeError(f"BackPACK has no BatchL2Grad for {len(missing)} of the parameters")
            # BackPACK's individual gradients are those of the batch loss: (1/B) ∇ℓ_i for a mean.
            sq = sum(p.batch_l2 for p in params)
            return sq * x.shape[0] ** 2 if mean else sq

        return run


TOOL_CLASSES = {t.name: t for t in (Bare, Forward, TrainVitals, Opacus, OpacusGhost, BackPACK)}


def brute_force_sq_norms(module: nn.Module, loss: Loss, x: Tensor, target: Tensor) -> Tensor:
    """‖g_i‖² of each example's own loss (``loss`` of its rows of the output), one backward per example
    through the batch's one forward: a dropout layer's masks are the ones that forward drew."""
    params = [p for p in module.parameters() if p.requires_grad]
    output = module(_requiring_grad(x))
    out = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(
            loss(output[i : i + 1], target[i : i + 1]), params, retain_graph=True, allow_unused=True
        )
        out.append(sum(g.double().square().sum() for g in grads if g is not None))
    return torch.stack(out)


def _silenced(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def exactness(make: Callable[[], nn.Module], data: Data, loss: Loss, mean: bool, batch: int) -> dict[str, Any]:
    """Per tool: max_i |s_i − t_i| / t_i of its ‖g_i‖² against the brute-force loop in float64 on ``batch``
    examples (the tool run in float64; in float32, flagged, where it fails in float64); a string where
    the tool has no result."""
    torch.manual_seed(0)
    reference = make().double()
    x, t = data(batch, torch.float64, 1)
    t = t.double() if t.is_floating_point() else t
    torch.manual_seed(1)  # each tool's forward below draws the same dropout masks as this one
    truth = brute_force_sq_norms(reference, loss, x, t)  # a one-example mean is the example's own loss
    out: dict[str, Any] = {}
    for name in PEERS:
        for dtype in (torch.float64, torch.float32):
            module = copy.deepcopy(reference).to(dtype)
            xd = x.to(dtype) if x.is_floating_point() else x
            td = t.to(dtype) if t.is_floating_point() else t
            try:
                run = _silenced(lambda: TOOL_CLASSES[name]().prepare(module, loss, mean))
                if isinstance(run, str):
                    out[name] = run
                    break
                torch.manual_seed(1)
                sq = _silenced(lambda: run(xd, td))
                error = ((sq.double() - truth).abs() / truth).max().item()
                out[name] = error if dtype == torch.float64 else f"float32 only: {error:.0e}"
                break
            except Exception as err:  # noqa: BLE001 - a peer that cannot run this layer: say why in the table
                if dtype == torch.float64:
                    out[name] = f"fails in float64: {type(err).__name__}: {str(err)[:70]}"
                else:
                    out[name] = f"fails: {type(err).__name__}: {str(err)[:70]}"
    return out


def timings(
    make: Callable[[], nn.Module],
    data: Data,
    loss: Loss,
    mean: bool,
    repetitions: int,
    seconds: float,
    optimizer: bool,
    exact: dict[str, Any],
) -> dict[str, Any]:
    """CPU seconds per step of each tool that runs (float32): ``repetitions`` interleaved rounds of
    ~``seconds`` each (at least one step)."""
    torch.manual_seed(0)
    base = make()
    x, t = data(None, torch.float32, 2)
    runs: dict[str, Callable[[], Any]] = {}
    for name in TOOLS:
        if optimizer and name == "forward":  # the backward alone is a layer's measure, not a model's
            continue
        reason = exact.get(name)
        if isinstance(reason, str) and not reason.startswith(("float32 only", "fails in float64")):
            continue
        module = copy.deepcopy(base)
        step = _silenced(lambda: TOOL_CLASSES[name]().prepare(module, loss, mean))
        if isinstance(step, str):
            continue
        opt = torch.optim.Adam(module.parameters(), lr=1e-4) if optimizer else None

        def run(step=step, opt=opt) -> None:
            step(x, t)
            if opt is not None:
                opt.step()

        try:
            _silenced(run)  # warm-up: first-call allocations, oneDNN primitive caches
        except Exception as err:  # noqa: BLE001
            exact[name] = f"fails in float32: {type(err).__name__}: {str(err)[:70]}"
            continue
        runs[name] = run
    steps = {}
    for name, run in runs.items():
        start = time.process_time()
        _silenced(run)
        steps[name] = max(1, math.ceil(seconds / max(time.process_time() - start, 1e-5)))
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(repetitions):
            for name, run in runs.items():
                start = time.process_time()
                for _ in range(steps[name]):
                    run()
                per_step[name].append((time.process_time() - start) / steps[name])
    return {"steps_per_repetition": steps, "seconds": per_step}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Median ms/step, median ratio to bare, median extra / own backward (bare − forward), per tool."""
    sec = result["seconds"]
    bare = sec["bare"]
    out: dict[str, Any] = {"bare_ms": 1e3 * median(bare)}
    if "forward" in sec:
        backward = [b - f for b, f in zip(bare, sec["forward"])]
        out["backward_ms"] = 1e3 * median(backward)
    for name in PEERS:
        if name not in sec:
            continue
        ratios = [s / b for s, b in zip(sec[name], bare)]
        entry = {"ms": 1e3 * median(sec[name]), "ratio": median(ratios), "range": (min(ratios), max(ratios))}
        if "forward" in sec:
            entry["extra_per_backward"] = median(
                [(s - b) / (b - f) for s, b, f in zip(sec[name], bare, sec["forward"])]
            )
        out[name] = entry
    if "trainvitals" in sec and "opacus_ghost" in sec:  # the same round's steps: the machine's load cancels
        paired = [t / o for t, o in zip(sec["trainvitals"], sec["opacus_ghost"])]
        out["trainvitals_per_opacus_ghost"] = {"ratio": median(paired), "range": (min(paired), max(paired))}
    return out


def _cell(summary: dict[str, Any], name: str, per_backward: bool) -> str:
    if name not in summary:
        return "—"
    s = summary[name]
    if per_backward and "extra_per_backward" in s:
        return f"{s['ratio']:.2f} (+{s['extra_per_backward']:.2f})"
    return f"{s['ratio']:.2f}"


def _error_cell(error: Any) -> str:
    if isinstance(error, float):
        return f"{error:.0e}"
    if isinstance(error, str) and error.startswith("float32 only: "):
        return error.removeprefix("float32 only: ") + " (f32)"
    return "—"


def table(results: dict[str, dict[str, Any]], per_backward: bool) -> str:
    headers = (
        ["", "bare ms/step"]
        + (["own bwd ms", "trainvitals +ms"] if per_backward else [])
        + [
            "trainvitals",
            "Opacus GradSampleModule",
            "Opacus ghost clipping",
            "BackPACK BatchL2Grad",
            "max rel. err trainvitals / Opacus / ghost / BackPACK",
        ]
    )
    rows = []
    for label, r in results.items():
        s, e = r["summary"], r["exactness"]
        row = [label, f"{s['bare_ms']:.3f}"]
        if per_backward:
            row.append(f"{s.get('backward_ms', float('nan')):.3f}")
            extra = s["trainvitals"]["ms"] - s["bare_ms"] if "trainvitals" in s else float("nan")
            row.append(f"{extra:.3f}")
        row += [_cell(s, n, per_backward) for n in PEERS]
        row.append(" / ".join(_error_cell(e.get(n)) for n in PEERS))
        rows.append(row)
    return markdown_table(headers, rows)


def reasons(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for label, r in results.items():
        for name, value in r["exactness"].items():
            if isinstance(value, str) and not value.startswith("float32 only"):
                lines.append(f"- {label}, {name}: {value}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The conv path: where the second convolution's per-example time goes


def padded_width_sq_norms(conv: nn.Conv2d, x: Tensor, g: Tensor, patches: Tensor, blocks: Tensor) -> Tensor:
    """A candidate form of the conv rule (stride 1, zero padding p, no dilation): the receptive fields
    taken over the padded width, H·(W + 2p) positions, where each (channel, kernel offset) row of the
    patches is one contiguous run of the padded input (one long copy, not H·W-sized pieces); the output
    gradient is zero at the 2p extra columns, so the blocks are exact at 1 + 2p/W times the FLOPs."""
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    b, c, h, w = x.shape
    wide = w + 2 * pw
    positions = h * wide
    xp = F.pad(x, (pw, pw, ph, ph + 1))  # one more row keeps the last kernel offset's run in range
    stride = xp.stride()
    runs = xp.as_strided((b, c, kh, kw, positions), (stride[0], stride[1], wide, 1, 1))
    patches = patches[: runs.numel()].view(b, c * kh * kw, positions)
    patches.view(runs.shape).copy_(runs)
    gp = F.pad(g, (0, 2 * pw)).flatten(2)
    out = blocks[: b * g.shape[1] * c * kh * kw].view(b, g.shape[1], c * kh * kw)
    torch.bmm(gp, patches.transpose(1, 2), out=out)
    return _sq_norms(out) + g.flatten(2).sum(2).square().sum(1)


def window_patches(conv: nn.Conv2d, x: Tensor, workspace: Workspace) -> Tensor:
    """The patches as :func:`_conv_patches` forms them for a convolution without "same" width: a copy of the
    strided window view of the padded input (runs of W)."""
    windows = F.pad(x, conv._reversed_padding_repeated_twice).unfold(2, 3, 1).unfold(3, 3, 1).movedim((2, 3), (-2, -1))
    return workspace.take("window", windows.shape, windows).copy_(windows)


def conv_profile(repetitions: int, seconds: float) -> dict[str, float]:
    """Milliseconds (median CPU time) of the per-example rule of the digits CNN's second convolution and
    of its parts, on the input and output gradient of a real step (batch 64), against the layer's own
    backward and weight gradient (oneDNN's ``convolution_backward``)."""
    torch.manual_seed(0)
    model = digits_cnn()
    conv = model[2]
    x = torch.randn(64, 1, 8, 8)
    captured: dict[str, Tensor] = {}

    def capture(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        captured["x"] = args[0].detach()
        out.register_hook(lambda g: captured.__setitem__("g", g))

    handle = conv.register_forward_hook(capture)
    F.cross_entropy(model(x), torch.randint(10, (64,))).backward()
    handle.remove()
    inputs, grad = captured["x"], captured["g"] * 64  # own-loss units, as the probe scales them later
    rule, ws = rule_for(conv), Workspace()
    gram_rule = type(rule)(form="gram")
    use = [Use(inputs, grad)]
    patches = _conv_patches(conv, inputs, torch.float32, ws)
    g = grad.flatten(2).transpose(1, 2)
    blocks = _bmm(g.transpose(1, 2), patches, ws, "blocks")
    w = conv.weight.detach()
    wide_patches, wide_blocks = torch.empty(64 * 16 * 9 * 80), torch.empty(64 * 32 * 16 * 9)
    padded = F.pad(inputs, (1, 1, 1, 2))
    wide_runs = padded.as_strided((64, 16, 3, 3, 80), (padded.stride(0), padded.stride(1), 10, 1, 1))
    exact = rule.sq_norms(conv, use, ws)
    candidate = padded_width_sq_norms(conv, inputs, grad, wide_patches, wide_blocks)
    if not torch.allclose(candidate, exact, rtol=1e-5):
        raise RuntimeError("the padded-width form does not give the rule's norms")
    for form, norms in (("Gram", gram_rule.sq_norms), ("patches'", lambda *a: OuterProductRule.sq_norms(rule, *a))):
        if not torch.allclose(norms(conv, use, ws), exact, rtol=1e-5):
            raise RuntimeError(f"the {form} form does not give the rule's norms")
    args = (conv.stride, conv.padding, conv.dilation, False, [0, 0], 1)
    parts: dict[str, Callable[[], Any]] = {
        "own backward (input + weight + bias grads)": lambda: torch.ops.aten.convolution_backward(
            grad, inputs, w, [w.shape[0]], *args, [True, True, True]
        ),
        "own weight gradient (oneDNN, the FLOP floor)": lambda: torch.ops.aten.convolution_backward(
            grad, inputs, w, None, *args, [False, True, False]
        ),
        "trainvitals rule: sq_norms (all of it), the blocks from strided reads, no patches": lambda: rule.sq_norms(
            conv, use, ws
        ),
        "  the shifted source: K' = 3 copies of the input": lambda: _shifted_source(conv, inputs, torch.float32, ws),
        "the blocks from the patches (OuterProductRule.sq_norms, all of it)": lambda: OuterProductRule.sq_norms(
            rule, conv, use, ws
        ),
        "  patches: shifted contiguous copies (T·I per example)": lambda: _conv_patches(
            conv, inputs, torch.float32, ws
        ),
        "  (the copy of the strided window view, other convolutions' form)": lambda: window_patches(conv, inputs, ws),
        "  per-example blocks: bmm (B × O×T · T×I)": lambda: _bmm(g.transpose(1, 2), patches, ws, "blocks"),
        "  ‖block‖²: vector_norm": lambda: _sq_norms(blocks),
        "  bias: Σ_t δ, ‖·‖²": lambda: g.sum(1).square().sum(1),
        "candidate: patches over the padded width (+25% FLOPs, long runs)": lambda: padded_width_sq_norms(
            conv, inputs, grad, wide_patches, wide_blocks
        ),
        "  its copy of the patches": lambda: wide_patches[: wide_runs.numel()].view(wide_runs.shape).copy_(wide_runs),
        f"Gram form, forced (the cost model takes {rule.form_for(conv, inputs.shape)}): sq_norms (all of it)": (
            lambda: gram_rule.sq_norms(conv, use, ws)
        ),
        "  its two Gram bmm + vecdot (the patches above not counted)": lambda: torch.linalg.vecdot(
            torch.bmm(patches, patches.transpose(1, 2)).flatten(1), torch.bmm(g, g.transpose(1, 2)).flatten(1)
        ),
    }
    for fn in parts.values():
        fn()
    n = {}
    for name, fn in parts.items():
        start = time.process_time()
        fn()
        n[name] = max(5, math.ceil(seconds / max(time.process_time() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in parts}
    with torch.no_grad():
        for _ in range(repetitions):
            for name, fn in parts.items():
                start = time.process_time()
                for _ in range(n[name]):
                    fn()
                times[name].append((time.process_time() - start) / n[name])
    out = {name: 1e3 * median(t) for name, t in times.items()}
    b, t, i, o = inputs.shape[0], grad.shape[2] * grad.shape[3], patches.shape[2], grad.shape[1]
    out["weight-gradient MFLOP (2·B·T·I·O)"] = 2 * b * t * i * o / 1e6
    return out


#: T positions × I input × O output features of :func:`form_sweep`, per layout: a convolution's (per group),
#: and a Linear layer's on sequences up to GPT-2's (T 1024; I, O 768 and 3072); ``quick``: a few of them.
FORM_GRIDS = {
    "conv": (
        ((4, 9, 16, 36, 64, 144, 256), (9, 27, 72, 144, 288, 576, 1152), (8, 16, 32, 64, 128, 256, 512)),
        ((4, 16, 64), (9, 144, 576), (8, 32, 128)),
    ),
    "linear": (
        ((4, 16, 64, 256, 1024), (16, 64, 256, 768), (16, 64, 256, 768, 3072)),
        ((4, 64, 1024), (64, 768), (64, 3072)),
    ),
}


def form_sweep(seconds: float, quick: bool, layout: str = "conv") -> dict[str, Any]:
    """The rules' cost model against both forms timed, over a grid of T positions, I input and O output
    features (:data:`FORM_GRIDS`), in a convolution's layouts (``layout="conv"``: transposed views of the
    patches and of the output gradient) or a Linear layer's (contiguous ``(B, T, I)`` and ``(B, T, O)``):
    per shape the µs per example of the per-example blocks (one bmm, ‖·‖²) and of the ghost Gram matrices
    (two bmm, one dot product; the patches, which both need, not timed); per criterion (the conv rule's
    FLOPs with the Gram matrices' at 1/1.2, the Linear rule's FLOPs, the earlier Linear rule 2T² ≤ I·O)
    the mean of chosen / faster − 1 and the shapes where its choice is ≥ 5 % slower."""
    grid = FORM_GRIDS[layout][quick]
    criteria = {
        "FLOPs, the Gram matrices' at 1/1.2 (conv)": lambda t, i, o: gram_is_cheaper(t, i, o, _GRAM_SPEED),
        "FLOPs (Linear)": gram_is_cheaper,
        "the earlier Linear rule, the smaller temporaries: 2T² ≤ I·O": lambda t, i, o: 2 * t * t <= i * o,
    }
    shapes = []
    for t, i, o in itertools.product(*grid):
        b = max(1, min(256, int(1e6 / (t * max(i, t) + o * i + t * t))))  # ~4 MB of operands
        if layout == "conv":  # transposed views of the patches (B, I, T) and the output gradient (B, O, T)
            a, g = torch.randn(b, i, t).transpose(1, 2), torch.randn(b, o, t).transpose(1, 2)
        else:
            a, g = torch.randn(b, t, i), torch.randn(b, t, o)
        ws = Workspace()
        forms = {
            "blocks": lambda: _sq_norms(_bmm(g.transpose(1, 2), a, ws, "blocks")),
            "gram": lambda: torch.linalg.vecdot(
                _bmm(a, a.transpose(1, 2), ws, "gram_a").flatten(1), _bmm(g, g.transpose(1, 2), ws, "gram_g").flatten(1)
            ),
        }
        us = {}
        for name, fn in forms.items():
            fn()
            start = time.process_time()
            fn()
            n = max(3, math.ceil(seconds / max(time.process_time() - start, 1e-6)))
            rounds = []
            for _ in range(5):
                start = time.process_time()
                for _ in range(n):
                    fn()
                rounds.append((time.process_time() - start) / n / b * 1e6)
            us[name] = median(rounds)
        shapes.append({"T": t, "I": i, "O": o, **us})
    out: dict[str, Any] = {"shapes": shapes}
    for label, gram in criteria.items():
        excess = [
            (s["gram"] if gram(s["T"], s["I"], s["O"]) else s["blocks"]) / min(s["gram"], s["blocks"]) - 1
            for s in shapes
        ]
        out[label] = {"mean excess": sum(excess) / len(excess), "≥ 5 % slower": sum(e >= 0.05 for e in excess)}
    return out


def step_breakdown(repetitions: int, steps: int) -> dict[str, float]:
    """CPU ms per step of the digits CNN's plain loop, bare and with trainvitals, and of the collector's
    parts within the measured steps: each layer's rule (with its bookkeeping in ``_measure``), the forward
    hooks, the backward hooks outside the rules, and the per-step calls. The rest of the extra time is
    autograd's (its tensor hooks) and the cache the per-example work evicts from the bare step's data."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(10, (64,))
    bare_model, model = digits_cnn(), digits_cnn()
    model.load_state_dict(bare_model.state_dict())
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    spent: dict[str, float] = {}

    def timed(key: Callable[..., str], inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            start = time.process_time()
            try:
                return inner(*args)
            finally:
                spent[key(*args)] = spent.get(key(*args), 0.0) + time.process_time() - start

        return wrapper

    def layer(group: list[str]) -> str:
        return "rule + bookkeeping, " + ", ".join(f"{n} {type(model[int(n)]).__name__}" for n in group)

    collector._measure = timed(layer, collector._measure)  # looked up on the instance by the hooks
    collector._backward = timed(lambda *_: "backward hooks (with the rules)", collector._backward)
    collector._forward = timed(lambda *_: "forward hooks", collector._forward)
    for name in ("begin_micro_batch", "end_micro_batch", "pop"):
        setattr(collector, name, timed(lambda *_, name=name: name, getattr(collector, name)))
    collector.attach(keep_norms=True)
    optimizers = {m: torch.optim.Adam(m.parameters(), lr=1e-4) for m in (bare_model, model)}

    def bare() -> None:
        _clear(bare_model)
        F.cross_entropy(bare_model(x), y).backward()
        optimizers[bare_model].step()

    def measured() -> None:
        _clear(model)
        collector.begin_micro_batch()
        F.cross_entropy(model(x), y).backward()
        collector.end_micro_batch(64.0)
        collector.pop()
        optimizers[model].step()

    for _ in range(10):
        bare(), measured()
    spent.clear()
    seconds: dict[str, list[float]] = {"bare": [], "trainvitals": []}
    for _ in range(repetitions):
        for name, run in (("bare", bare), ("trainvitals", measured)):
            start = time.process_time()
            for _ in range(steps):
                run()
            seconds[name].append((time.process_time() - start) / steps)
    per_step = {k: 1e3 * v / (repetitions * steps) for k, v in spent.items()}
    rules = sum(v for k, v in per_step.items() if k.startswith("rule"))
    per_step["backward hooks (with the rules)"] -= rules
    out = {"bare step": 1e3 * median(seconds["bare"]), "trainvitals step": 1e3 * median(seconds["trainvitals"])}
    out["extra"] = out["trainvitals step"] - out["bare step"]
    out.update(sorted(per_step.items(), key=lambda kv: -kv[1]))
    out = {k.replace("backward hooks (with the rules)", "backward hooks outside the rules"): v for k, v in out.items()}
    out["not in the collector's calls (autograd, cache)"] = out["extra"] - sum(per_step.values())
    return out


# ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=7, help="interleaved rounds per layer or model")
    parser.add_argument("--seconds", type=float, default=0.06, help="CPU seconds of bare steps per round")
    parser.add_argument("--exact-batch", type=int, default=8, help="examples in the float64 exactness check")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 7 layers, 3 models, 3 rounds (< 1 min)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="only the layers and models whose label contains this (repeatable); "
        "the conv-path sections run only with none or with 'digits'; the rules' cost model against "
        "both forms timed over shapes only with 'forms' (a convolution's layouts) or 'linear-forms' (a Linear's)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers, models = LAYERS, MODELS
    if args.quick:
        args.repetitions, args.seconds = 3, 0.02
        layers = {k: LAYERS[k] for k in QUICK_LAYERS}
        models = {k: MODELS[k] for k in (*list(MODELS)[:2], f"zoo gru_language_model, batch {ZOO_BATCH}")}
    if args.only:
        layers = {k: v for k, v in layers.items() if any(o in k for o in args.only)}
        models = {k: v for k, v in models.items() if any(o in k for o in args.only)}
    print(f"# Per-example squared norms ({machine_line()}; CPU time, {args.repetitions} interleaved rounds)")

    layer_results: dict[str, dict[str, Any]] = {}
    for label, (make, shape, vocab) in layers.items():
        data = layer_data(make, shape, vocab)
        exact = exactness(make, data, dot_loss, False, args.exact_batch)
        result = timings(make, data, dot_loss, False, args.repetitions, args.seconds, False, exact)
        layer_results[label] = {"exactness": exact, "summary": summarise(result), **result}
        print(f"  {label}: done", flush=True)
    print("\n## Layers: step time / bare step (extra time / the layer's own backward); exactness in float64\n")
    print(table(layer_results, per_backward=True))
    print("\n" + reasons(layer_results))

    model_results: dict[str, dict[str, Any]] = {}
    for label, (make, data, loss) in models.items():
        exact = exactness(make, data, loss, True, args.exact_batch)
        result = timings(make, data, loss, True, args.repetitions, args.seconds, True, exact)
        model_results[label] = {"exactness": exact, "summary": summarise(result), **result}
        print(f"  {label}: done", flush=True)
    print("\n## End to end: a plain loop's step (forward, mean loss, backward, Adam) / the bare step\n")
    print(table(model_results, per_backward=False))
    for label, r in model_results.items():
        paired = r["summary"].get("trainvitals_per_opacus_ghost")
        if paired:
            low, high = paired["range"]
            print(
                f"- {label}: trainvitals' step / Opacus ghost clipping's, per round: {paired['ratio']:.3f} "
                f"[{low:.3f}–{high:.3f}]"
            )
    print("\n" + reasons(model_results))

    profile, breakdown = {}, {}
    if not args.only or "digits" in args.only:
        profile = conv_profile(args.repetitions, args.seconds / 2)
        print("\n## The digits CNN's second convolution (B 64, T 64, I 144, O 32): CPU ms\n")
        print(markdown_table(["", "ms"], [[k, f"{v:.3f}"] for k, v in profile.items()]))
        breakdown = step_breakdown(args.repetitions, 10 if args.quick else 50)
        print("\n## The digits CNN's plain-loop step with trainvitals, by part: CPU ms per step\n")
        print(markdown_table(["", "ms"], [[k, f"{v:.3f}"] for k, v in breakdown.items()]))
    sweeps = {}
    for layout, only in (("conv", "forms"), ("linear", "linear-forms")):
        if only not in args.only:
            continue
        sweep = sweeps[layout] = form_sweep(args.seconds / 4, args.quick, layout)
        print(f"\n## The weight-norm form over {len(sweep['shapes'])} shapes in a {layout} layout: the choice\n")
        rows = [[k, f"{v['mean excess']:.1%}", str(v["≥ 5 % slower"])] for k, v in sweep.items() if k != "shapes"]
        print(markdown_table(["criterion", "mean chosen / faster − 1", "shapes ≥ 5 % slower"], rows))
    write_json(
        args.out,
        {
            "machine": machine_line(),
            "repetitions": args.repetitions,
            "layers": {k: {"exactness": v["exactness"], "summary": v["summary"]} for k, v in layer_results.items()},
            "models": {k: {"exactness": v["exactness"], "summary": v["summary"]} for k, v in model_results.items()},
            "conv_profile": profile,
            "step_breakdown": breakdown,
            "form_sweeps": sweeps,
        },
    )


if __name__ == "__main__":
    main()
