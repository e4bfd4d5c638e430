"""The walkthrough notebook runs from top to bottom (its own cells assert the measurements) and plots."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[dev]'")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "walkthrough.ipynb"


def test_walkthrough_executes_and_checks_the_claims(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # A failing cell (one of the notebook's own asserts) raises CellExecutionError here.
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    stdout = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4  # norm vs floor, per-layer norms, noise scale and GSNR, memory
    # margin=1 at a batch of 64 sits at the band's edge from the start: a band held from the start is said, with a
    # batch, and not stopped on; a stop comes only after the run was shown out of the band.
    # (Which of the two varies from run to run: this fit is not bit-reproducible; see the session notes.)
    assert "did not stop the run" in stdout or (
        "stopped at optimizer step" in stdout and "after it had been out of the band" in stdout
    )
    assert "‖∇ sum-loss‖ / ‖∇ mean-loss‖ over a batch of 64: 64.00" in stdout
    assert "steps below 1e-3: 0 of" in stdout
    findings = [o for o in outputs if "text/markdown" in o.get("data", {})]
    assert "unreachable_params" in findings[0]["data"]["text/markdown"]
