"""TrainvitalsDashboard: the custom-scalars layout in the event file, the text panels, the progress bar."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing import data_ingester, io_wrapper
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata
from tensorboard.util import tensor_util

from trainvitals.demo.data import DigitsDataModule
from trainvitals.demo.model import DigitsCNN
from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.noise.estimate import GradientNoise
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.plumbing.sharing import GRADIENT_NOISE, Vitals
from trainvitals.tags import DIAGNOSIS_TAG, PER_LAYER_GRAD_NORM, REPORT_HTML, REPORT_JSON
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard, progress_bar_values, tensorboard_command
from trainvitals.tensorboard.layout import (
    BAND_CATEGORY,
    BAND_CHART,
    CATEGORY,
    GRAD_NORM_CHART,
    IN_BAND_CHART,
    OUTLIERS_OFF,
    trainvitals_layout,
)


def fit(tmp_path: Path, *callbacks: pl.Callback, **overrides) -> tuple[pl.Trainer, EventAccumulator]:
    """A few accumulated optimizer steps of the digits CNN, logged to TensorBoard under tmp_path."""
    pl.seed_everything(0, verbose=False)  # B_simple is logged once EMA(‖G‖²) > 0: at which steps depends on the init
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    # 24 steps: the noise estimate decides after MIN_MEASUREMENTS (20) measurements.
    kwargs = trainer_kwargs(
        logger=logger,
        max_steps=24,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    kwargs.update(overrides)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=16))
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return trainer, acc


def read_layout(acc: EventAccumulator) -> layout_pb2.Layout:
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    assert acc.SummaryMetadata(metadata.CONFIG_SUMMARY_TAG).plugin_data.plugin_name == metadata.PLUGIN_NAME
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> tuple[pl.Trainer, EventAccumulator]:
    return fit(
        tmp_path_factory.mktemp("dash"),
        GradNormMonitor(histogram_every_n_steps=0),
        GradNormEarlyStopping(patience=1000),
        TrainvitalsDashboard(),
        enable_progress_bar=True,
    )


def chart_tags(layout: layout_pb2.Layout, acc: EventAccumulator) -> dict[str, list[str]]:
    """Which logged scalar tags each chart picks up, matched the way TensorBoard matches."""
    scalars = acc.Tags()["scalars"]
    picked = {}
    for chart in (chart for category in layout.category for chart in category.chart):
        if chart.WhichOneof("content") == "margin":  # exact tags: value, lower, upper
            (series,) = chart.margin.series
            picked[chart.title] = [t for t in (series.value, series.lower, series.upper) if t in scalars]
        else:
            picked[chart.title] = [t for t in scalars if any(re.match(rx, t) for rx in chart.multiline.tag)]
    return picked


def test_layout_is_written_once_as_tensorboards_custom_scalars(monitored) -> None:
    _, acc = monitored
    layout = read_layout(acc)
    assert [c.title for c in layout.category] == [BAND_CATEGORY, CATEGORY]
    (band,) = layout.category[0].chart
    assert band.title == BAND_CHART and band.WhichOneof("content") == "margin"
    # One per-layer chart per top-level module of the digits CNN.
    assert [c.title for c in layout.category[1].chart] == list(
        trainvitals_layout(groups=["features", "head"])[CATEGORY]
    )
    for chart in layout.category[1].chart:
        assert chart.WhichOneof("content") == "multiline"
        for regex in chart.multiline.tag:
            re.compile(regex)


def test_charts_pick_up_what_the_callbacks_log(monitored) -> None:
    trainer, acc = monitored
    picked = chart_tags(read_layout(acc), acc)
    assert sorted(picked[GRAD_NORM_CHART]) == [
        "grad_noise/expected_batch_norm",  # beside ‖ḡ‖, what it is expected to be: sqrt(‖G‖² + tr Σ/B)
        "grad_norm/noise_floor",
        "grad_norm/noise_floor_se",
        "grad_norm/total",
    ]
    assert picked[BAND_CHART] == ["grad_norm/band_norm", "grad_norm/band_floor", "grad_norm/band_edge"]
    # TensorBoard draws a margin chart only where its value, lower and upper series have the same steps.
    band_steps = [[e.step for e in acc.Scalars(tag)] for tag in picked[BAND_CHART]]
    assert band_steps[0] and band_steps[0] == band_steps[1] == band_steps[2]
    assert sorted(picked[IN_BAND_CHART]) == ["grad_norm/held_from_start", "grad_norm/in_noise_band"]
    # The run's one B_simple, with its interval's ends (the high one only where finite).
    b_simple = picked["B_simple and its 90 % interval (no high end: unbounded above) vs effective batch (examples)"]
    assert "grad_noise/b_simple" in b_simple and "grad_noise/b_simple_low" in b_simple
    assert set(b_simple) <= {"grad_noise/b_simple", "grad_noise/b_simple_low", "grad_noise/b_simple_high"}
    layers = {name for name, m in trainer.lightning_module.named_modules() if list(m.parameters(recurse=False))}
    for group in ("features", "head"):
        assert sorted(picked[f"per-layer gradient norm: {group}"]) == sorted(
            f"grad_norm/{m}" for m in layers if m.startswith(group + ".")
        )
    assert sorted(picked["integrity counters"]) == [
        "grad_norm/amp_skipped_steps",
        "grad_norm/nonfinite_steps",
        "grad_norm/spike_steps",
    ]
    # Every scalar a trainvitals callback logged lands on some chart.
    on_charts = {t for tags in picked.values() for t in tags}
    assert set(acc.Tags()["scalars"]) - on_charts == {"train/loss", "epoch"}


class TiedLM(pl.LightningModule):
    """A parameter on the LightningModule itself (learned positions) and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 12, width: int = 8, length: int = 6) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(1, length, width))
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self.head(self.body(self.tok(batch[:, :-1]) + self.pos))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_gradient_tag_is_on_a_chart_and_no_chart_is_empty(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            max_steps=24,
            accumulate_grad_batches=2,
            log_every_n_steps=2,
            limit_val_batches=0,
            callbacks=[
                GradNormMonitor(histogram_every_n_steps=0),
                BatchVarianceProbe(histogram_every_n_steps=0),
                GradNormEarlyStopping(patience=1000),
                TrainvitalsDashboard(progress_bar=False),
            ],
        )
    )
    data = torch.utils.data.DataLoader(torch.randint(0, 12, (256, 7)), batch_size=8, shuffle=True)
    trainer.fit(TiedLM(), data)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0}).Reload()
    picked = chart_tags(read_layout(acc), acc)
    # The root parameter has a chart of its own; the tied head none: its weight is the embedding's, logged as `tok`.
    assert [t for t in picked if t.startswith("per-layer gradient norm")] == [
        f"per-layer gradient norm: {group}" for group in ("pos", "tok", "body")
    ]
    assert picked["per-layer gradient norm: pos"] == ["grad_norm/pos"]
    assert sorted(picked["batch-gradient variance at the micro-batch and the full batch (Var ∝ 1/B)"]) == [
        "grad_noise/batch_grad_var/full_batch",
        "grad_noise/batch_grad_var/micro_batch",
    ]
    assert picked["per-layer GSNR"]
    gradient_tags = {t for t in acc.Tags()["scalars"] if t.startswith(("grad_norm/", "grad_noise/"))}
    assert gradient_tags - {t for tags in picked.values() for t in tags} == set()
    # Empty: the charts of callbacks this fit did not attach, and no other.
    assert {title for title, tags in picked.items() if not tags} == {
        "memory by category (bytes)",
        "saved activations per module (bytes)",
        "learning rate and its suggestion",
        "band-driven schedule: lr scale × the scheduler's lr (BandSchedule; each cut multiplies it)",
        f"band-driven schedule: lr cuts so far: {OUTLIERS_OFF}",
        "band-driven schedule: accumulate_grad_batches set by its batch growths (grow_batch=True)",
        "steps and examples over their minimum",
        "update/weight ratio ‖Δθ‖/‖θ‖ per layer (rule of thumb: ~1e-3 per step)",
        "update norm ‖Δθ‖ per layer",
        "cos(−Δθ, gradient) per layer (1: plain SGD)",
        "Adam: step per unit lr ‖m̂/(√v̂+ε)‖ per layer",
        "activation rms per module",
        "activation max |x| per module",
        "activation kurtosis per module (3: Gaussian)",
        "dead units per ReLU (share)",
        "inactive units per GELU, SiLU, ... (share)",
    }


@pytest.mark.parametrize(
    ("tag", "is_layer"),
    [
        ("grad_norm/features.0", True),
        ("grad_norm/optimizer_1/head.3", True),
        ("grad_norm/unregistered.2", True),
        ("grad_norm/total", False),
        ("grad_norm/optimizer_0/total", False),
        ("grad_norm/total_head", True),
        ("grad_norm/in_noise_band", False),
        ("grad_norm/hist/features.0", False),
        ("grad_noise/b_simple", False),
    ],
)
def test_per_layer_regex(tag: str, is_layer: bool) -> None:
    assert bool(re.match(PER_LAYER_GRAD_NORM, tag)) is is_layer


def test_progress_bar_shows_the_latest_norm_and_band(monitored) -> None:
    trainer, acc = monitored
    shown = trainer.progress_bar_metrics
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor))
    # The last logging step of 24 steps with log_every_n_steps=2 is step 22; the bar keeps that value.
    logged = dict((e.step, e.value) for e in acc.Scalars("grad_norm/total"))
    assert shown["grad_norm"] == pytest.approx(logged[22], rel=1e-6)
    assert float(monitor.last_total[0]) != pytest.approx(logged[22])  # step 5 ran after it; the bar did not sync for it
    assert_band_ratio(
        shown["band_ratio"],
        acc,
        22,
        next(cb for cb in trainer.callbacks if isinstance(cb, GradNormEarlyStopping)).margin,
    )
    assert "grad_norm" not in trainer.logged_metrics  # progress bar only: the monitor owns the logged tag


def assert_band_ratio(shown: float, acc: EventAccumulator, step: int, margin: float) -> None:
    """The bar's ratio is the band's smoothed ‖G‖² (the slow EMA's, estimate.py rule 7) over margin · tr(Σ)/B =
    margin · floor², the stopper's logged band ratio, and ≤ 1 exactly when the stopper logged the step in its band."""
    logged = {
        tag: {e.step: e.value for e in acc.Scalars(tag)}[step]
        for tag in ("grad_norm/band_ratio", "grad_norm/band_norm", "grad_norm/noise_floor", "grad_norm/in_noise_band")
    }
    floor_sq = logged["grad_norm/noise_floor"] ** 2
    assert shown == pytest.approx(logged["grad_norm/band_ratio"], rel=1e-5)
    assert shown == pytest.approx((logged["grad_norm/band_norm"] ** 2 - floor_sq) / (margin * floor_sq), rel=1e-3)
    assert (shown <= 1) == bool(logged["grad_norm/in_noise_band"])


def test_progress_bar_band_follows_the_stopper_fed_by_a_probe(tmp_path: Path) -> None:
    # No accumulation, one device: the stopper's noise comes from the probe.
    stopper = GradNormEarlyStopping(patience=1000)
    trainer, acc = fit(
        tmp_path,
        BatchVarianceProbe(histogram_every_n_steps=0),
        stopper,
        TrainvitalsDashboard(),
        accumulate_grad_batches=1,
        max_steps=25,
        log_every_n_steps=4,
    )
    assert_band_ratio(trainer.progress_bar_metrics["band_ratio"], acc, 24, stopper.margin)
    assert int(stopper.noise.count) == 0  # the stopper's own estimate is empty: the band came from the probe


@pytest.mark.parametrize(("margin", "ratio"), [(None, 0.5), (1.0, 0.5), (0.2, 2.5)])
def test_noise_band_uses_the_stoppers_margin(margin: float | None, ratio: float) -> None:
    probe = BatchVarianceProbe()
    probe.effective_batch_size = 64
    # ‖G‖² = 0.5 · tr(Σ)/B: in the band with margin 1 (B <= B_simple), not with margin 0.2.
    for _ in range(20):  # a decision needs 20 measurements
        probe.noise_source.update(torch.tensor(0.5 * 6.4 / 64), torch.tensor(6.4))
    callbacks = [probe] + ([GradNormEarlyStopping(margin=margin)] if margin is not None else [])
    vitals = Vitals(*callbacks)
    vitals.shared(GRADIENT_NOISE, GradientNoise).attach(probe.noise_source)
    assert progress_bar_values(vitals) == {"band_ratio": pytest.approx(ratio)}


def test_diagnosis_text_panels_at_fit_end(tmp_path: Path) -> None:
    callbacks = [
        GradNormEarlyStopping(patience=1000),
        LRScalingAdvisor(verbose=False),
        MemoryTopologyProfiler(measure_every_n_steps=2),
        GraphIntegrityCallback(),
        GradNormMonitor(),
        TrainvitalsDashboard(progress_bar=False),
    ]
    trainer, acc = fit(tmp_path, *callbacks, max_steps=6)
    expected = {type(cb).__name__: cb.summary_markdown() for cb in callbacks[:5]}
    for name, markdown in expected.items():
        (event,) = acc.Tensors(f"{DIAGNOSIS_TAG}/{name}/text_summary")
        assert event.step == trainer.global_step == 6
        assert tensor_util.make_ndarray(event.tensor_proto).item().decode() == markdown
    assert (
        "| base lr |" in expected["LRScalingAdvisor"] and "### Saved for backward" in expected["MemoryTopologyProfiler"]
    )
    assert "did not stop the run" in expected["GradNormEarlyStopping"]
    assert expected["GradNormMonitor"].startswith("| optimizer | steps | last ‖g‖ |")
    assert expected["GraphIntegrityCallback"].startswith("**Graph integrity: clean bill of health.**")
    assert "grad_norm" not in trainer.progress_bar_metrics


def test_without_tensorboard_nothing_breaks(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=2,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
            callbacks=[GradNormMonitor(), TrainvitalsDashboard()],
            log_every_n_steps=1,
        )
    )
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=16))
    assert "grad_norm" in trainer.progress_bar_metrics and "band_ratio" not in trainer.progress_bar_metrics
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_the_layout_follows_the_loggers_prefix(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="run", prefix="fold1", default_hp_metric=False)
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            max_steps=24,
            accumulate_grad_batches=2,
            log_every_n_steps=2,
            limit_val_batches=0,
            callbacks=[GradNormMonitor(), GradNormEarlyStopping(), TrainvitalsDashboard(progress_bar=False)],
        )
    )
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=16))
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0}).Reload()
    picked = chart_tags(read_layout(acc), acc)
    assert sorted(picked[GRAD_NORM_CHART]) == [
        "fold1-grad_noise/expected_batch_norm",
        "fold1-grad_norm/noise_floor",
        "fold1-grad_norm/noise_floor_se",
        "fold1-grad_norm/total",
    ]
    assert picked[BAND_CHART] == [
        "fold1-grad_norm/band_norm",
        "fold1-grad_norm/band_floor",
        "fold1-grad_norm/band_edge",
    ]
    assert picked["per-layer gradient norm: head"] and all(
        t.startswith("fold1-grad_norm/head.") for t in picked["per-layer gradient norm: head"]
    )
    # Unprefixed tags are not picked up: the regexes are anchored at the prefix.
    assert not any(re.match(rx, "grad_norm/total") for rx in read_layout(acc).category[1].chart[0].multiline.tag)


def test_every_callback_says_one_line_at_fit_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """By default: one line each at fit end, and no table on the console (they go to TensorBoard and the report)."""
    callbacks = [
        GraphIntegrityCallback(),
        GradNormMonitor(),
        BatchVarianceProbe(),
        GradNormEarlyStopping(patience=1000),
        LRScalingAdvisor(),
        MemoryTopologyProfiler(measure_every_n_steps=2),
        TrainvitalsDashboard(progress_bar=False),
    ]
    with caplog.at_level("INFO"):
        fit(tmp_path, *callbacks, accumulate_grad_batches=1, max_steps=6)
    assert [r.getMessage() for r in caplog.records if "\n" in r.getMessage()] == []
    fit_end = [r.getMessage() for r in caplog.records if r.funcName == "on_fit_end"]
    said = {
        type(cb).__name__: [m for m in fit_end if m.startswith(f"trainvitals {type(cb).__name__}: ")]
        for cb in callbacks
    }
    assert len(fit_end) == len(callbacks)
    assert all(len(lines) == 1 and "\n" not in lines[0] for lines in said.values()), said
    assert said["GraphIntegrityCallback"][0].endswith("clean: no findings in 1 graph walk(s) and 3 gradient check(s).")
    # The stopper says why it did not stop: 6 steps are fewer than its min_steps of 100.
    assert (
        "did not stop the run: the run ended after 6 optimizer steps, before min_steps=100"
        in said["GradNormEarlyStopping"][0]
    )
    assert "6 steps measured" in said["GradNormMonitor"][0]
    assert "from 6 measured optimizer steps" in said["BatchVarianceProbe"][0]


def test_the_fit_end_line_names_the_report_in_every_logger_s_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A TensorBoardLogger and a CSVLogger each get the report in their folder; the line names both copies."""
    loggers = [TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False), CSVLogger(tmp_path, name="csv")]
    callbacks = [GradNormMonitor(), TrainvitalsDashboard(progress_bar=False)]
    trainer = pl.Trainer(**trainer_kwargs(logger=loggers, max_steps=4, limit_val_batches=0, callbacks=callbacks))
    with caplog.at_level("INFO"):
        trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=16))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainvitals TrainvitalsDashboard:")]
    folders = [Path(lg.log_dir) for lg in loggers]
    pages = [f / REPORT_HTML if (f / REPORT_HTML).exists() else f / REPORT_JSON for f in folders]
    assert len(set(folders)) == 2 and all(page.is_file() for page in pages)
    named = line.split("the report: ", 1)[1].split(", ")
    assert named == [str(page.resolve()) for page in pages]


def _opened_runs(command: str) -> set[Path]:
    """The run folders TensorBoard reads for ``command``: its own walk of ``--logdir`` for folders with event files,
    or the folders its own parser takes from ``--logdir_spec``."""
    flag, value = command.removeprefix("tensorboard ").split(" ", 1)
    if flag == "--logdir_spec":
        return {Path(path) for path in data_ingester._parse_event_files_spec(value)}
    return {Path(folder).resolve() for folder in io_wrapper.GetLogdirSubdirectories(value)}


@pytest.mark.parametrize("apart", [True, False])
def test_the_fit_end_line_opens_every_tensorboard_loggers_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, apart: bool
) -> None:
    """Two TensorBoardLoggers in folders of their own (or one folder under two prefixes): the command the fit-end
    line shows opens the runs of both, as TensorBoard itself finds runs under its --logdir."""
    roots = (tmp_path / "a", tmp_path / "deep" / "b") if apart else (tmp_path, tmp_path)
    loggers = [
        TensorBoardLogger(roots[0], name="tb", version=0, default_hp_metric=False),
        TensorBoardLogger(roots[1], name="tb", version=0, prefix="" if apart else "other", default_hp_metric=False),
    ]
    callbacks = [GradNormMonitor(), TrainvitalsDashboard(progress_bar=False, report=False)]
    trainer = pl.Trainer(**trainer_kwargs(logger=loggers, max_steps=2, limit_val_batches=0, callbacks=callbacks))
    with caplog.at_level("INFO"):
        trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=16))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainvitals TrainvitalsDashboard:")]
    command = line.split("Custom Scalars: ", 1)[1].rstrip(".")
    folders = {Path(lg.log_dir).resolve() for lg in loggers}
    assert len(folders) == (2 if apart else 1)
    assert folders <= _opened_runs(command)
    if not apart:  # one folder: named itself, as before
        assert command == f"tensorboard --logdir {loggers[0].log_dir}"


def test_the_tensorboard_command_names_each_folder_without_a_common_parent_but_the_root(tmp_path: Path) -> None:
    """Walking the filesystem's root is no answer: each folder is named, as TensorBoard's parser reads them back; one
    folder named twice is named once."""
    apart = [str(tmp_path / "a"), "/" + "b-elsewhere"]  # their common parent is the root: walking it is no answer
    command = tensorboard_command(apart)
    assert command.startswith("tensorboard --logdir_spec ") and _opened_runs(command) == {Path(f) for f in apart}
    same = [str(tmp_path / "x"), str(tmp_path / "x" / ".." / "x")]
    assert tensorboard_command(same) == f"tensorboard --logdir {same[0]}"
