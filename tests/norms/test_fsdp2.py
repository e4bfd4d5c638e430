"""GradNormMonitor, GradNormEarlyStopping and UpdateMonitor under FSDP2: parameters and gradients are DTensor
shards on each rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_fsdp2_fit.py")


@pytest.fixture(scope="module", params=["2", "inf"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp2") / "rank"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), request.param], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_norms_are_those_of_the_full_gradient_not_of_a_shard(ranks):
    # p = 2 and p = ∞; the last layer's shard is empty on rank 1 (FSDP2 shards dim 0 unevenly).
    logged = ranks[0]["series"]
    totals = [v for _, v in logged["grad_norm/total"]]
    assert totals == pytest.approx(ranks[0]["reference"], rel=1e-6)
    layers = [[v for _, v in logged[f"grad_norm/net.{i}"]] for i in (0, 2, 4)]
    for step, total in enumerate(totals):
        combined = [layer[step] for layer in layers]
        assert total == pytest.approx(
            max(combined) if ranks[0]["norm_type"] == "inf" else sum(v**2 for v in combined) ** 0.5, rel=1e-6
        )
    # Both ranks measured the same full norm; only rank 0 writes to the logger.
    assert ranks[1]["last_total"] == pytest.approx(ranks[0]["last_total"], rel=1e-12)
    assert ranks[1]["series"] == {}


@pytest.mark.slow
def test_the_stop_is_taken_on_every_rank_at_the_same_step(ranks):
    assert ranks[0]["stopped_step"] == ranks[1]["stopped_step"] is not None
    assert ranks[0]["global_step"] == ranks[1]["global_step"] < 8


@pytest.mark.slow
def test_update_norms_are_those_of_the_full_parameters(ranks):
    """‖Δθ‖ and ‖Δθ‖/‖θ‖ over DTensor shards: those of the whole parameters, gathered with ``full_tensor()``."""
    logged = ranks[0]["series"]
    assert [v for _, v in logged["update/total_norm"]] == pytest.approx(ranks[0]["reference_updates"], rel=1e-5)
    assert [v for _, v in logged["update/total_ratio"]] == pytest.approx(ranks[0]["reference_ratios"], rel=1e-5)


@pytest.mark.slow
def test_histograms_of_sharded_gradients_are_left_out_with_one_notice(ranks):
    # Histograms every 4 steps, from step 0: rank 0 holds only its shards, so it says so once and logs on.
    assert ranks[0]["histogram_notices"] == 1
    assert len(ranks[0]["series"]["grad_norm/total"]) == ranks[0]["global_step"] > 1
