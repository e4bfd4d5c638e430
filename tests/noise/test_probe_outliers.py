"""BatchVarianceProbe's per-example gradient norms (histogram, outliers panel) against a brute-force loop over
every trainable parameter: the torch.func layers are in them, what is not is named, and BatchNorm in training
mode logs none."""

from __future__ import annotations

import glob
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util.tensor_util import make_ndarray
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.noise.probe import BatchVarianceProbe

B = 12


class Head(nn.Module):
    """An output layer of one's own (its own weight, ``x @ w``): no rule, so torch.func measures it."""

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Net(pl.LightningModule):
    """Linear → [BatchNorm1d] → Tanh → Head, and with ``pos`` a bare position offset of the model itself, read
    through a flip: neither its graph (at the first step), nor the rules, nor torch.func measure it (its forward runs
    the layers with weight matrices)."""

    def __init__(self, batchnorm: bool = False, pos: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 16)
        self.n = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.h = Head(16, 2)
        self.pos = nn.Parameter(0.1 * torch.randn(3)) if pos else None

    def per_example(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.pos.flip(0) if self.pos is not None else x
        return F.cross_entropy(self.h(torch.tanh(self.n(self.a(x)))), y, reduction="none")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.per_example(*batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def brute_force_norms(module: Net, x: torch.Tensor, y: torch.Tensor, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """‖g_i‖ over every trainable parameter but ``skip``: one backward per example of the batch's forward (which
    BatchNorm's statistics couple), in float64."""
    params = [p for n, p in module.named_parameters() if n not in skip]
    losses = module.per_example(x, y)
    return torch.stack(
        [
            sum(g.square().sum() for g in torch.autograd.grad(losses[i], params, retain_graph=True))
            for i in range(len(x))
        ]
    ).sqrt()


def fit_probe(
    module: Net, x: torch.Tensor, y: torch.Tensor, log_dir: str, steps: int = 1, **probe_args: Any
) -> tuple[BatchVarianceProbe, list[str]]:
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=B, **probe_args)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pl.Trainer(
            max_steps=steps,
            callbacks=[probe],
            logger=TensorBoardLogger(log_dir, name="", version=""),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            num_sanity_val_steps=0,
            precision="64-true",
        ).fit(module, DataLoader(TensorDataset(x, y), batch_size=B))
    return probe, [str(w.message) for w in record]


def logged(log_dir: str) -> dict[str, list[Any]]:
    """Each tag's summary values in the event files, in order (histograms as TensorBoard reads them)."""
    out: dict[str, list[Any]] = {}
    for path in glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(value)
    return out


def panel_rows(value: Any) -> tuple[str, list[tuple[int, float]]]:
    """A text panel's heading and its table's (row, ‖g_i‖)."""
    text = b"".join(value.tensor.string_val).decode()
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and "‖" not in line]
    return text.splitlines()[0], [(int(r[0]), float(r[1])) for r in rows]


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (B,), generator=g)


@pytest.mark.parametrize("sub_batch", [4, 16])  # past the torch.func sub-batch in chunks, or all in it
def test_a_torch_func_layer_is_in_the_norms_and_their_ranking(tmp_path, sub_batch):
    torch.manual_seed(0)
    module, (x, y) = Net().double(), data()
    truth = brute_force_norms(module, x, y)
    probe, _ = fit_probe(module, x, y, str(tmp_path), fallback_sub_batch=sub_batch)
    assert f"torch.func vmap on a sub-batch of up to {sub_batch} examples: Head×1" in probe.sources
    heading, rows = panel_rows(logged(str(tmp_path))["grad_noise/outliers/text_summary"][-1])
    order = torch.argsort(truth, descending=True).tolist()
    assert [r for r, _ in rows] == order and [r for r, _ in probe.last_outliers] == order
    assert torch.allclose(
        torch.tensor([v for _, v in probe.last_outliers], dtype=torch.float64), truth[order], rtol=1e-9
    )
    assert [v for _, v in rows] == pytest.approx(truth[order].tolist(), rel=1e-3)  # 4 significant digits
    assert heading.startswith(
        "**Largest per-example gradient norms at optimizer step 0, over all trainable parameters.**"
    )
    assert "(over all trainable parameters)" in probe.summary_markdown()
    histogram = logged(str(tmp_path))["grad_noise/per_example_grad_norm"][-1]
    buckets = make_ndarray(histogram.tensor)  # (left, right, count) rows, as TensorBoard reads them
    assert buckets[:, 2].sum() == B and buckets[-1, 1] == pytest.approx(float(truth.max()), rel=1e-6)
    assert (
        histogram.metadata.summary_description == "Each example's gradient norm ‖g_i‖, over all trainable parameters."
    )


def test_a_parameter_nothing_measures_is_named_with_the_share_covered(tmp_path):
    torch.manual_seed(0)
    module, (x, y) = Net(pos=True).double(), data(1)
    truth = brute_force_norms(module, x, y, skip=("pos",))
    probe, _ = fit_probe(module, x, y, str(tmp_path), steps=2)  # the first finds the flip, the second goes without
    assert "`pos`" in probe.sources  # not measured: the plan says so too
    total = sum(p.numel() for p in module.parameters())
    label = f"over {1 - 3 / total:.1%} of parameters (not: `pos`)"
    heading, rows = panel_rows(logged(str(tmp_path))["grad_noise/outliers/text_summary"][-1])
    assert (
        heading == f"**Largest per-example gradient norms at optimizer step 1, {label}.** Look at these examples "
        "first: a mislabelled, corrupt or duplicated example has a gradient far larger than the others'."
    )
    order = torch.argsort(truth, descending=True).tolist()
    assert [r for r, _ in probe.last_outliers] == order
    assert torch.allclose(
        torch.tensor([v for _, v in probe.last_outliers], dtype=torch.float64), truth[order], rtol=1e-9
    )
    assert probe.outlier_coverage == label and f"({label})" in probe.summary_markdown()
    # Dated: the fit-end table is of the fit's end, the outliers of their histogram's step.
    assert f" at optimizer step 1 ({label}) |" in probe.summary_markdown()
    histogram = logged(str(tmp_path))["grad_noise/per_example_grad_norm"][-1]
    assert histogram.metadata.summary_description == f"Each example's gradient norm ‖g_i‖, {label}."
    legacy = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})  # as `trainvitals report` reads
    legacy.Reload()
    assert len(legacy.Histograms("grad_noise/per_example_grad_norm")) == 1
    assert legacy.SummaryMetadata("grad_noise/per_example_grad_norm").plugin_data.plugin_name == "histograms"


def test_batchnorm_in_training_mode_logs_no_norms_and_says_why_once(tmp_path):
    torch.manual_seed(0)
    module, (x, y) = Net(batchnorm=True).double(), data()
    probe, warned = fit_probe(module, x, y, str(tmp_path), steps=3)
    tags = logged(str(tmp_path))
    assert "grad_noise/per_example_grad_norm" not in tags and "grad_noise/outliers/text_summary" not in tags
    assert not probe.last_outliers and "largest per-example" not in probe.summary_markdown()
    said = [w for w in warned if "no per-example gradient norms" in w]
    assert said == [
        "trainvitals BatchVarianceProbe: no per-example gradient norms (histogram, outliers panel) at "
        "steps where BatchNorm is in training mode (n), which couples the examples: none has a gradient "
        "of its own."
    ]


def test_batchnorm_in_eval_mode_is_measured_and_its_norms_logged(tmp_path):
    """Frozen statistics (BatchNorm in eval mode, its affine trained): examples are independent again."""

    class FrozenStatistics(Net):
        def on_train_epoch_start(self) -> None:
            self.n.eval()

    torch.manual_seed(0)
    module, (x, y) = FrozenStatistics(batchnorm=True).double(), data()
    module.n.eval()
    truth = brute_force_norms(module, x, y)
    probe, warned = fit_probe(module, x, y, str(tmp_path))
    assert not [w for w in warned if "no per-example gradient norms" in w]
    order = torch.argsort(truth, descending=True).tolist()
    assert [r for r, _ in probe.last_outliers] == order and probe.outlier_coverage == "over all trainable parameters"
    assert torch.allclose(
        torch.tensor([v for _, v in probe.last_outliers], dtype=torch.float64), truth[order], rtol=1e-9
    )


class Recommender(pl.LightningModule):
    """One item id per example, looked up in a table ((B,) integer ids), regressed on a target."""

    def __init__(self) -> None:
        super().__init__()
        self.items, self.head = nn.Embedding(9, 3), nn.Linear(3, 1)

    def per_example(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.head(torch.tanh(self.items(ids))).squeeze(-1) - y).square()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.per_example(*batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_lookup_shared_by_the_batch_at_a_histogram_step_leaves_that_step_out_then_is_named(tmp_path):
    """Ids arange(B) at step 1 (between logging steps, 0 and 4) are read at that histogram step: its norms, which
    would lack the table, are not logged; from step 2 on the table is named as what the norms leave out."""
    torch.manual_seed(0)
    ids = torch.cat([torch.randint(0, 9, (8,)), torch.arange(8).repeat(2)])
    y = torch.randn(24, dtype=torch.float64)
    module = Recommender().double()
    probe = BatchVarianceProbe(histogram_every_n_steps=1, log_every_n_steps=4, top_k=8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pl.Trainer(
            max_steps=3,
            callbacks=[probe],
            logger=TensorBoardLogger(str(tmp_path), name="", version=""),
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            precision="64-true",
        ).fit(module, DataLoader(TensorDataset(ids, y), batch_size=8))
    panels = logged(str(tmp_path))["grad_noise/outliers/text_summary"]
    assert [panel_rows(p)[0].split(",")[0].rsplit(" ", 1)[1] for p in panels] == ["0", "2"]
    # One message for the event, the cause first: the table failed per example at step 1, so that step's
    # norms are not logged, and from the next step on the norms cover the layers left.
    ours = [str(w.message) for w in record if "BatchVarianceProbe" in str(w.message)]
    (said,) = [m for m in ours if "items" in m]
    assert said.index("`items`:") < said.index("Optimizer step 1 ") < said.index("histogram")
    heading, rows = panel_rows(panels[-1])
    assert f"over {4 / 31:.1%} of parameters (not: `items`)" in heading
    truth = brute_force_norms(module, ids[16:], y[16:], skip=("items.weight",))
    order = torch.argsort(truth, descending=True)
    assert [r for r, _ in probe.last_outliers] == (order + 16).tolist()
    assert torch.allclose(
        torch.tensor([v for _, v in probe.last_outliers], dtype=torch.float64), truth[order], rtol=1e-9
    )


@pytest.mark.parametrize("histograms", [1, 0])
def test_with_batchnorm_and_micro_batches_the_first_line_says_no_norms_are_logged(tmp_path, monkeypatch, histograms):
    """Micro-batches measure every parameter (BatchNorm couples the examples): no per-example norms at all, which
    the fit's first line says when histograms are on."""
    torch.manual_seed(0)
    module, (x, y) = Net(batchnorm=True).double(), data()
    probe = BatchVarianceProbe(histogram_every_n_steps=histograms)
    said: list[str] = []
    monkeypatch.setattr(probe, "info", lambda text, once=False: said.append(text))
    pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=2,
        callbacks=[probe],
        logger=TensorBoardLogger(str(tmp_path), name="", version=""),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        precision="64-true",
    ).fit(module, DataLoader(TensorDataset(x, y), batch_size=B // 2))
    assert "measured from micro-batches and ranks" in said[0]
    note = (
        "no per-example gradient norms (grad_noise/per_example_grad_norm, grad_noise/outliers), as no parameter is "
        "measured per example"
    )
    assert (note in said[0]) == bool(histograms)
    assert "grad_noise/per_example_grad_norm" not in logged(str(tmp_path)) and not probe.last_outliers
