"""The integrity checks as registered classes, and the finding kinds' rows that the callback and the report share."""

from __future__ import annotations

import re

import pytest
from conftest import RecordingLogger, trainer_kwargs

from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.integrity.checks import (
    Check,
    Fit,
    finding_kind,
    finding_kinds,
    register_check,
    registered_checks,
    unregister_check,
    window_labels,
)
from trainvitals.integrity.findings import FindingKind, critical_counters, warning_counters
from trainvitals.report.command import CRITICAL_COUNTERS, LAST_WINDOW


def every_check() -> list:
    return GraphIntegrityCallback(check_batch_independence=True, detect_anomaly_steps=1)._build_checks()


def test_every_kind_is_filed_by_exactly_one_check():
    owners = [kind.value for check in every_check() for kind in check.kinds]
    assert sorted(owners) == sorted(kind.value for kind in finding_kinds())
    assert len(owners) == len(set(owners))
    assert [type(check) for check in every_check()] == list(registered_checks())


def test_the_arguments_build_the_optional_checks_only_when_asked():
    names = [type(check).__name__ for check in GraphIntegrityCallback()._build_checks()]
    assert "BatchMixingCheck" not in names and "AnomalyModeCheck" not in names
    assert names == [
        c.__name__ for c in registered_checks() if c.__name__ not in ("BatchMixingCheck", "AnomalyModeCheck")
    ]


def test_each_checks_state_is_saved_under_its_class_name():
    callback = GraphIntegrityCallback(check_batch_independence=True, detect_anomaly_steps=1)
    state = callback.state_dict()
    assert set(state) == {"walks", "grad_checks", "fit", "checks"}
    assert state["fit"] == callback._fit.state_dict()
    assert state["checks"] == {type(check).__name__: check.state_dict() for check in callback._checks}
    assert len(state["checks"]) == len(callback._checks)  # one class a check
    assert state["checks"]["ZeroLrCheck"] == {"streak": {}} and state["checks"]["BatchMixingCheck"] == {"done": False}


@pytest.mark.parametrize(
    "row",
    [
        {"critical": "broken ({n})", "warning": "odd"},  # both
        {},  # neither
        {"warning": "odd", "label": "words"},  # a label without a metric
        {"warning": "odd", "last_window": True},
    ],
)
def test_a_kind_is_critical_or_a_warning_and_labels_only_a_metric(row):
    with pytest.raises(ValueError, match="odd_kind"):
        FindingKind("odd_kind", **row)
    with pytest.raises(ValueError, match="`value`"):
        FindingKind("Odd kind", warning="odd")


def test_the_report_lists_every_kind_found_critical_or_as_a_warning():
    kinds = finding_kinds()
    assert all((kind.critical is None) != (kind.warning is None) for kind in kinds)
    listed = {pattern for _, pattern, _ in warning_counters(kinds)}
    assert listed == {re.escape(k.counter) + "$" for k in kinds if k.critical is None}


def test_the_report_judges_each_critical_kind_by_one_row_and_no_other_kind():
    integrity = [(pattern, message) for section, pattern, message in CRITICAL_COUNTERS if section == "integrity"]
    for kind in finding_kinds():
        rows = [message for pattern, message in integrity if re.match(pattern, kind.report_tag)]
        assert rows == ([kind.critical] if kind.critical else []), kind
        # A row matches no other tag the callback logs for the kind.
        others = {kind.counter, kind.report_tag} - {kind.report_tag}
        assert not [p for p, _ in integrity for tag in others if re.match(p, tag)], kind
    last = {
        pattern
        for pattern, _ in integrity
        if any(re.match(pattern, k.report_tag) for k in finding_kinds() if k.last_window)
    }
    assert last == LAST_WINDOW


def test_every_window_metric_is_labelled_in_words_in_the_order_of_the_checks():
    labels = window_labels()
    metrics = [k.metric for k in finding_kinds() if k.metric]
    assert [m for m in labels if m in metrics] == metrics  # each check's kinds' metrics, in check order
    assert labels["unregistered_params"] == "of those, not registered on the module"  # a check's own metric
    assert list(labels).index("unregistered_params") == list(labels).index("unoptimized_params") + 1
    assert all(label and "_" not in label for label in labels.values())


# ------------------------------------------------------------------------------- a check of one's own

CONSTANT_LOSS = FindingKind(
    "constant_loss", metric="constant_losses", label="losses equal to the last one", warning="a loss that never moves"
)


class ConstantLossCheck(Check):
    """A check in a few lines: the same loss value twice in a row (the one-file, one-registration example)."""

    kinds = (CONSTANT_LOSS,)

    def __init__(self) -> None:
        self._last: float | None = None
        self._same = 0

    def on_before_backward(self, fit: Fit, trainer, pl_module, loss) -> None:
        value = float(loss.detach())  # a test's check: a host sync per step is fine here
        if value == self._last:
            self._same += 1
            fit.record(CONSTANT_LOSS, (), f"the loss was {value} again")
        self._last = value

    def on_window_close(self, fit: Fit, trainer, complete: bool) -> dict[str, float]:
        same, self._same = self._same, 0
        return {CONSTANT_LOSS.window_tag: float(same)}


@pytest.fixture
def constant_loss_check():
    register_check(order=95)(ConstantLossCheck)
    yield ConstantLossCheck
    unregister_check(ConstantLossCheck)


def test_a_registered_check_runs_in_its_order_and_reaches_the_report_tables(constant_loss_check):
    order = [c.__name__ for c in registered_checks()]
    assert order.index("ConstantLossCheck") == order.index("ZeroLrCheck") + 1  # 90 < 95 < 100
    assert finding_kind("constant_loss") is CONSTANT_LOSS
    assert window_labels()["constant_losses"] == "losses equal to the last one"
    assert ("integrity", r"graph/findings_constant_loss$", "a loss that never moves") in warning_counters(
        finding_kinds()
    )
    assert not [row for row in critical_counters(finding_kinds()) if "constant" in row[1]]


def test_a_registered_check_files_and_logs_in_a_fit(constant_loss_check):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Constant(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def training_step(self, batch, batch_idx):
            return self.w - self.w.detach() + 1.0  # reaches the parameter (gradient 1), always 1.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logger = RecordingLogger()
    cb = GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1)
    data = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)
    with pytest.warns(UserWarning, match=r"\[constant_loss\]: the loss was 1.0 again"):
        pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[cb], logger=logger)).fit(Constant(), data)
    assert cb.counts[CONSTANT_LOSS] == 2  # steps 1 and 2 repeat step 0's loss
    assert logger.values("graph/constant_losses") == [0.0, 1.0, 1.0]
    assert logger.values(CONSTANT_LOSS.counter)[-1] == 2


def test_a_check_cannot_take_another_ones_order_or_kind(constant_loss_check):
    class Twin(Check):
        kinds = (FindingKind("constant_loss", warning="again"),)

    class Elsewhere(Check):
        pass

    with pytest.raises(ValueError, match="`order`: ConstantLossCheck is registered at 95"):
        register_check(order=95)(Elsewhere)
    with pytest.raises(ValueError, match="'constant_loss' is filed by ConstantLossCheck"):
        register_check(order=96)(Twin)
    with pytest.raises(TypeError, match="`order`"):
        register_check(order="last")
    with pytest.raises(TypeError, match="Check subclass"):
        register_check(order=97)(object)
    assert Twin not in registered_checks() and Elsewhere not in registered_checks()


def test_an_unregistered_check_leaves_the_tables():
    register_check(order=95)(ConstantLossCheck)
    unregister_check(ConstantLossCheck)
    assert ConstantLossCheck not in registered_checks()
    assert "constant_losses" not in window_labels()
    with pytest.raises(ValueError, match="constant_loss"):
        finding_kind("constant_loss")


@pytest.mark.slow
def test_the_report_reads_every_registered_kind_without_importing_lightning():
    """`trainvitals report` imports the checks to read their kinds: none of them imports Lightning on import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from trainvitals.report.command import CRITICAL_COUNTERS\n"
        "from trainvitals.integrity.checks import finding_kinds, registered_checks\n"
        "loaded = [m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'lightning_fabric'))]\n"
        "print(len(registered_checks()), len(finding_kinds()), loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(
        maxsplit=2
    )
    assert out[:2] == [str(len(registered_checks())), str(len(finding_kinds()))]
    assert out[2].strip() == "[]"
