"""The integrity checks as classes, and the finding kinds' table that the callback and the report share."""

from __future__ import annotations

import re

from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.integrity.findings import FindingKind
from trainvitals.report.command import CRITICAL_COUNTERS, LAST_WINDOW


def every_check() -> list:
    return GraphIntegrityCallback(check_batch_independence=True, detect_anomaly_steps=1)._build_checks()


def test_every_kind_is_filed_by_exactly_one_check():
    owners = [kind for check in every_check() for kind in check.kinds]
    assert sorted(owners) == sorted(FindingKind)


def test_each_checks_state_is_saved_under_its_class_name():
    callback = GraphIntegrityCallback(check_batch_independence=True, detect_anomaly_steps=1)
    state = callback.state_dict()
    assert set(state) == {"walks", "grad_checks", "fit", "checks"}
    assert state["fit"] == callback._fit.state_dict()
    assert state["checks"] == {type(check).__name__: check.state_dict() for check in callback._checks}
    assert len(state["checks"]) == len(callback._checks)  # one class a check
    assert state["checks"]["ZeroLrCheck"] == {"streak": {}} and state["checks"]["BatchMixingCheck"] == {"done": False}


def test_the_report_lists_every_kind_found_critical_or_as_a_warning():
    assert all((kind.spec.critical is None) != (kind.spec.warning is None) for kind in FindingKind)


def test_the_report_judges_each_critical_kind_by_one_row_and_no_other_kind():
    integrity = [(pattern, message) for section, pattern, message in CRITICAL_COUNTERS if section == "integrity"]
    for kind in FindingKind:
        rows = [message for pattern, message in integrity if re.match(pattern, kind.report_tag)]
        assert rows == ([kind.spec.critical] if kind.spec.critical else []), kind
        # A row matches no other tag the callback logs for the kind.
        others = {kind.counter, kind.report_tag} - {kind.report_tag}
        assert not [p for p, _ in integrity for tag in others if re.match(p, tag)], kind
    last = {
        pattern
        for pattern, _ in integrity
        if any(re.match(pattern, k.report_tag) for k in FindingKind if k.spec.last_window)
    }
    assert last == LAST_WINDOW
