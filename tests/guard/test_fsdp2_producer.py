"""The producer of a NaN under FSDP2 (2 CPU ranks, gloo): named on both ranks, without a hang."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_fsdp2_guard_fit.py")


@pytest.fixture(scope="module", params=["guard", "anomaly", "monitor"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp2_producer") / "rank"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), request.param], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_the_producer_is_named_on_both_ranks_and_the_fit_ends(ranks):
    """Only rank 1's batch of step 3 makes the -inf; the averaged gradient is NaN on both ranks, both re-run their
    batch in step (the forward's all-gathers, the backward taken on both), and both name ``net.2``."""
    which, (zero, one) = ranks
    assert zero["global_step"] == one["global_step"] == 6  # no hang, the run went on
    assert zero["producer"] == one["producer"] == ["forward", "net.2", "LogBackward0"]
    assert zero["rerun"] == one["rerun"] == [3]
    assert zero["hooks_left"] == one["hooks_left"] == 0
    if which != "monitor":
        assert zero["events"] == one["events"] == [[3, "skip"]]
    said = " ".join(zero["warnings"])
    assert "`net.2` (LogBackward0) in forward" in said and one["warnings"] == []  # rank zero speaks
    # detect_anomaly would stop each rank's backward at a node of its own: the flags search stands in, and says so.
    assert ("not detect_anomaly" in said) == (which == "anomaly")
