"""The example scripts run as a user runs them, and say what they are there to show.

The digits example is run by the browser test and the fault gallery by its own test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_char_transformer_shows_per_example_noise_and_attention_memory(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "char_transformer.py"),
            "--logdir",
            str(tmp_path),
            "--max-steps",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]  # the example's status is its report's: healthy
    # Every parameter gets exact per-example gradient norms, in the same backward.
    assert "per-example norms in backward: Embedding×2, LayerNorm×5, Linear×9 (100.0% of parameters)" in out
    report = done.stdout[done.stdout.index("run version_0: ok") :]
    assert "B_simple = tr Σ / ‖G‖²" in report
    # Attention's (B, H, T, T) probabilities make each attention block the largest saver of activations.
    saved = [line.split()[2] for line in report.splitlines() if line.strip().startswith("saved by ")]
    assert set(saved[:2]) == {"blocks.0.attn", "blocks.1.attn"}
