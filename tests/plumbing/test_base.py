"""The callbacks' shared base: declared state (reset, checkpoint round-trip, reduction over ranks), messages."""

from __future__ import annotations

import functools
import warnings
from enum import Enum
from types import SimpleNamespace

import pytest
import torch

from trainvitals import GraphIntegrityCallback, MemoryTopologyProfiler
from trainvitals.noise.estimators import BiasCorrectedEMA
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.state import DeclaredState


class Phase(Enum):
    START = "start"
    DONE = "done"


class Window(DeclaredState):
    """A nested state: its own declarations, one of them reduced."""

    def __init__(self) -> None:
        self.add_state("opened", 0)
        self.add_state("bad", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum", persistent=False)


class Counting(TrainvitalsCallback):
    def __init__(self, beta: float = 0.5) -> None:
        super().__init__()
        self.key_state_by(beta=beta)
        self.add_state("steps", 0)
        self.add_state("seen", [], persistent=False)
        self.add_state("streak", torch.zeros((), dtype=torch.long), key="run")
        self.add_state("phase", Phase.START)
        self.add_state("ema", functools.partial(BiasCorrectedEMA, beta))
        self.add_state("total", torch.zeros(3), dist_reduce_fx="sum")
        self.add_state("average", torch.zeros(()), dist_reduce_fx="mean")
        self.add_state("peak", torch.zeros(2), dist_reduce_fx="max")
        self.add_state("window", Window)


def _trainer(world_size: int = 1, other: dict[str, torch.Tensor] | None = None):
    """A trainer with a logger; with two ranks its strategy combines this rank's packed tensor with
    ``other[op]``, the other rank's for that operation (its ``"max"`` for a gather); with one, it gives the
    tensor back as a single-device strategy does."""
    if world_size == 1:
        strategy = SimpleNamespace(reduce=lambda t, reduce_op: t, all_gather=lambda t: t)
    else:
        strategy = SimpleNamespace(
            reduce=lambda t, reduce_op: t + other[reduce_op] if reduce_op == "sum" else (t + other[reduce_op]) / 2,
            all_gather=lambda t: torch.stack([t, other["max"]]),
        )
    return SimpleNamespace(loggers=[object()], world_size=world_size, strategy=strategy)


def test_declared_state_resets_to_fresh_defaults_on_fit_setup_only() -> None:
    cb = Counting()
    assert cb.state_key == "Counting{'beta': 0.5}"
    cb.steps, cb.phase = 5, Phase.DONE
    cb.seen.append(1)
    cb.ema.update(torch.tensor(2.0))
    cb.window.opened = 3
    cb.setup(_trainer(), None, "validate")
    assert cb.steps == 5 and cb.seen == [1] and cb.window.opened == 3
    cb.setup(_trainer(), None, "fit")
    assert cb.steps == 0 and cb.seen == [] and cb.phase is Phase.START and int(cb.ema.count) == 0
    assert cb.window.opened == 0
    assert Counting().seen is not cb.seen  # each reset copies the default


def test_persistent_state_round_trips_under_its_keys_nested_ones_by_their_own_declarations() -> None:
    cb = Counting()
    cb.steps, cb.streak, cb.phase = 7, torch.tensor(4), Phase.DONE
    cb.ema.update(torch.tensor(2.0))
    cb.seen.append("not saved")
    cb.window.opened, cb.window.bad = 2, torch.tensor(5)
    state = cb.state_dict()
    assert set(state) == {"steps", "run", "phase", "ema", "total", "average", "peak", "window"}
    assert state["run"] == 4 and type(state["run"]) is int and state["phase"] == "DONE"
    assert state["ema"] == cb.ema.state_dict() and state["window"] == {"opened": 2}

    restored = Counting()
    restored.load_state_dict(state)
    assert restored.steps == 7 and restored.phase is Phase.DONE and restored.seen == []
    assert restored.streak.dtype == torch.long and int(restored.streak) == 4
    assert float(restored.ema.value) == pytest.approx(2.0) and int(restored.ema.count) == 1
    assert restored.window.opened == 2 and int(restored.window.bad) == 0
    partial = Counting()
    partial.load_state_dict({"steps": 2.0})  # a key missing keeps its default; a number saved as a float
    assert partial.steps == 2 and type(partial.steps) is int and partial.phase is Phase.START


def test_states_with_a_reduction_are_combined_over_ranks_in_place() -> None:
    cb = Counting()
    cb.total, cb.average, cb.peak = torch.tensor([1.0, 2.0, 3.0]), torch.tensor(4.0), torch.tensor([5.0, -1.0])
    other = {
        "sum": torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64),
        "mean": torch.tensor([8.0], dtype=torch.float64),
        "max": torch.tensor([2.0, 7.0], dtype=torch.float64),
    }
    cb.window.bad = torch.tensor(3)
    other["sum"] = torch.cat([other["sum"], torch.tensor([4.0], dtype=torch.float64)])  # the nested state's
    cb.reduce_states(_trainer(world_size=2, other=other))
    assert cb.total.tolist() == [11.0, 22.0, 33.0] and cb.total.dtype == torch.float32
    assert float(cb.average) == 6.0 and cb.average.shape == ()
    assert cb.peak.tolist() == [5.0, 7.0]
    assert cb.window.bad.dtype == torch.long and int(cb.window.bad) == 7
    single = Counting()
    single.total = torch.ones(3)
    single.reduce_states(_trainer(world_size=1))
    assert single.total.tolist() == [1.0, 1.0, 1.0]


def test_messages_name_the_trainvitals_class_and_cannot_measure_warns_once_or_raises() -> None:
    class Mine(GraphIntegrityCallback):
        pass

    assert Mine().message("x") == "trainvitals GraphIntegrityCallback: x"
    assert Mine().message("x", "loss_no_grad") == "trainvitals GraphIntegrityCallback [loss_no_grad]: x"
    profiler = MemoryTopologyProfiler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiler.cannot_measure("no batch.")
        profiler.cannot_measure("no batch.")
    assert [str(w.message) for w in caught] == ["trainvitals MemoryTopologyProfiler: no batch."]
    with pytest.raises(RuntimeError, match="^trainvitals MemoryTopologyProfiler: no batch.$"):
        MemoryTopologyProfiler(strict=True).cannot_measure("no batch.")


def test_an_unknown_reduction_or_one_of_a_state_that_is_no_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="dist_reduce_fx"):
        TrainvitalsCallback().add_state("x", torch.zeros(()), dist_reduce_fx="prod")
    with pytest.raises(ValueError, match="dist_reduce_fx.*`x`"):
        TrainvitalsCallback().add_state("x", 0, dist_reduce_fx="sum")


@pytest.mark.slow
def test_a_fit_prints_trainvitals_warnings_without_file_path_or_source_line() -> None:
    """Python prints ``file:line: UserWarning: text`` and the source line; ours print as their text alone
    (Lightning drops the source line of its own), in a real fit's stderr."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parents[1]
    script = (
        "import sys, warnings; sys.path.insert(0, sys.argv[1]); warnings.simplefilter('always')\n"
        "import lightning.pytorch as pl\n"
        "from _models import Regressor, loader, regression_data\n"
        "from trainvitals import GradNormEarlyStopping\n"
        "pl.Trainer(max_steps=3, accelerator='cpu', logger=False, enable_checkpointing=False,\n"
        "    enable_progress_bar=False, enable_model_summary=False, callbacks=[GradNormEarlyStopping()]\n"
        ").fit(Regressor(), loader(regression_data(), 16))\n"
    )
    src = str(Path(__file__).parents[2] / "src")
    env = {**__import__("os").environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tests)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    ours = [i for i, line in enumerate(lines) if "trainvitals GradNormEarlyStopping" in line]
    assert ours, done.stderr  # the fit ends before the stopper could stop: it says so
    for i in ours:
        assert lines[i].startswith("trainvitals GradNormEarlyStopping: "), lines[i]
        assert i + 1 == len(lines) or "self.warn" not in lines[i + 1]  # no source line under it
    assert any("min_steps 100" in lines[i] for i in ours)
    assert "stopper.py" not in done.stderr and "UserWarning" not in "\n".join(lines[i] for i in ours)
